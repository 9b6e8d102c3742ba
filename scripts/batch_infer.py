"""Offline batch inference over a JSONL file, crash-safe and resumable.

  python scripts/batch_infer.py --input requests.jsonl --output outputs.jsonl --order prefix
  python scripts/batch_infer.py --input requests.jsonl --output outputs.jsonl --ray_workers 2

With `--ray_workers=N` the job runs over Ray Data on a local Ray instance on 127.0.0.1 (N
actors, one engine each, batches of `--ray_batch_size` lines ordered within each batch); needs
the `ray` extra.

Each input line: {"id", one of "prompt" / "messages" / "prompt_ids" / "record", sampling
fields ("max_tokens", "temperature", "seed", "top_p", "top_k"), optional "score"}. Each id
gets one output line; re-running the same command after a kill finishes the rest.
"""

from __future__ import annotations

import functools

from absl import app, flags

import kvjax
from kvjax.batch import ORDERINGS, run_batch, run_batch_ray
from kvjax.parallel.ray_local import init_local_ray

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "Input JSONL, one request per line.", required=True)
flags.DEFINE_string("output", None, "Output JSONL (appended; ids already there are skipped).",
                    required=True)
flags.DEFINE_string("model", None, "Embedded model (default), a Hugging Face directory or a .gguf.")
flags.DEFINE_enum("order", "input", sorted(ORDERINGS), "How to order the batch.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute and KV dtype.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("num_pages", None, "KV pages in the pool (default: from the budget).")
flags.DEFINE_integer("max_num_seqs", 32, "Sequences decoded per step at most.")
flags.DEFINE_bool("progress", True, "Show a progress bar.")
flags.DEFINE_integer("ray_workers", 0, "Ray actors (one engine each) over Ray Data; 0: this "
                     "process alone.")
flags.DEFINE_integer("ray_batch_size", 16, "Input lines per Ray actor call (with --ray_workers).")


def main(argv):
    del argv
    config = kvjax.EngineConfig(page_size=FLAGS.page_size, num_pages=FLAGS.num_pages,
                                max_num_seqs=FLAGS.max_num_seqs)
    if FLAGS.ray_workers:
        init_local_ray(FLAGS.ray_workers)
        stats = run_batch_ray(functools.partial(kvjax.load_model, FLAGS.model, FLAGS.dtype),
                              FLAGS.input, FLAGS.output, num_workers=FLAGS.ray_workers,
                              batch_size=FLAGS.ray_batch_size, order=FLAGS.order,
                              engine_config=config, progress=FLAGS.progress)
    else:
        model = kvjax.load_model(FLAGS.model, dtype=FLAGS.dtype)
        stats = run_batch(model, FLAGS.input, FLAGS.output, order=FLAGS.order,
                          engine_config=config, progress=FLAGS.progress)
    print(f"[{stats.num_done} ids done ({stats.num_errors} errors, {stats.num_skipped} done "
          f"before) in {stats.seconds:.1f}s; prefill tokens {stats.prefill_tokens}, prefix hit "
          f"rate {stats.prefix_hit_rate:.2f}, generated tokens {stats.generated_tokens}]")


if __name__ == "__main__":
    app.run(main)
