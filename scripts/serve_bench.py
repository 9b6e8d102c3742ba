"""The joint serving benchmark: latency, throughput, KV memory, bytes, energy and quality.

  python scripts/serve_bench.py --config=configs/serve_demo.py --workdir=runs/demo
  python scripts/serve_bench.py --config=configs/serve_demo.py --config.engine.page_size=32 \
      --workdir=runs/demo_p32
  python scripts/serve_bench.py --config=configs/serve_sweep_policies.py --workdir=runs/policies
  python scripts/serve_bench.py --config=configs/serve_demo.py \
      --sweep="engine.scheduler_policy=fcfs,lpm;engine.page_size=16,32" --workdir=runs/grid

Against a running OpenAI-compatible server (kvjax's scripts/serve.py or another engine's),
the same workload is replayed over HTTP, with TTFT from the first streamed chunk:

  python scripts/serve.py --config=configs/serve_demo.py &
  python scripts/serve_bench.py --config=configs/serve_demo.py --target=http://127.0.0.1:8000 \
      --workdir=runs/demo_http

--sweep is `field=v1,v2;field2=w1,w2`: one run per combination (the product of the axes);
without it, a config's own `config.sweep` list is run, and with neither, the config once.
Writes <run>.json, <run>.details.json, results.md and PNG plots into --workdir. The config
schema, the clocks and every metric are described in docs/serve_bench.md.
"""

from __future__ import annotations

import shlex
import sys

from absl import app, flags
from ml_collections import config_flags

from kvjax.bench import remote, runner

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Benchmark config file (configs/serve_*.py).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for the JSON results, results.md and plots.")
flags.DEFINE_string("sweep", None, "Variants: 'field=v1,v2;field2=w1,w2' (product of axes); "
                    "overrides config.sweep.")
flags.DEFINE_string("target", None, "http://HOST:PORT of an OpenAI-compatible server to "
                    "replay the workload against (kvjax.bench.remote); None: in-process.")
flags.DEFINE_bool("progress", True, "Show a progress bar of requests done.")
flags.DEFINE_bool("plots", True, "Write PNG plots.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    if FLAGS.sweep:
        overrides = runner.parse_sweep(FLAGS.sweep, config)
    else:
        overrides = list(config.sweep)
    if FLAGS.target:
        if overrides:
            raise app.UsageError("--target replays one config: a server runs one engine config")
        results = [remote.run_http_benchmark_detailed(config, FLAGS.target,
                                                      progress=FLAGS.progress)]
    elif overrides:
        results = runner.run_sweep_detailed(config, overrides, progress=FLAGS.progress)
    else:
        results = [runner.run_benchmark_detailed(config, progress=FLAGS.progress)]
    command = shlex.join(["python", "scripts/serve_bench.py", *sys.argv[1:]])
    paths = runner.write_results(results, FLAGS.workdir, command=command, plots=FLAGS.plots)
    print(paths[0].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    app.run(main)
