"""bfloat16 against float32 on the embedded model: decode and prefill tokens/s, and quality.

  python scripts/bench_dtype.py --output_json docs/results/bench_dtype.json
  python scripts/bench_dtype.py --nospeed --decode_chunks=1,16 \
      --output_json docs/results/bench_dtype_quality_decode.json   # quality passes only

Both dtypes in one run, side by side (`kvjax.bench.dtype`): full-batch decode steps at
--batch_sizes, a --prefill_len prompt's prefill, and teacher-forced KL / top-1 agreement of the
bfloat16 engine against the float32 one, in prefill-sized steps through XLA's matmuls and in
steps of --decode_chunks tokens through the native matmul.
"""

from __future__ import annotations

import json

from absl import app, flags

from kvjax.bench import dtype

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Embedded model (default), a Hugging Face directory or a "
                    ".gguf.")
flags.DEFINE_list("batch_sizes", ["1", "16", "32"], "Decode batch sizes.")
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens of each decoding sequence.")
flags.DEFINE_integer("new_tokens", 64, "Tokens each decoding sequence generates.")
flags.DEFINE_integer("prefill_len", 512, "Prompt tokens of the prefill measurement.")
flags.DEFINE_integer("prefill_repeats", 3, "Timed prefills per dtype.")
flags.DEFINE_integer("quality_tokens", 512, "Teacher-forced tokens of the quality measurement.")
flags.DEFINE_list("decode_chunks", ["1", "16"], "Tokens per step of the quality passes "
                  "through the native matmul.")
flags.DEFINE_bool("speed", True, "Time decode and prefill (--nospeed: quality only).")
flags.DEFINE_integer("seed", 0, "Which corpus text the prompts are.")
flags.DEFINE_string("output_json", None, "Write every number here.")


def main(argv):
    del argv
    settings = dtype.DtypeBench(
        batch_sizes=tuple(int(b) for b in FLAGS.batch_sizes), prompt_len=FLAGS.prompt_len,
        new_tokens=FLAGS.new_tokens, prefill_len=FLAGS.prefill_len,
        prefill_repeats=FLAGS.prefill_repeats, quality_tokens=FLAGS.quality_tokens,
        decode_chunks=tuple(int(c) for c in FLAGS.decode_chunks), speed=FLAGS.speed,
        seed=FLAGS.seed)
    result = dtype.run(FLAGS.model, settings)
    print(dtype.format_table(result))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
    app.run(main)
