"""Decode throughput of kvjax (paged and contiguous KV) against Hugging Face transformers.

  python scripts/bench_decode.py --output_json docs/results/bench_decode.json
  python scripts/bench_decode.py --batch_sizes 1,8 --new_tokens 32 --skip_hf

Every system decodes the same real-text prompts (all `--prompt_len` tokens long) greedily with
the same weights (the embedded SmolLM2-135M in float32) for exactly `--new_tokens` tokens; only
decode is timed, after compilation, against a roofline floor measured on this machine. How each
system is timed, the floor and the --profile breakdown: `kvjax.bench.decode`.
"""

from __future__ import annotations

import json

from absl import app, flags

import kvjax
from kvjax.bench import decode

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Batch sizes (sequences decoding at once).")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per sequence.")
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per sequence (all prompts this long).")
flags.DEFINE_list("layouts", ["paged", "contiguous"], "kvjax KV layouts to run.")
flags.DEFINE_bool("skip_hf", False, "Do not run Hugging Face transformers.")
flags.DEFINE_list("torch_threads", ["2"], "torch intra-op thread counts for transformers (one "
                  "run each; kvjax is compared with the fastest).")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("warm_tokens", 24, "New tokens of the untimed compile run (at most "
                     "--new_tokens); must leave full-batch decode steps after the prefills.")
flags.DEFINE_integer("seed", 0, "Workload seed (which corpus text the prompts are).")
flags.DEFINE_bool("profile", False, "Also trace full-batch decode steps with jax.profiler and "
                  "report device time per kind of XLA op.")
flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    report = decode.run(
        kvjax.load_model(), batch_sizes=batch_sizes, new_tokens=FLAGS.new_tokens,
        prompt_len=FLAGS.prompt_len, layouts=[kvjax.KVLayout(name) for name in FLAGS.layouts],
        torch_threads=[int(t) for t in FLAGS.torch_threads], skip_hf=FLAGS.skip_hf,
        page_size=FLAGS.page_size, warm_tokens=FLAGS.warm_tokens, seed=FLAGS.seed,
        profile=FLAGS.profile)
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags=dict(batch_sizes=batch_sizes, new_tokens=FLAGS.new_tokens,
                                      prompt_len=FLAGS.prompt_len, layouts=FLAGS.layouts,
                                      torch_threads=[int(t) for t in FLAGS.torch_threads],
                                      page_size=FLAGS.page_size, seed=FLAGS.seed,
                                      profile=FLAGS.profile), **report), f, indent=1)


if __name__ == "__main__":
    app.run(main)
