"""Host-resident rows vs swap vs recompute on a simulated clock (every figure simulated).

  python scripts/bench_host_attention.py --output_json docs/results/bench_host_attention.json

With --measure, the measured counterpart instead (`kvjax.bench.link_measure`; a step of
scripts/device_check.sh): host <-> device bandwidth of jax.device_put with the pinned_host
memory kind, host decode attention vs the same on the device, each beside the figure the
simulation assumes; on a machine without a GPU it says "no GPU: CPU figures".

  python scripts/bench_host_attention.py --measure --output_json results/link_measured.json

The device pool holds a quarter of the working set; tokens/s and TPOT for PCIe 5.0 x16 and
NVLink-C2C link figures, with the host's decode-attention rate measured here and scaled by
each --host_scales entry; the model of each strategy: `kvjax.bench.host_attention`.
"""

from __future__ import annotations

import json

from absl import app, flags

from kvjax.bench import host_attention, link_measure
from kvjax.bench.metrics import format_rows

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_seqs", 64, "Sequences in the working set.")
flags.DEFINE_integer("context", 4096, "Tokens of KV each sequence already has.")
flags.DEFINE_integer("new_tokens", 128, "Tokens each sequence decodes.")
flags.DEFINE_float("device_fraction", 0.25, "Share of the working set's KV the device holds.")
flags.DEFINE_list("host_scales", ["1", "64"],
                  "Host attention rates to simulate, as multiples of the one measured here.")
flags.DEFINE_string("output_json", None, "Write every number here.")
flags.DEFINE_bool("measure", False, "Measure the link and host/device attention on this "
                  "machine beside the simulated model's figures, instead of simulating.")
flags.DEFINE_integer("measure_mib", 256, "--measure: MiB each host<->device transfer moves.")
flags.DEFINE_integer("measure_context", 4096, "--measure: tokens per row of the attention.")
flags.DEFINE_integer("measure_rows", 8, "--measure: rows of the attention.")

COLUMNS = [("tokens_per_s", "tokens/s (simulated)", "{:.1f}"),
           ("tpot_p50_ms", "TPOT p50 ms (simulated)", "{:.2f}"),
           ("tpot_p99_ms", "TPOT p99 ms (simulated)", "{:.2f}"),
           ("tpot_max_ms", "TPOT max ms (simulated)", "{:.0f}"),
           ("host_rows_per_wave", "host rows", "{:d}"),
           ("host_over_device_time", "host / device time", "{:.2f}")]


MEASURE_COLUMNS = [("measured", "measured", "{:.3f}"),
                   ("model", "model (simulated)", "{:.3f}"),
                   ("model_pcie5_x16", "PCIe 5.0 x16 model", "{:.1f}"),
                   ("model_nvlink_c2c", "NVLink-C2C model", "{:.1f}")]


def measure() -> dict:
    report = link_measure.run(link_measure.LinkMeasure(
        transfer_bytes=FLAGS.measure_mib << 20, num_rows=FLAGS.measure_rows,
        context=FLAGS.measure_context))
    print(f"backend {report['backend']} ({report['device']}); host memory kind "
          f"{report['transfers']['memory_kind']}")
    if report["note"]:
        print(report["note"])
    print(format_rows(report["rows"], MEASURE_COLUMNS, "figure"))
    print("attention: one layer, float32 pages (divide its rate by the model's layers for "
          "host_split_options host_tokens_per_s); model columns are the simulated figures")
    return report


def main(argv):
    del argv
    if FLAGS.measure:
        report = measure()
        if FLAGS.output_json:
            with open(FLAGS.output_json, "w") as f:
                json.dump(report, f, indent=2)
        return
    rate = host_attention.measure_attention_rate()
    print(f"host decode attention, measured here: {rate / 1e9:.2f} GB/s of KV read")
    results = {}
    for scale in FLAGS.host_scales:
        scenario = host_attention.Scenario(
            num_seqs=FLAGS.num_seqs, context=FLAGS.context, new_tokens=FLAGS.new_tokens,
            device_fraction=FLAGS.device_fraction, host_scale=float(scale))
        out = host_attention.run(scenario, host_rate=rate)
        results[f"host_scale={scale}"] = out
        print(f"\nhost attention rate x{scale} ({rate * float(scale) / 1e9:.1f} GB/s)")
        print(format_rows(out["rows"], COLUMNS, "link / strategy"))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
