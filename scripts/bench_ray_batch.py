"""Batch tokens/s in one process against Ray Data with 1 and 2 actors, on the same input.

  python scripts/bench_ray_batch.py --output_json docs/results/bench_ray_batch.json

The `corpus` workload of `kvjax.bench.batch` (questions on shared documents) on the embedded
SmolLM2-135M (or --model), greedy, ordered by prefix within each Ray batch. Needs the `ray`
extra. See `kvjax.bench.ray_batch` for what each column measures.
"""

from __future__ import annotations

import functools
import json

from absl import app, flags

import kvjax
from kvjax.bench import batch, ray_batch

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Embedded model (default), a Hugging Face directory or a .gguf.")
flags.DEFINE_integer("num_requests", 48, "Requests in the batch.")
flags.DEFINE_integer("max_tokens", 16, "Tokens generated per request.")
flags.DEFINE_integer("max_num_seqs", 8, "Sequences per step at most, per engine.")
flags.DEFINE_integer("batch_size", 8, "Input lines per Ray actor call.")
flags.DEFINE_list("workers", ["1", "2"], "Ray actor counts to run.")
flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    lines = batch.corpus_questions(FLAGS.num_requests, max_tokens=FLAGS.max_tokens)
    for line in lines:
        line["ignore_eos"] = True  # Every request generates max_tokens: equal work per run.
    config = kvjax.EngineConfig(page_size=16, max_num_seqs=FLAGS.max_num_seqs)
    results = ray_batch.compare_workers(
        functools.partial(kvjax.load_model, FLAGS.model, "float32"), lines,
        [int(n) for n in FLAGS.workers], config, batch_size=FLAGS.batch_size)
    print(f"{'run':16} {'wall s':>8} {'job s':>8} {'tok/s wall':>11} {'tok/s job':>10} "
          f"{'hit rate':>9} {'same tokens':>12}")
    for name, row in results.items():
        print(f"{name:16} {row['wall_seconds']:8.1f} {row['job_seconds']:8.1f} "
              f"{row['tokens_per_s_wall']:11.1f} {row['tokens_per_s_job']:10.1f} "
              f"{row['prefix_hit_rate']:9.3f} {str(row['tokens_equal_single_process']):>12}")
    report = dict(model=FLAGS.model or "embedded SmolLM2-135M-Instruct (float32)",
                  num_requests=FLAGS.num_requests, max_tokens=FLAGS.max_tokens,
                  max_num_seqs=FLAGS.max_num_seqs, batch_size=FLAGS.batch_size,
                  results=results)
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    app.run(main)
