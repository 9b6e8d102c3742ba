"""ECHO (host-authoritative Quest pages) on needle probes: prefetch recall, bytes moved per
decode step, and their link time for PCIe 5.0 x16 and NVLink-C2C on a simulated clock.

  python scripts/bench_echo.py --output_json docs/results/bench_echo.json

Each ECHO run's selection and tokens are checked against plain Quest's at every step; what each
column means: `kvjax.bench.echo`.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

import kvjax
from kvjax.bench import echo
from kvjax.bench.metrics import format_rows

FLAGS = flags.FLAGS
flags.DEFINE_integer("context", 2048, "Prompt tokens per needle probe.")
flags.DEFINE_list("depths", ["0.25", "0.75"], "The needle's depth in each probe.")
flags.DEFINE_integer("num_tokens", 32, "Greedy tokens decoded per probe.")
flags.DEFINE_integer("budget", 256, "Quest's read budget in tokens.")
flags.DEFINE_integer("dense_layers", 0, "Quest's dense layers (they read every page).")
flags.DEFINE_list("prefetch", ["0", "4", "16"], "ECHO prefetch margins (pages) compared.")
flags.DEFINE_list("keep_misses", ["true"], "Quest echo_keep_misses settings compared "
                  "(true,false: each margin with and without misses kept in frames).")
flags.DEFINE_integer("page_size", 16, "Tokens per page.")
flags.DEFINE_bool("async_scheduling", True, "Plan each step while the previous one runs.")
flags.DEFINE_string("output_json", None, "Write every number here.")

KIB = ("h2d_miss_bytes_per_step", "h2d_prefetch_bytes_per_step", "h2d_bytes_per_step",
       "d2h_bytes_per_step", "on_demand_bytes_per_step")
COLUMNS = [("selection_equal", "selection = Quest's", "{}"),
           ("tokens_equal", "tokens = Quest's", "{}"),
           ("recall", "prefetch recall", "{:.3f}"),
           ("device_pages", "device pages / seq", "{:d}"),
           ("all_pages", "Quest pages / seq", "{:d}"),
           ("released_per_step", "host-read pages / layer", "{:.1f}"),
           ("misses_per_step", "misses (layer-pages)", "{:.1f}"),
           ("prefetched_per_step", "prefetched (layer-pages)", "{:.1f}"),
           ("refetched_per_step", "of which last step's misses", "{:.1f}"),
           ("kept_per_step", "misses kept (layer-pages)", "{:.1f}"),
           ("h2d_bytes_per_step", "host->device KiB", "{:.0f}"),
           ("h2d_miss_bytes_per_step", "miss KiB", "{:.0f}"),
           ("h2d_prefetch_bytes_per_step", "prefetch KiB", "{:.0f}"),
           ("d2h_bytes_per_step", "device->host KiB", "{:.0f}"),
           ("on_demand_bytes_per_step", "on-demand KiB", "{:.0f}"),
           ("link_ms_pcie5_x16", "PCIe 5.0 x16 ms (simulated)", "{:.4f}"),
           ("on_demand_link_ms_pcie5_x16", "on-demand PCIe ms (simulated)", "{:.4f}"),
           ("link_ms_nvlink_c2c", "NVLink-C2C ms (simulated)", "{:.4f}"),
           ("on_demand_link_ms_nvlink_c2c", "on-demand C2C ms (simulated)", "{:.4f}")]


def main(argv):
    del argv
    t0 = time.perf_counter()
    settings = echo.EchoBench(
        context=FLAGS.context, depths=tuple(float(x) for x in FLAGS.depths),
        num_tokens=FLAGS.num_tokens, budget=FLAGS.budget, dense_layers=FLAGS.dense_layers,
        prefetch=tuple(int(x) for x in FLAGS.prefetch), page_size=FLAGS.page_size,
        keep_misses=tuple(x.lower() in ("1", "true", "yes") for x in FLAGS.keep_misses),
        async_scheduling=FLAGS.async_scheduling)
    report = echo.run(kvjax.load_model(), settings,
                      on_row=lambda name, row: print(name, row, flush=True))
    shown = {name: {**row, **{k: row[k] / 1024 for k in KIB}}
             for name, row in report["rows"].items()}
    print(format_rows(shown, COLUMNS, "probe / prefetch m"))
    print("bytes and link times are per decode step (KiB); link times simulated")
    print(f"total {time.perf_counter() - t0:.0f}s")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    app.run(main)
