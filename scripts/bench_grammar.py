"""Structured outputs' cost on the embedded model: JSON-schema constrained decoding beside
unconstrained decoding, the host's mask time per token and the device's masking.

  python scripts/bench_grammar.py --output_json docs/results/bench_grammar.json
  python scripts/bench_grammar.py --nodecode --fill_rows=2,8,16 --fill_threads=1,2  # masks

`kvjax.bench.grammar` says what is timed. Needs the optional extra `kvjax[grammar]`.
"""

from __future__ import annotations

import json

from absl import app, flags

import kvjax
from kvjax.bench import grammar

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "8"], "Sequences decoding at once.")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per sequence.")
flags.DEFINE_integer("rounds", 3, "Rounds of the three mixes (best of them is reported).")
flags.DEFINE_list("fill_rows", ["8"], "Constrained rows per step whose mask fill is timed "
                  "serial against parallel.")
flags.DEFINE_list("fill_threads", ["2"], "Pool threads of the parallel fill, one timing each.")
flags.DEFINE_bool("decode", True, "Run the decode mixes (False: only the mask fill timings).")
flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    model = kvjax.load_model()
    report = {}
    if FLAGS.decode:
        report = grammar.run(model, batch_sizes=[int(b) for b in FLAGS.batch_sizes],
                             new_tokens=FLAGS.new_tokens, rounds=FLAGS.rounds)
        print(grammar.format_table(report["results"]))
    report["fill"] = [grammar.fill_ms(model, num_rows=int(n), num_threads=int(t))
                      for t in FLAGS.fill_threads for n in FLAGS.fill_rows]
    print(grammar.format_fill_table(report["fill"]))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags=dict(batch_sizes=FLAGS.batch_sizes, new_tokens=FLAGS.new_tokens,
                                      rounds=FLAGS.rounds, fill_rows=FLAGS.fill_rows,
                                      fill_threads=FLAGS.fill_threads,
                                      decode=FLAGS.decode), **report), f, indent=1)


if __name__ == "__main__":
    app.run(main)
