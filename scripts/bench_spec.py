"""Speculative decoding (ngram prompt lookup, sparse self-drafts) against plain decoding.

  python scripts/bench_spec.py --output_json docs/results/bench_spec.json
  python scripts/bench_spec.py --batch_sizes 1 --context_lens 512 --gammas 2,4 --new_tokens 32

Every (batch, context) pair of `--batch_sizes` x `--context_lens` decodes the same real-text
prompts on the embedded model with plain decoding and each of `--methods` at each of
`--gammas`, the engines taking turns step by step; `kvjax.bench.spec` says what is timed.
The sparse draft reads `--sparse_sinks` + `--sparse_window` tokens of each sequence's pages.
`--retention`, `--retention_budget` and `--kv_codec` (options as JSON) run every variant under
a retention policy or a codec, e.g. speculation under StreamingLLM and KIVI:

  python scripts/bench_spec.py --methods ngram --retention streaming --retention_budget 256
  python scripts/bench_spec.py --methods ngram --kv_codec kivi4 \
      --kv_codec_options '{"group": 16, "residual": 32}'
"""

from __future__ import annotations

import json

from absl import app, flags

import kvjax
from kvjax.bench import spec

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes (sequences decoding at once).")
flags.DEFINE_list("context_lens", ["512", "2048", "4096"], "Prompt lengths.")
flags.DEFINE_list("methods", ["ngram", "sparse_self"], "Draft methods beside plain decoding.")
flags.DEFINE_list("gammas", ["4"], "Draft tokens per verify step.")
flags.DEFINE_bool("adaptive", False, "Also run each method and gamma with adaptive drafts.")
flags.DEFINE_integer("new_tokens", 48, "Tokens generated per sequence.")
flags.DEFINE_integer("sparse_sinks", 16, "Attention-sink tokens the sparse draft reads.")
flags.DEFINE_integer("sparse_window", 256, "Recent tokens the sparse draft reads.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("seed", 0, "Workload seed (which corpus text the prompts are).")
flags.DEFINE_string("retention", "none", "Retention policy of every engine.")
flags.DEFINE_integer("retention_budget", None, "Its budget (tokens per sequence).")
flags.DEFINE_string("retention_options", "{}", "Its options, as JSON.")
flags.DEFINE_string("kv_codec", "none", "KV codec of every engine.")
flags.DEFINE_string("kv_codec_options", "{}", "Its options, as JSON.")
flags.DEFINE_string("output_json", None, "Write the results here.")


def engine_overrides() -> dict:
    """The EngineConfig fields every engine of the run shares (retention, codec)."""
    return dict(retention=FLAGS.retention, retention_budget=FLAGS.retention_budget,
                retention_options=json.loads(FLAGS.retention_options),
                kv_codec=FLAGS.kv_codec, kv_codec_options=json.loads(FLAGS.kv_codec_options))


def main(argv):
    del argv
    model = kvjax.load_model()
    settings = [(int(b), int(c)) for c in FLAGS.context_lens for b in FLAGS.batch_sizes]
    variants = spec.parse_variants(FLAGS.methods, [int(g) for g in FLAGS.gammas],
                                   adaptive=FLAGS.adaptive)
    options = dict(sparse_self=dict(num_sinks=FLAGS.sparse_sinks, window=FLAGS.sparse_window))
    overrides = engine_overrides()
    report = spec.run(model, settings=settings, variants=variants, new_tokens=FLAGS.new_tokens,
                      page_size=FLAGS.page_size, options=options, seed=FLAGS.seed,
                      engine_overrides=overrides)
    print(spec.format_table(report["results"]))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags=dict(settings=settings, variants=[v.name for v in variants],
                                      new_tokens=FLAGS.new_tokens, options=options,
                                      page_size=FLAGS.page_size, seed=FLAGS.seed,
                                      engine=overrides), **report),
                      f, indent=1)


if __name__ == "__main__":
    app.run(main)
