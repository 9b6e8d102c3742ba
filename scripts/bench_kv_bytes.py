"""KV bytes per token at 8k context and 8k sequences in a 16 GiB budget for Llama-3.2-1B,
Qwen3-0.6B, Gemma-3-1B, Mistral-7B, Phi-3-mini, DeepSeek-V2-Lite (and DeepSeek-V2/V3): kvjax's
layer groups against every layer global with full K/V.

  python scripts/bench_kv_bytes.py --output_json docs/results/kv_bytes.json

Bytes come from the engine's KV spec (`kvjax.bench.kv_bytes`); an engine built per model on a
random-weights model of its KV shape checks the pool and the pages sequences hold.
"""

from __future__ import annotations

import json

from absl import app, flags

from kvjax.bench import kv_bytes
from kvjax.bench.metrics import format_rows

FLAGS = flags.FLAGS
flags.DEFINE_string("dtype", "bfloat16", "KV dtype.")
flags.DEFINE_integer("context", 8192, "Tokens per sequence.")
flags.DEFINE_float("budget_gib", 16.0, "KV budget in GiB.")
flags.DEFINE_string("output_json", None, "Write every number here.")


def main(argv):
    del argv
    result = kv_bytes.run(kv_bytes.Setup(dtype=FLAGS.dtype, context=FLAGS.context,
                                         budget_gib=FLAGS.budget_gib))
    print(format_rows(result["rows"], kv_bytes.COLUMNS, "model"))
    print()
    print(format_rows(result["engine_checks"], kv_bytes.CHECK_COLUMNS, "engine check"))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
