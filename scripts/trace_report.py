"""Analyses of a KV-semantic trace (serve_bench --config.trace=True, serve.py --trace_path).

  python scripts/trace_report.py --trace=runs/demo/demo.trace.json --workdir=runs/demo_report

Prints the tables, writes trace_report.json and trace_report.png into --workdir; the
analyses are in kvjax.bench.trace_report.
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags

from kvjax.bench import trace_report

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", None, "A trace JSON (Trace Event Format) written by kvjax.")
flags.DEFINE_string("workdir", None, "Directory for trace_report.json and the PNG plots.")
flags.DEFINE_integer("num_windows", 10, "Time windows of the hit-rate-over-time series.")
flags.mark_flags_as_required(["trace", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    trace = json.loads(pathlib.Path(FLAGS.trace).read_text())
    problems = trace_report.validate_trace(trace)
    if problems:
        raise app.UsageError(f"not a valid trace: {problems[:5]}")
    report = trace_report.analyse(trace, num_windows=FLAGS.num_windows)
    workdir = pathlib.Path(FLAGS.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "trace_report.json").write_text(json.dumps(report, indent=2))
    paths = trace_report.plot(report, trace, workdir)
    print(trace_report.format_tables(report))
    print("wrote " + ", ".join([str(workdir / "trace_report.json"), *paths]))


if __name__ == "__main__":
    app.run(main)
