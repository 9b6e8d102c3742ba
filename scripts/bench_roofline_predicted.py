"""A PREDICTED decode roofline for H100 and TPU v5e, from deviceless compiles (no hardware).

For SmolLM2 and an 8B-like model at B = 1 / 32 / 256 and 2k / 32k context, exact vs int8 vs
int4 KV: the engine's decode step compiled for each target, its bytes and FLOPs (XLA's cost
analysis plus the Pallas kernels' K/V reads, which XLA does not count; arithmetic where the
target gives no analysis) against the target's published HBM bandwidth and peak FLOP/s
(`kvjax.bench.predicted_roofline`). Beside it, kvjax's paged decode kernel and JAX's own TPU
ragged paged attention compiled alone on the same shapes. Every figure is predicted. Needs the
`deviceless` environment:

  make deviceless-setup
  JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv-deviceless/bin/python \\
      scripts/bench_roofline_predicted.py --output_json=docs/results/roofline_predicted.json

On a machine with a GPU (`scripts/device_check.sh` runs it), `--measure` times the same decode
step there and prints it beside the prediction for that GPU:

  python scripts/bench_roofline_predicted.py --measure --shapes=smollm2,8b --kvs=exact,int8 \
      --batches=32 --contexts=2048
"""

from __future__ import annotations

import json
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import app, flags, logging  # noqa: E402

from kvjax.bench import predicted_roofline as pr  # noqa: E402

_TARGETS = flags.DEFINE_list("targets", ["h100", "v5e"], "Targets (h100, a100, v5e, v6e).")
_SHAPES = flags.DEFINE_list("shapes", list(pr.FULL_LAYERS), "Model shapes.")
_KVS = flags.DEFINE_list("kvs", list(pr.KV_CODECS), "KV codecs.")
_BATCHES = flags.DEFINE_list("batches", [str(b) for b in pr.BATCHES], "Batch sizes B.")
_CONTEXTS = flags.DEFINE_list("contexts", [str(s) for s in pr.CONTEXTS], "Context lengths.")
_PEER_TARGET = flags.DEFINE_string("peer_target", "v5e", "TPU target of the kernel peers "
                                   "('' to skip them).")
_MEASURE = flags.DEFINE_bool(
    "measure", False, "On a GPU: time the decode step of each --shapes x --kvs x --batches x "
    "--contexts point on the device and print it beside the prediction for that GPU, instead "
    "of compiling deviceless.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Write the records here.")


def measure(batches: list[int], contexts: list[int]) -> None:
    points = pr.all_points(("device",), _SHAPES.value, _KVS.value, batches, contexts)
    records = [pr.measure_decode_step(p) for p in points]
    print("Decode step on this GPU: measured beside predicted:")
    print(pr.format_measured(records))
    if _OUTPUT.value:
        pathlib.Path(_OUTPUT.value).write_text(json.dumps(records, indent=1) + "\n")


def main(argv):
    del argv
    batches, contexts = [int(b) for b in _BATCHES.value], [int(s) for s in _CONTEXTS.value]
    if _MEASURE.value:
        measure(batches, contexts)
        return
    steps, peers = [], []
    for point in pr.all_points(_TARGETS.value, _SHAPES.value, _KVS.value, batches, contexts):
        steps.append(pr.predict(point))
        logging.info("%s: %s", point.id, steps[-1]["status"])
        write(steps, peers)  # after each point: a long run that is stopped keeps what it did
    print("Predicted decode step (every figure predicted, none measured):")
    print(pr.format_table(steps))
    if _PEER_TARGET.value:
        points = pr.all_points((_PEER_TARGET.value,), _SHAPES.value, ("exact",), batches,
                               contexts)
        peers = [pr.predict_peer(k, p) for p in points for k in pr.PEERS]
        print()
        print("Attention kernels alone, exact bf16 pages, per layer (predicted):")
        print(pr.format_peer_table(peers))
    write(steps, peers)


def write(steps: list[dict], peers: list[dict]) -> None:
    if _OUTPUT.value:
        path = pathlib.Path(_OUTPUT.value)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(steps=steps, peers=peers, published={
            k: vars(v) for k, v in pr.PUBLISHED.items()}), indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
