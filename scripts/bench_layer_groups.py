"""KV layer groups at long context: a sliding-window model against the same model all global.

  python scripts/bench_layer_groups.py --output_json docs/results/layer_groups.json
  python scripts/bench_layer_groups.py --run=preemption \
      --output_json docs/results/layer_groups_preemption.json

Bytes one 4k-token sequence holds (allocator) vs its spec's prediction and vs every layer
global, and how many such sequences one KV budget decodes at once; with --run=preemption, the
sliding model under memory pressure preempting by recompute, swap and the cost model's choice:
`kvjax.bench.layer_groups`.
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
flags.DEFINE_integer("pressure_prompt", 512, "Prompt tokens per sequence (preemption run).")
flags.DEFINE_integer("pressure_new_tokens", 256,
                     "Decoded tokens per sequence (preemption run).")
flags.DEFINE_integer("pressure_window", 128, "Sliding window (preemption run).")
flags.DEFINE_enum("run", "capacity", ["capacity", "preemption"],
                  "capacity: bytes held and sequences at once, sliding vs global; preemption: "
                  "the sliding model under memory pressure per preemption mode.")
flags.DEFINE_integer("repeats", 3, "Measured passes per preemption mode (the fastest kept).")
flags.DEFINE_string("output_json", None, "Write every number here.")


def main(argv):
    del argv
    setup = layer_groups.Setup(window=FLAGS.window, context=FLAGS.context,
                               num_requests=FLAGS.num_requests,
                               budget_sequences=FLAGS.budget_sequences,
                               pressure_window=FLAGS.pressure_window,
                               pressure_prompt=FLAGS.pressure_prompt,
                               pressure_new_tokens=FLAGS.pressure_new_tokens)
    if FLAGS.run == "preemption":
        result = layer_groups.preemption(setup, FLAGS.repeats)
        print(format_rows(layer_groups.preemption_rows(result),
                          layer_groups.PREEMPTION_COLUMNS, "preemption"))
    else:
        result = layer_groups.run(setup)
        print(format_rows(layer_groups.rows(result), layer_groups.COLUMNS, "model"))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
