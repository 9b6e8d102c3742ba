"""Decode step time of each retention press and budget scheme against exact KV, at batch B,
beside the KV bytes each step reads and the pages each sequence holds (read from the allocator).

  python scripts/bench_press_decode.py --output_json docs/results/bench_press_decode_8k.json
  python scripts/bench_press_decode.py --batch 8 --context 2048 --variants snapkv:512,tova:512

Every engine prefills its own B prompts and runs its press's own selection; the engines then
decode taking turns, one step each, so the step ratios hold on a loaded machine. How pages and
bytes are counted: `kvjax.bench.press_decode`.
"""

from __future__ import annotations

from absl import app, flags

import kvjax
from kvjax.bench import press_decode

FLAGS = flags.FLAGS
flags.DEFINE_list("variants", [
    "snapkv:2000", "snapkv:2000:schedule=adakv", "knorm:2000:schedule=per_head",
    "snapkv:2000:schedule=pyramid", "streaming:2000", "knorm:2000", "expected_attention:2000",
    "observed_attention:2000", "tova:2000"],
    "Retention variants, `name:budget[:option=value]` (as scripts/bench_retention.py); exact "
    "KV always runs.")
flags.DEFINE_integer("batch", 8, "Sequences decoding at once.")
flags.DEFINE_integer("context", 8000, "Prompt tokens per sequence (prompt + new tokens + "
                     "prefill steps must fit the model's 8192 positions).")
flags.DEFINE_integer("new_tokens", 32, "Full-batch decode steps to time, about.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("chunk", 2048, "Prefill chunk.")
flags.DEFINE_integer("seed", 0, "Which corpus text the prompts are.")
flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    settings = press_decode.PressDecodeBench(
        variants=tuple(FLAGS.variants), batch=FLAGS.batch, context=FLAGS.context,
        new_tokens=FLAGS.new_tokens, page_size=FLAGS.page_size, chunk=FLAGS.chunk,
        seed=FLAGS.seed)
    report = press_decode.run(kvjax.load_model(), settings)
    print(press_decode.format_table(report))
    if FLAGS.output_json:
        press_decode.write(report, FLAGS.output_json)


if __name__ == "__main__":
    app.run(main)
