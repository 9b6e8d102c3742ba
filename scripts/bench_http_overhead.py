"""The fixed cost of serving a request over HTTP (kvjax.bench.remote.http_overhead).

  python scripts/bench_http_overhead.py --workdir=runs/http_overhead

Sequential short greedy requests on the tiny test model (its step is well under a
millisecond, so the difference is the server's own cost), in-process and through
kvjax.server on 127.0.0.1; prints a table and writes http_overhead.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags

from kvjax import EngineConfig
from kvjax.bench.remote import http_overhead
from kvjax.testing import tiny_chat_model

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_requests", 100, "Sequential requests per mode.")
flags.DEFINE_integer("max_tokens", 4, "Tokens generated per request.")
flags.DEFINE_string("workdir", None, "Directory for http_overhead.json.")
flags.mark_flag_as_required("workdir")

# The engine config of tests/server/test_server.py: 6 step shapes.
CONFIG = EngineConfig(page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64,
                      max_prefill_chunk=32, min_chunk_bucket=32, max_prefill_seqs=1)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    result = http_overhead(tiny_chat_model(), CONFIG, num_requests=FLAGS.num_requests,
                           max_tokens=FLAGS.max_tokens)
    print("| in-process ms | HTTP ms | HTTP streaming ms | overhead ms |\n|---:|---:|---:|---:|")
    print("| " + " | ".join(f"{result[k] * 1e3:.2f}" for k in (
        "in_process_s", "http_s", "http_stream_s", "overhead_s")) + " |")
    workdir = Path(FLAGS.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "http_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {workdir / 'http_overhead.json'}")


if __name__ == "__main__":
    app.run(main)
