"""Several models under one device budget: the elastic page pool vs static partitions.

  python scripts/bench_multi_model.py --output_json docs/results/bench_multi_model.json

Four models share the budget: the embedded SmolLM2-135M at float32 (exact KV) and at bfloat16
(int8 KV), and two random-weight Llamas of other shapes from kvjax.testing (untrained: their
tokens mean nothing; they only give the pool other layer counts, heads and bytes per token).
The budget holds every model's weights plus `--kv_mb` of KV; requests follow
`kvjax.bench.multi_model.switching_requests` (a few hot models at a time, the hot set redrawn
every `--phase_s` seconds) and each policy serves the same requests on the real clock.
"""

from __future__ import annotations

import json
import tempfile

import jax
from absl import app, flags

import kvjax
from kvjax.bench import multi_model
from kvjax.config import ModelConfig
from kvjax.engine.multi import ModelSpec
from kvjax.testing import tiny_model

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_requests", 64, "Requests in the workload.")
flags.DEFINE_float("rate", 2.0, "Arrivals per second.")
flags.DEFINE_float("phase_s", 8.0, "Seconds between changes of the hot set.")
flags.DEFINE_integer("num_hot", 2, "Models receiving requests in each phase.")
flags.DEFINE_integer("kv_mb", 96, "KV megabytes of the budget beyond all models' weights.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens generated per request.")
flags.DEFINE_list("prompt_lens", ["128", "384"], "Shortest and longest prompt.")
flags.DEFINE_list("policies", ["static", "elastic"], "Pool policies to compare.")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("output_json", None, "Write the results here.")

_RANDOM_SHAPES = {  # other layer and head counts than SmolLM2 (30 layers, 3 KV heads of 64)
    "wide-12L": dict(hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                     num_kv_heads=4, head_dim=64),
    "deep-40L": dict(hidden_size=384, intermediate_size=1024, num_layers=40, num_heads=6,
                     num_kv_heads=2, head_dim=64),
}


def models() -> dict[str, ModelSpec]:
    config = dict(max_num_seqs=8, max_num_batched_tokens=256, max_prefill_chunk=256,
                  max_prefill_seqs=1, max_model_len=448)
    specs = {
        "smollm2-f32": ModelSpec(kvjax.load_model(), kvjax.EngineConfig(**config)),
        "smollm2-bf16-int8": ModelSpec(kvjax.load_model(None, "bfloat16"),
                                       kvjax.EngineConfig(kv_codec="int8", **config)),
    }
    for i, (name, shape) in enumerate(_RANDOM_SHAPES.items()):
        mc = ModelConfig(vocab_size=49152, max_position_embeddings=2048, name=name, **shape)
        specs[name] = ModelSpec(tiny_model(mc, seed=i, scale=0.02), kvjax.EngineConfig(**config))
    return specs


def main(argv):
    del argv
    # Both policies build the same step programs: the second run's compiles are cache hits.
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="kvjax-mm-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    specs = models()
    weights = sum(s.model.nbytes for s in specs.values())
    budget = weights + (FLAGS.kv_mb << 20)
    requests = multi_model.switching_requests(
        list(specs), num_requests=FLAGS.num_requests, rate=FLAGS.rate, phase_s=FLAGS.phase_s,
        num_hot=FLAGS.num_hot, prompt_lens=tuple(int(n) for n in FLAGS.prompt_lens),
        max_new_tokens=FLAGS.max_new_tokens, vocab_size=49152, seed=FLAGS.seed)
    report = multi_model.compare(specs, budget, requests, FLAGS.policies)
    print(f"budget {budget / 1e6:.0f} MB = weights {weights / 1e6:.0f} MB + {FLAGS.kv_mb} MiB KV")
    print(multi_model.format_table(report["results"]))
    if FLAGS.output_json:
        flag_values = {f: FLAGS[f].value for f in ("num_requests", "rate", "phase_s", "num_hot",
                                                   "kv_mb", "max_new_tokens", "prompt_lens",
                                                   "seed")}
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags=flag_values, weight_bytes=weights, budget_bytes=budget,
                           **report), f, indent=1)


if __name__ == "__main__":
    app.run(main)
