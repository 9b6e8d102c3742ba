"""Times the decoder's matmuls alone: the native CPU kernel against XLA's, per token count.

For each of --tokens, one jitted call runs the embedded model's decoder layers (attention
replaced by a cheap stand-in, so only the projections and the MLP remain) and the output head
over that many token rows, once with `kvjax.models.linear.native_linear` reading each layer of
the stacked weights in place and once with XLA's matmuls of the layer scan's slices. The calls
alternate, so a noisy machine slows them alike. Prints the median ms per call beside the floor
(weight bytes over the measured memory bandwidth, or FLOPs over the measured matmul rate,
whichever is larger); this is what sets `linear.NATIVE_MAX_TOKENS`. With --sources, each
kernel source (e.g. an older one saved with `git show REV:kvjax/models/linear.cc > old.cc`)
is built and run side by side in place of the packaged one. --dtype bfloat16 loads the
weights in bfloat16 (the floor still takes the float32 matmul rate).

  python scripts/bench_linear.py --tokens=1,8,32,64,128,256 --output_json=/tmp/linear.json
  python scripts/bench_linear.py --sources=/tmp/old.cc,kvjax/models/linear.cc --tokens=8,32
  python scripts/bench_linear.py --dtype=bfloat16 --tokens=128,512,2048
"""

from __future__ import annotations

import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

import kvjax
from kvjax import cpu_kernels
from kvjax.bench import roofline
from kvjax.models import linear, llama

_TOKENS = flags.DEFINE_list("tokens", ["1", "8", "32", "64", "128", "256"], "Token rows.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed calls per system and token count.")
_SOURCES = flags.DEFINE_list("sources", [], "linear.cc sources to run side by side instead "
                             "of the packaged kernel.")
_HEAD_ONLY = flags.DEFINE_bool("head_only", False, "Time only the output head (the tied "
                               "embedding's transposed product).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights' and "
                           "activations' dtype.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Write the results here.")


def _no_attention(_, q, k, v, cache):
    return q + jnp.repeat(v, q.shape[1] // v.shape[1], axis=1), cache


def decoder_matmuls(config, params, tokens, lin, head_only=False):
    """The decoder over `tokens` with attention stubbed out (or, with `head_only`, just the
    tokens' embeddings), and the head: [T, V] logits."""
    if head_only:
        h = params["embed"][tokens]
    else:
        h, _ = llama.decode_body(params, config, tokens, jnp.zeros_like(tokens),
                                 _no_attention, None, linear=lin)
    return llama.lm_head(params, config, h, lin)


def kernels() -> dict[str, linear.LayerLinear]:
    """The native kernels to time: the packaged one, or a build of each of --sources."""
    if not _SOURCES.value:
        return {"native": linear.native_linear}
    targets = cpu_kernels.register_sources(_SOURCES.value, "KvjaxLinear", "bench_linear")
    return {source: functools.partial(linear.call_kernel, target)
            for source, target in zip(_SOURCES.value, targets, strict=True)}


def main(argv):
    del argv
    reason = linear.unavailable_reason()
    if reason is not None:
        raise SystemExit(reason)
    model = kvjax.load_model(None, _DTYPE.value)
    config, params = model.config, model.params
    rates = roofline.measure_machine()
    weight_bytes = params.get("lm_head", params["embed"]).nbytes
    flops_per_token = 2.0 * config.vocab_size * config.hidden_size
    if not _HEAD_ONLY.value:
        weight_bytes += sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
        flops_per_token = 2.0 * roofline.matmul_params(config)
    systems = {**kernels(), "xla": None}
    native = [n for n in systems if n != "xla"]
    results = []
    print(f"| tokens | {' | '.join(f'{n} ms' for n in systems)} | floor ms | "
          f"{' | '.join(f'{n} / xla' for n in native)} |")
    print("|---" * (len(systems) + len(native) + 2) + "|")
    for t in (int(x) for x in _TOKENS.value):
        tokens = jnp.arange(t, dtype=jnp.int32) + 5
        calls = {name: jax.jit(lambda p, x, lin=lin: decoder_matmuls(config, p, x, lin,
                                                                     _HEAD_ONLY.value))
                 for name, lin in systems.items()}
        for call in calls.values():
            call(params, tokens).block_until_ready()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(_REPEATS.value):
            for name, call in calls.items():
                start = time.perf_counter()
                call(params, tokens).block_until_ready()
                times[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
        flops = flops_per_token * t
        floor = 1e3 * max(weight_bytes / rates.memory_bytes_per_s,
                          flops / rates.matmul_flops_per_s)
        results.append(dict(tokens=t, dtype=_DTYPE.value, ms=ms, floor_ms=floor))
        ratios = " | ".join(f"{ms[n] / ms['xla']:.2f}" for n in native)
        print(f"| {t} | {' | '.join(f'{v:.1f}' for v in ms.values())} | {floor:.1f} | "
              f"{ratios} |", flush=True)
    print(f"machine: {rates.memory_bytes_per_s / 1e9:.1f} GB/s, "
          f"{rates.matmul_flops_per_s / 1e9:.0f} GFLOP/s")
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            json.dump(dict(results=results, memory_bytes_per_s=rates.memory_bytes_per_s,
                           matmul_flops_per_s=rates.matmul_flops_per_s,
                           weight_bytes=weight_bytes), f, indent=1)


if __name__ == "__main__":
    app.run(main)
