"""Time of the all-query key scoring pass (H2O's and observed attention's prefill scores) per
query tile, the untiled pass first, at SmolLM2-135M's attention shape, one layer.

  python scripts/bench_key_scores.py --output_json docs/results/bench_key_scores.json

Logic in `kvjax.bench.key_scores`.
"""

from __future__ import annotations

import json

from absl import app, flags

from kvjax.bench import key_scores
from kvjax.bench.metrics import format_rows

FLAGS = flags.FLAGS
flags.DEFINE_list("settings", ["8192:8192", "8192:2048", "2048:2048"],
                  "context:chunk pairs (the chunk's last query at context - 1).")
flags.DEFINE_list("tiles", ["64", "256"], "Query tiles to time beside the untiled pass.")
flags.DEFINE_integer("repeats", 3, "Timed calls per tile (median reported).")
flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    settings = [tuple(int(x) for x in s.split(":")) for s in FLAGS.settings]
    result = key_scores.run(key_scores.Setup(repeats=FLAGS.repeats), settings,
                            [int(t) for t in FLAGS.tiles])
    print(format_rows(result["rows"], key_scores.COLUMNS, "setting"))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
