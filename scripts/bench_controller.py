"""The KV controllers side by side under one budget and the requests' SLOs.

  python scripts/bench_controller.py --config=configs/serve_controller.py \
      --workdir=runs/controller --output_json=docs/results/bench_controller.json

Measures the KL tables (retention budgets, int8 copies) on the workload's prompts, gives them
to every controller, runs the config's sweep (one run per controller) and prints one table:
SLO attainment per tenant, goodput, p99 TTFT / TPOT, estimated KL spent (mean and worst),
preemptions, bytes per tier and energy. `--config.clock=real` runs on the wall clock;
`--kl_tables=docs/results/bench_controller.json` reuses an earlier run's KL tables.
With `--config.trace=True` each run's KV trace also says why its prefix lookups stopped short
(`kvjax.bench.trace_report.lookup_losses`: printed, and in the JSON as `lookup_losses`).
"""

from __future__ import annotations

import json
import shlex
import sys

from absl import app, flags
from ml_collections import config_flags

from kvjax.bench import controller, runner, trace_report
from kvjax.models.loading import load_model

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "configs/serve_controller.py or a variant.",
                                lock_config=False)
flags.DEFINE_string("workdir", None, "Directory for serve_bench's per-run results.")
flags.DEFINE_string("output_json", None, "Write the table's rows and the KL tables here.")
flags.DEFINE_list("only", [], "Run only these sweep entries (by name).")
flags.DEFINE_bool("progress", True, "Show progress bars.")
flags.DEFINE_string("kl_tables", None, "Reuse the KL tables of an earlier run's --output_json "
                    "(same config) instead of measuring them.")
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    if FLAGS.only:
        config.sweep = [o for o in config.sweep if o["name"] in FLAGS.only]
    model = load_model(config.model.name, dtype=config.model.dtype)
    requests = runner.build_workload(config, model.tokenizer)
    if FLAGS.kl_tables:
        with open(FLAGS.kl_tables) as f:
            tables = json.load(f)["kl_tables"]
    else:
        tables = controller.measure_kl_tables(
            runner.apply_overrides(config, {"kv.retention": config.kl_tables.retention,
                                            "kv.budget": float(max(config.kl_tables.budgets))}),
            model, requests, config.kl_tables.budgets)
    print("KL tables:", tables)
    options = dict(tables, **controller.energy_options(config, model))
    results = controller.run_controllers(config, options, model=model,
                                         progress=FLAGS.progress)
    rows = controller.controller_rows(results, config)
    losses = {r.metrics["config"]["name"]: trace_report.analyse(r.trace)["lookup_losses"]
              for r in results if r.trace is not None}
    for name, counts in losses.items():
        print(f"{name}: {trace_report.format_losses(counts)}")
    command = shlex.join(["python", "scripts/bench_controller.py", *sys.argv[1:]])
    if FLAGS.workdir:
        runner.write_results(results, FLAGS.workdir, command=command, plots=False)
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(command=command, kl_tables=tables, options=options, rows=rows,
                           **(dict(lookup_losses=losses) if losses else {}),
                           env=runner.environment()), f, indent=2)
    print(controller.controller_table(rows))


if __name__ == "__main__":
    app.run(main)
