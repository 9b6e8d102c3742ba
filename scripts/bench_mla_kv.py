"""KV bytes per token of MLA (DeepSeek-V2/V3) beside the same models with K/V per head and a
GQA Llama-3-8B.

  python scripts/bench_mla_kv.py --output_json docs/results/mla_kv_bytes.json

Bytes come from the engine's KV spec (`kvjax.bench.mla_kv`); an engine built on a small
random-weights MLA model checks that its pool takes those bytes.
"""

from __future__ import annotations

import json

from absl import app, flags

from kvjax.bench import mla_kv
from kvjax.bench.metrics import format_rows

FLAGS = flags.FLAGS
flags.DEFINE_string("dtype", "bfloat16", "KV dtype.")
flags.DEFINE_integer("context", 8192, "Tokens per sequence.")
flags.DEFINE_float("budget_gib", 16.0, "KV budget in GiB.")
flags.DEFINE_string("output_json", None, "Write every number here.")


def main(argv):
    del argv
    result = mla_kv.run(mla_kv.Setup(dtype=FLAGS.dtype, context=FLAGS.context,
                                     budget_gib=FLAGS.budget_gib))
    print(format_rows(result["rows"], mla_kv.COLUMNS, "model"))
    print("engine check:", result["engine_check"])
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
