"""Agentic trajectory locality: multi-turn trajectories over rollout workers, each turn placed
on the worker holding the conversation's pages (sticky), there until loads drift apart and then
moved with its pages (migrate), or moved without them (blind).

  python scripts/bench_agentic.py --output_dir /tmp/bench_agentic

Prints the prompt tokens prefilled and served by the workers' prefix caches, the migrations and
KV bytes they moved, per placement (kvjax.bench.agentic), and writes agentic.json. The workers
are engines in this process taking turns on the host: "seconds (in turn)" is that wall time,
"seconds (side by side)" an estimate for workers running in parallel (per round, the slowest
worker's stepping time plus the page moves); token and byte counts are exact.
"""

from __future__ import annotations

from absl import app, flags

from kvjax.bench import agentic
from kvjax.engine.config import EngineConfig
from kvjax.models.loading import load_model

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Embedded model (default), a Hugging Face directory or .gguf.")
flags.DEFINE_integer("num_workers", 2, "Rollout workers (one engine each).")
flags.DEFINE_integer("num_trajectories", 4, "Trajectories per placement.")
flags.DEFINE_integer("num_turns", 6, "Turns of the trajectories homed on worker 0.")
flags.DEFINE_integer("short_turns", 2, "Turns of the other trajectories (0: num_turns): the "
                     "skew that makes the workers' loads drift apart.")
flags.DEFINE_integer("first_len", 64, "Tokens of each trajectory's first prompt.")
flags.DEFINE_integer("answer_len", 24, "Tokens of the environment's answer to each turn.")
flags.DEFINE_integer("max_new_tokens", 16, "Tokens each turn generates (greedy).")
flags.DEFINE_integer("max_num_seqs", 4, "Sequences each worker runs at once: fewer than its "
                     "live trajectories saturates it.")
flags.DEFINE_string("output_dir", "/tmp/bench_agentic", "Where agentic.json goes.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    model = load_model(FLAGS.model)
    config = EngineConfig(page_size=16, num_pages=256, max_num_seqs=FLAGS.max_num_seqs,
                          max_num_batched_tokens=256, max_prefill_chunk=128, max_model_len=512)
    rows = agentic.run(model, config, num_workers=FLAGS.num_workers,
                       num_trajectories=FLAGS.num_trajectories, num_turns=FLAGS.num_turns,
                       short_turns=FLAGS.short_turns or None,
                       first_len=FLAGS.first_len, answer_len=FLAGS.answer_len,
                       max_new_tokens=FLAGS.max_new_tokens)
    print(agentic.table(rows))
    print(f"wrote {agentic.write(rows, FLAGS.output_dir)}")


if __name__ == "__main__":
    app.run(main)
