"""Quality, capacity and speed of quantized KV codecs on the embedded model, against exact KV.

  python scripts/bench_quant.py --output_json /tmp/bench_quant.json

Bytes per token and pages at a fixed budget, teacher-forced KL / top-1 / perplexity against
exact KV on local English text, a needle retrieval probe and decode throughput, per codec and
context length; what each number is: `kvjax.bench.quant`.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

import kvjax
from kvjax.bench import quant
from kvjax.bench.metrics import format_rows

FLAGS = flags.FLAGS
flags.DEFINE_list("codecs", ["int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3-cal", "fp8_e5m2-cal",
                            "int4", "int2", "kivi4", "kivi2", "kivi4-r32", "kivi2-r32",
                            "kivi4-r128", "kivi2-r128"],
                  "Codecs to compare with exact (float32) KV: a registered name, '-cal' for "
                  "calibrated fp8 (calibrate_kv on other corpus text), '-r<R>' for a KIVI "
                  "residual window of R tokens.")
flags.DEFINE_integer("calibration_tokens", 2048, "Calibration text for '-cal' fp8 codecs.")
flags.DEFINE_list("contexts", ["512", "2048"], "Teacher-forced sequence lengths in tokens.")
flags.DEFINE_integer("page_size", 128, "Tokens per page, the same for every codec.")
flags.DEFINE_integer("group", 32, "Group of int4/int2 (channels) and KIVI (tokens, channels).")
flags.DEFINE_integer("chunk", 512, "Prefill chunk: longer contexts are scored chunk by chunk.")
flags.DEFINE_integer("budget_mib", 256, "KV budget for the capacity multiplier.")
flags.DEFINE_integer("num_probes", 4, "Retrieval probes (one decode batch).")
flags.DEFINE_integer("probe_words", 300, "Filler words per probe prompt.")
flags.DEFINE_float("needle_depth", 0.1, "Where the needle fact sits in the filler (0: start, "
                   "1: end).")
flags.DEFINE_integer("max_new_tokens", 12, "Greedy tokens per probe.")
flags.DEFINE_integer("seed", 0, "Corpus and probe seed.")
flags.DEFINE_string("output_json", None, "Write every number here.")


def main(argv):
    del argv
    t0 = time.perf_counter()
    model = kvjax.load_model()
    contexts = [int(c) for c in FLAGS.contexts]
    settings = quant.QuantBench(
        codecs=tuple(FLAGS.codecs), contexts=tuple(contexts), page_size=FLAGS.page_size,
        group=FLAGS.group, chunk=FLAGS.chunk, budget_mib=FLAGS.budget_mib,
        num_probes=FLAGS.num_probes, probe_words=FLAGS.probe_words,
        needle_depth=FLAGS.needle_depth, max_new_tokens=FLAGS.max_new_tokens, seed=FLAGS.seed,
        calibration_tokens=FLAGS.calibration_tokens)
    rows = quant.run(model, settings)
    print(format_rows(rows, quant.COLUMNS, "codec, context"))
    print("\nexact perplexity: " + ", ".join(
        f"{c} tokens {rows[f'none, {c}']['ppl_exact']:.2f}" for c in contexts))
    print(f"total {time.perf_counter() - t0:.0f}s")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags={k: FLAGS[k].value for k in (
                "codecs", "contexts", "page_size", "group", "chunk", "budget_mib", "num_probes",
                "probe_words", "needle_depth", "max_new_tokens", "seed",
                "calibration_tokens")}, rows=rows), f, indent=1)


if __name__ == "__main__":
    app.run(main)
