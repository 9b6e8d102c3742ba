"""Decode and prefill step time of a mixture-of-experts model against dense models of its
active and of its total MLP size.

  python scripts/bench_moe.py --output_json docs/results/moe.json

The models take turns on one machine; the table gives median decode and prefill step times (and
one layer's MLP alone on a prefill's rows) and their ratio to the dense model of the MoE's active
size: `kvjax.bench.moe`.
"""

from __future__ import annotations

import json

from absl import app, flags

from kvjax.bench import moe
from kvjax.bench.metrics import format_rows

FLAGS = flags.FLAGS
flags.DEFINE_list("batches", ["1", "4", "16"], "Sequences decoding together.")
flags.DEFINE_list("prefill_tokens", ["256", "1024"], "Prompt lengths prefilled in one chunk.")
flags.DEFINE_integer("repeats", 3, "Rounds per model and batch (the models take turns).")
flags.DEFINE_integer("new_tokens", 32, "Decoded tokens per sequence and round.")
flags.DEFINE_string("output_json", None, "Write every number here.")


def main(argv):
    del argv
    setup = moe.Setup(batches=tuple(int(b) for b in FLAGS.batches), repeats=FLAGS.repeats,
                      new_tokens=FLAGS.new_tokens,
                      prefill_tokens=tuple(int(n) for n in FLAGS.prefill_tokens))
    result = moe.run(setup)
    print(format_rows(moe.rows(result), moe.COLUMNS, "model"))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
