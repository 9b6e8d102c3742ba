"""A tiny random model and stand-ins for tests, notebooks and quick benchmark checks.

    from kvjax.testing import ByteTokenizer, greedy_reference, tiny_model

    model = tiny_model()                       # 2 layers, compiles in seconds on a CPU
    tokens = greedy_reference(model, [1, 5, 9], max_new_tokens=8)

The model runs the same code paths as a real Llama (paged attention, GQA with 2 query heads
per KV head, RoPE); only its size and weights are made up, so its outputs mean nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.models import llama
from kvjax.models.model import Model
from kvjax.shapes import next_power_of_2

TINY = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                   eos_token_ids=(127,), name="tiny")
"""The tiny model's config: L=2, N=4, K=2, D=8, a 128-token vocabulary, EOS 127."""


def tiny_model(config: ModelConfig = TINY, seed: int = 0, scale: float = 0.5) -> Model:
    """A Llama with random weights, large enough that greedy decoding is not degenerate.

    Args:
      config: the architecture; `TINY` by default.
      seed: the PRNG seed of the weights.
      scale: the weights' initial scale (see `kvjax.models.llama.init_params`).
    """
    params = llama.init_params(config, jax.random.PRNGKey(seed), scale=scale)
    return Model(config=config, params=params, source="random")


@functools.cache
def _dense_logits(config: ModelConfig):
    """Last-token logits of a sequence right-padded to a power of two (>= 16) tokens: causal
    attention keeps the padding out of every real position, and the padded lengths bound the
    compiles to a few per session."""
    forward = jax.jit(lambda params, tokens, n: llama.forward_dense(params, config, tokens)[n - 1])

    def logits(params, tokens: list[int]) -> jax.Array:
        padded = np.zeros(next_power_of_2(max(len(tokens), 16)), np.int32)
        padded[:len(tokens)] = tokens
        return forward(params, padded, np.int32(len(tokens)))

    return logits


def greedy_reference(model: Model, prompt: list[int], max_new_tokens: int,
                     stop: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation by full recomputation, no KV cache: the engine's oracle.

    Recomputes the whole sequence for every token (O(T^2) work), so keep it short.

    Args:
      model: the model to decode.
      prompt: the prompt's token ids.
      max_new_tokens: the most tokens generated.
      stop: token ids that end the continuation (included in it).

    Returns:
      The generated token ids, without the prompt.
    """
    tokens = list(prompt)
    step = _dense_logits(model.config)
    out = []
    for _ in range(max_new_tokens):
        token = int(jnp.argmax(step(model.params, tokens)))
        tokens.append(token)
        out.append(token)
        if token in stop:
            break
    return out


class ByteTokenizer:
    """Stands in for a real tokenizer with the tiny model: one id in [2, 128) per byte.

    Enough for `kvjax.bench.workloads`, which only needs `encode`. Byte b becomes
    `2 + b % 126`, so ids are not decodable; BOS is 1.
    """

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [1] * add_bos + [2 + b % 126 for b in text.encode()]
