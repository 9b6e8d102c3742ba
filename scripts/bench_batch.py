"""Offline batch inference: orderings side by side and prefill-only reach, in one run.

  python scripts/bench_batch.py --output_json docs/results/bench_batch.json

Runs the `corpus` and `table` workloads of `kvjax.bench.batch` under every ordering on the
tiny random model (untrained weights, a byte tokenizer; outputs mean nothing, the cache work
is real), then the longest input the engine admits against what prefill-only scores.
With --reach_only, only that comparison, on --reach_model (the embedded SmolLM2's 30 layers
show the L-fold reach better than the tiny model's 2):

  python scripts/bench_batch.py --reach_only --reach_model=embedded --num_pages 16 \
      --output_json docs/results/bench_batch_reach_smollm2.json
"""

from __future__ import annotations

import dataclasses
import json

from absl import app, flags

import kvjax
from kvjax.batch import ORDERINGS
from kvjax.bench import batch
from kvjax.testing import TINY, tiny_model, tiny_tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_requests", 2000, "Requests per workload.")
flags.DEFINE_integer("max_tokens", 4, "Tokens generated per request.")
flags.DEFINE_integer("num_pages", 96, "KV pages (16 tokens each) in the pool.")
flags.DEFINE_integer("max_num_seqs", 16, "Sequences per step at most.")
flags.DEFINE_list("orders", sorted(ORDERINGS), "Orderings to compare ('input' is the baseline).")
flags.DEFINE_string("output_json", None, "Write the results here.")
flags.DEFINE_bool("reach_only", False, "Only the prefill-only reach comparison.")
flags.DEFINE_enum("reach_model", "tiny", ["tiny", "embedded"], "The model of --reach_only.")


def reach_only() -> dict:
    model = kvjax.load_model() if FLAGS.reach_model == "embedded" else tiny_model()
    result = batch.prefill_only_reach(model, batch.bench_config(FLAGS.num_pages,
                                                                FLAGS.max_num_seqs))
    return dict(model=FLAGS.reach_model, num_pages=FLAGS.num_pages, prefill_only=result)


def main(argv):
    del argv
    if FLAGS.reach_only:
        results = reach_only()
        print(json.dumps(results, indent=1))
        if FLAGS.output_json:
            with open(FLAGS.output_json, "w") as f:
                json.dump(results, f, indent=1)
        return
    config_ = dataclasses.replace(TINY, max_position_embeddings=8192)
    model = dataclasses.replace(tiny_model(config_), tokenizer=tiny_tokenizer())
    config = batch.bench_config(FLAGS.num_pages, FLAGS.max_num_seqs)
    orders = ["input", *[o for o in FLAGS.orders if o != "input"]]
    workloads = dict(
        corpus=batch.corpus_questions(FLAGS.num_requests, max_tokens=FLAGS.max_tokens),
        table=batch.table_records(FLAGS.num_requests, max_tokens=FLAGS.max_tokens))
    results = dict(model="tiny random (L=2, untrained weights, byte tokenizer)",
                   num_requests=FLAGS.num_requests, max_tokens=FLAGS.max_tokens,
                   num_pages=FLAGS.num_pages, max_num_seqs=FLAGS.max_num_seqs)
    for name, lines in workloads.items():
        results[name] = batch.compare_orders(model, lines, orders, config)
        print(name, json.dumps(results[name], indent=1))
    results["prefill_only"] = batch.prefill_only_reach(model, config)
    print(json.dumps(results["prefill_only"], indent=1))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
