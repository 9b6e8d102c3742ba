"""One tensor-parallel engine driven by several processes (multi-host JAX on one machine).

Start one copy per process with the same flags except --process_id; each prints the tokens it
read back, identical in every process:

  python scripts/multihost_demo.py --num_processes 2 --process_id 0 --coordinator 127.0.0.1:12355
  python scripts/multihost_demo.py --num_processes 2 --process_id 1 --coordinator 127.0.0.1:12355

With --num_processes 1 it runs alone (a single-process reference over the local devices).
On GPU or TPU hosts the same command runs per host, with the coordinator on host 0.
"""

from __future__ import annotations

import json

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("coordinator", "127.0.0.1:12355", "host:port of process 0's coordinator.")
flags.DEFINE_integer("num_processes", 1, "Processes in the run.")
flags.DEFINE_integer("process_id", 0, "This process's index.")
flags.DEFINE_integer("tp", 0, "Tensor-parallel size (0: every device of every process).")
flags.DEFINE_enum("model", "random", ["random", "embedded"],
                  "A small random Llama (4 heads, 2 kv heads) or the embedded SmolLM2-135M.")
flags.DEFINE_integer("num_prompts", 4, "Random prompts to generate for.")
flags.DEFINE_integer("max_new_tokens", 8, "Tokens per prompt.")
flags.DEFINE_integer("seed", 0, "Seed of the prompts and the random model.")


def build_model(name: str, seed: int):
    """The demo's model: a small random Llama or the embedded SmolLM2."""
    import jax

    from kvjax.config import ModelConfig
    from kvjax.models import llama
    from kvjax.models.loading import load_model
    from kvjax.models.model import Model

    if name == "embedded":
        return load_model(None, "float32")
    config = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                         eos_token_ids=(127,), name="demo")
    params = llama.init_params(config, jax.random.PRNGKey(seed), scale=0.5)
    return Model(config=config, params=params, source="random")


def run(model_name: str, tp: int, num_prompts: int, max_new_tokens: int, seed: int
        ) -> list[list[int]]:
    """Greedy tokens of a tp engine over the global devices, for seeded random prompts."""
    import jax
    import numpy as np

    from kvjax import EngineConfig, SamplingParams
    from kvjax.engine.engine import Engine
    from kvjax.parallel import sharding

    model = build_model(model_name, seed)
    rng = np.random.default_rng(seed)
    vocab = min(model.config.vocab_size, 120)
    prompts = [[int(t) for t in rng.integers(0, vocab, size=int(rng.integers(3, 20)))]
               for _ in range(num_prompts)]
    mesh = sharding.replica_meshes(sharding.make_mesh(tp or len(jax.devices())))[0]
    engine = Engine(model, EngineConfig(page_size=4, num_pages=128, max_num_seqs=8), mesh=mesh)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    return [o.outputs[0].token_ids for o in outputs]


def main(argv):
    del argv
    if FLAGS.num_processes > 1:
        from kvjax.parallel import distributed

        distributed.initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
    import jax

    tokens = run(FLAGS.model, FLAGS.tp, FLAGS.num_prompts, FLAGS.max_new_tokens, FLAGS.seed)
    print(json.dumps(dict(process=jax.process_index(), processes=jax.process_count(),
                          devices=len(jax.devices()), tokens=tokens)), flush=True)


if __name__ == "__main__":
    app.run(main)
