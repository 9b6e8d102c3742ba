"""KV layer groups at long context: a sliding-window model against the same model all global.

  python scripts/bench_layer_groups.py --output_json docs/results/layer_groups.json

Bytes one 4k-token sequence holds (allocator) vs its spec's prediction and vs every layer
global, and how many such sequences one KV budget decodes at once: `kvjax.bench.layer_groups`.
"""

from __future__ import annotations

import json

from absl import app, flags

from kvjax.bench import layer_groups
from kvjax.bench.metrics import format_rows

FLAGS = flags.FLAGS
flags.DEFINE_integer("window", 512, "Sliding window of every other layer (tokens).")
flags.DEFINE_integer("context", 4096, "Tokens per sequence (prompt + decoded).")
flags.DEFINE_integer("num_requests", 8, "Sequences submitted at once in the capacity run.")
flags.DEFINE_integer("budget_sequences", 2,
                     "KV budget in whole sequences of the all-global model.")
flags.DEFINE_string("output_json", None, "Write every number here.")


def main(argv):
    del argv
    setup = layer_groups.Setup(window=FLAGS.window, context=FLAGS.context,
                               num_requests=FLAGS.num_requests,
                               budget_sequences=FLAGS.budget_sequences)
    result = layer_groups.run(setup)
    print(format_rows(layer_groups.rows(result), layer_groups.COLUMNS, "model"))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
