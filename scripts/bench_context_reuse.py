"""Non-prefix context reuse (none, APE, EPIC, CacheBlend) against full prefill on RAG prompts.

  python scripts/bench_context_reuse.py --output_json docs/results/bench_context_reuse.json
  python scripts/bench_context_reuse.py --num_requests 8 --strategies full,none,epic

Every strategy of `--strategies` serves the same `rag` workload on the embedded model, one
request at a time, the engines taking turns; `kvjax.bench.context_reuse` says what is measured.
"""

from __future__ import annotations

import dataclasses
import json

from absl import app, flags

import kvjax
from kvjax.bench import context_reuse

FLAGS = flags.FLAGS
flags.DEFINE_list("strategies", list(context_reuse.DEFAULT_STRATEGIES),
                  "Context-reuse strategies ('full' is the reference).")
flags.DEFINE_float("ape_temperature", 0.9, "APE's attention temperature on cached chunks.")
flags.DEFINE_integer("epic_tokens", 16, "Tokens EPIC recomputes at the start of each chunk.")
flags.DEFINE_float("cacheblend_ratio", 0.15, "Fraction of chunk tokens CacheBlend recomputes.")
flags.DEFINE_integer("num_requests", 32, "RAG requests.")
flags.DEFINE_integer("num_docs", 16, "Documents in the retrieval pool.")
flags.DEFINE_integer("docs_per_prompt", 3, "Documents per prompt.")
flags.DEFINE_integer("output_len", 8, "Tokens generated per request.")
flags.DEFINE_integer("quality_requests", 16, "Requests whose answers are scored for KL.")
flags.DEFINE_integer("num_pages", 1024, "KV pages per engine (chunks and requests' pages).")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    options = dict(ape=dict(temperature=FLAGS.ape_temperature),
                   epic=dict(num_tokens=FLAGS.epic_tokens),
                   cacheblend=dict(ratio=FLAGS.cacheblend_ratio))
    settings = context_reuse.ReuseBench(
        strategies=tuple(FLAGS.strategies),
        options={s: o for s, o in options.items() if s in FLAGS.strategies},
        num_requests=FLAGS.num_requests, num_docs=FLAGS.num_docs,
        docs_per_prompt=FLAGS.docs_per_prompt, output_len=FLAGS.output_len,
        quality_requests=FLAGS.quality_requests, num_pages=FLAGS.num_pages, seed=FLAGS.seed)
    report = context_reuse.run(kvjax.load_model(), settings)
    print(context_reuse.format_table(report["results"]))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(settings=dataclasses.asdict(settings), **report), f, indent=1)


if __name__ == "__main__":
    app.run(main)
