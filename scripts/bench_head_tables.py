"""Decode step time with one block table per (layer, kv head) (AdaKV's head-major pages)
against one block table per sequence, on the embedded model (kvjax.bench.head_tables).

  python scripts/bench_head_tables.py --batch=4 --prompt_len=512 --budget=128 \
      --output_json=docs/results/head_tables.json
"""

from __future__ import annotations

from absl import app, flags

import kvjax
from kvjax.bench import head_tables

_BATCH = flags.DEFINE_integer("batch", 4, "Sequences decoding together.")
_PROMPT = flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per sequence.")
_BUDGET = flags.DEFINE_integer("budget", 128, "SnapKV's budget (tokens per kv head on average).")
_STEPS = flags.DEFINE_integer("num_steps", 16, "Timed decode steps per engine (alternating).")
_OUTPUT = flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    result = head_tables.run(kvjax.load_model(), batch=_BATCH.value, prompt_len=_PROMPT.value,
                             budget=_BUDGET.value, num_steps=_STEPS.value)
    print(head_tables.table(result))
    if _OUTPUT.value:
        head_tables.write(result, _OUTPUT.value)


if __name__ == "__main__":
    app.run(main)
