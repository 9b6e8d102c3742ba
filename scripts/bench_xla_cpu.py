"""XLA's own CPU dots (YNNPACK, XLA's, oneDNN) against the native matmul kernel, side by side.

  python scripts/bench_xla_cpu.py --output_json docs/results/bench_xla_cpu.json

Each option set runs in its own process (XLA_FLAGS are per process), in alternating rounds;
inside one, engines with XLA's and with the native matmuls take turns (`kvjax.bench.xla_options`).
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

import kvjax
from kvjax.bench import xla_options

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("options", list(xla_options.OPTIONS),
                          "Option sets to run (OPTIONS names; repeat the flag).")
flags.DEFINE_list("batch_sizes", ["1", "8"], "Decode batch sizes at --prompt_len.")
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per sequence.")
flags.DEFINE_integer("new_tokens", 16, "Decode tokens per sequence.")
flags.DEFINE_integer("prefill_len", 512, "Tokens of the timed prefill (one chunk).")
flags.DEFINE_integer("repeats", 3, "Timed prefills per process.")
flags.DEFINE_integer("rounds", 1, "Processes per option set (the best median is kept).")
flags.DEFINE_bool("child", False, "Measure in this process and print JSON (internal).")
flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    settings = [(int(b), FLAGS.prompt_len) for b in FLAGS.batch_sizes]
    if FLAGS.child:
        result = xla_options.measure(kvjax.load_model(), settings=settings,
                                     new_tokens=FLAGS.new_tokens, prefill_len=FLAGS.prefill_len,
                                     repeats=FLAGS.repeats, seed=0)
        print(json.dumps(result))
        return
    command = [sys.executable, sys.argv[0], "--child",
               f"--batch_sizes={','.join(FLAGS.batch_sizes)}", f"--prompt_len={FLAGS.prompt_len}",
               f"--new_tokens={FLAGS.new_tokens}",
               f"--prefill_len={FLAGS.prefill_len}", f"--repeats={FLAGS.repeats}"]
    best = xla_options.run(command, options=FLAGS.options, rounds=FLAGS.rounds)
    print(xla_options.format_table(best))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags={k: FLAGS[k].value for k in ("options", "batch_sizes",
                                                             "prompt_len", "new_tokens",
                                                             "prefill_len", "repeats",
                                                             "rounds")},
                           options=xla_options.OPTIONS, results=best), f, indent=1)


if __name__ == "__main__":
    app.run(main)
