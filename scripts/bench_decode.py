"""Decode throughput of kvjax (paged and contiguous KV) against Hugging Face transformers.

  python scripts/bench_decode.py --output_json docs/results/bench_decode.json \
      --plot docs/results/bench_decode_kv_bytes.png
  python scripts/bench_decode.py --batch_sizes 1,8 --context_sweep= --new_tokens 32 --skip_hf
  python scripts/bench_decode.py --skip_decode --prefill_lens 2048   # prefill only

Settings: each of `--batch_sizes` at `--prompt_len`, then `--sweep_batch` at each of
`--context_sweep`. Every system decodes the same real-text prompts greedily with the same
weights (the embedded SmolLM2-135M in float32) for exactly `--new_tokens` tokens; kvjax runs
each layout with exact KV and the paged layout with each of `--kv_codecs`. Only decode is
timed, after compilation, against a roofline floor measured on this machine. How each system
is timed, the floor and the --profile breakdown: `kvjax.bench.decode`. Then, for each of
`--prefill_lens`, one prompt is prefilled by kvjax (each of `--prefill_chunks`) and by a
transformers forward pass (`kvjax.bench.prefill`).
"""

from __future__ import annotations

import json

from absl import app, flags

import kvjax
from kvjax.bench import decode, prefill

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Batch sizes (sequences decoding at once).")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per sequence.")
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per sequence at --batch_sizes.")
flags.DEFINE_list("context_sweep", ["512", "2048", "7680"], "Prompt lengths run at "
                  "--sweep_batch (prompt + generated tokens must fit the model's 8192).")
flags.DEFINE_integer("sweep_batch", 8, "Batch size of the context sweep.")
flags.DEFINE_list("layouts", ["paged", "contiguous"], "kvjax KV layouts to run (exact KV).")
flags.DEFINE_list("kv_codecs", ["int8", "int4"], "KV codecs the paged layout also runs with.")
flags.DEFINE_bool("batch_invariant", False, "Also run the paged exact engine with "
                  "EngineConfig.batch_invariant (decode and prefill), side by side.")
flags.DEFINE_bool("skip_hf", False, "Do not run Hugging Face transformers.")
flags.DEFINE_list("torch_threads", ["2"], "torch intra-op thread counts for transformers (one "
                  "run each; kvjax is compared with the fastest).")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("warm_tokens", 24, "New tokens of the untimed compile run (at most "
                     "--new_tokens); must leave full-batch decode steps after the prefills.")
flags.DEFINE_integer("seed", 0, "Workload seed (which corpus text the prompts are).")
flags.DEFINE_bool("profile", False, "Also trace full-batch decode steps with jax.profiler and "
                  "report device time per kind of XLA op.")
flags.DEFINE_list("prefill_lens", ["2048"], "Prompt lengths of the prefill benchmark (one "
                  "prompt each, kvjax vs a transformers forward pass); empty: none.")
flags.DEFINE_list("prefill_chunks", ["512", "2048"], "kvjax max_num_batched_tokens values the "
                  "prefill benchmark runs.")
flags.DEFINE_integer("prefill_repeats", 3, "Timed prefills per system and prompt length.")
flags.DEFINE_bool("skip_decode", False, "Run only the prefill benchmark.")
flags.DEFINE_string("output_json", None, "Write the results here.")
flags.DEFINE_string("plot", None, "Write the step-time vs KV-bytes plot (at --sweep_batch) here.")


def main(argv):
    del argv
    model = kvjax.load_model()
    threads = [int(t) for t in FLAGS.torch_threads]
    report, settings, variants = {}, [], []
    if not FLAGS.skip_decode:
        settings = [(int(b), FLAGS.prompt_len) for b in FLAGS.batch_sizes]
        settings += [(FLAGS.sweep_batch, int(c)) for c in FLAGS.context_sweep
                     if (FLAGS.sweep_batch, int(c)) not in settings]
        variants = decode.parse_variants(FLAGS.layouts, FLAGS.kv_codecs, FLAGS.batch_invariant)
        report = decode.run(
            model, settings=settings, new_tokens=FLAGS.new_tokens, variants=variants,
            torch_threads=threads, skip_hf=FLAGS.skip_hf, page_size=FLAGS.page_size,
            warm_tokens=FLAGS.warm_tokens, seed=FLAGS.seed, profile=FLAGS.profile)
    if FLAGS.prefill_lens:
        report["prefill"] = prefill.run(
            model, prompt_lens=[int(n) for n in FLAGS.prefill_lens],
            chunks=[int(c) for c in FLAGS.prefill_chunks], threads=threads[0],
            skip_hf=FLAGS.skip_hf, repeats=FLAGS.prefill_repeats, seed=FLAGS.seed,
            batch_invariant=FLAGS.batch_invariant)
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags=dict(settings=settings, new_tokens=FLAGS.new_tokens,
                                      variants=[v.name for v in variants],
                                      torch_threads=threads, page_size=FLAGS.page_size,
                                      seed=FLAGS.seed, profile=FLAGS.profile,
                                      prefill_lens=FLAGS.prefill_lens,
                                      prefill_chunks=FLAGS.prefill_chunks), **report),
                      f, indent=1)
    if FLAGS.plot and settings:
        decode.plot_step_vs_kv_bytes(report, FLAGS.plot, FLAGS.sweep_batch)


if __name__ == "__main__":
    app.run(main)
