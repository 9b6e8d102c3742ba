"""Small random models shared by tests: fast to compile, same code paths as real ones."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.models import llama
from kvjax.models.model import Model

TINY = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                   eos_token_ids=(127,), name="tiny")


def tiny_model(config: ModelConfig = TINY, seed: int = 0, scale: float = 0.5) -> Model:
    """Random weights large enough that greedy decoding is not degenerate."""
    params = llama.init_params(config, jax.random.PRNGKey(seed), scale=scale)
    return Model(config=config, params=params, source="random")


@functools.cache
def _dense_logits(config: ModelConfig):
    return jax.jit(lambda params, tokens: llama.forward_dense(params, config, tokens)[-1])


def greedy_reference(model: Model, prompt: list[int], max_new_tokens: int,
                     stop: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation by full recomputation, no KV cache: the engine's oracle."""
    tokens = list(prompt)
    step = _dense_logits(model.config)
    out = []
    for _ in range(max_new_tokens):
        token = int(jnp.argmax(step(model.params, jnp.asarray(tokens, jnp.int32))))
        tokens.append(token)
        out.append(token)
        if token in stop:
            break
    return out
