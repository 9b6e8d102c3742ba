"""KV calibration: static per-layer, per-kv-head fp8 scales from a calibration set.

`fp8_kv_scales` runs the model densely (no KV cache) over calibration token sequences and
records, per layer and kv head, the largest |K| and |V| the attention sees: exactly the
post-RoPE keys and the values a KV cache stores. The scales are margin * amax / fp8_max, so a
calibrated fp8 codec (`kvjax.kv.codecs.Fp8Codec`) saturates only values more than `margin`
times beyond anything in the calibration set.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.kv import codecs
from kvjax.kv.attention import dense_attention_reference
from kvjax.models import llama

DEFAULT_MARGIN = 2.0


@functools.partial(jax.jit, static_argnames=("config",))
def _kv_amax(params, tokens: jax.Array, *, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Per layer and kv head, max |K| and max |V| over one sequence: ([L, K], [L, K])."""
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def attend(layer, q, k, v, amax):
        k_amax, v_amax = amax  # [L, K] each
        k_amax = k_amax.at[layer].max(jnp.max(jnp.abs(k.astype(jnp.float32)), axis=(0, 2)))
        v_amax = v_amax.at[layer].max(jnp.max(jnp.abs(v.astype(jnp.float32)), axis=(0, 2)))
        out = dense_attention_reference(q, k, v, positions)  # [T, N, D]
        return out.astype(q.dtype), (k_amax, v_amax)

    zeros = jnp.zeros((config.num_layers, config.num_kv_heads), jnp.float32)
    _, amax = llama.decode_body(params, config, tokens, positions, attend, (zeros, zeros))
    return amax


def kv_amax(params, config: ModelConfig, prompts: Sequence[Sequence[int]]
            ) -> tuple[np.ndarray, np.ndarray]:
    """Max |K| and |V| per layer and kv head over calibration prompts: ([L, K], [L, K])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("calibration needs at least one non-empty prompt")
    k_amax = np.zeros((config.num_layers, config.num_kv_heads), np.float32)
    v_amax = np.zeros_like(k_amax)
    for prompt in prompts:
        k, v = _kv_amax(params, jnp.asarray(prompt, jnp.int32), config=config)
        k_amax, v_amax = np.maximum(k_amax, k), np.maximum(v_amax, v)
    return k_amax, v_amax


def fp8_kv_scales(params, config: ModelConfig, prompts: Sequence[Sequence[int]],
                  fmt: codecs.Fp8Format | str, *, margin: float = DEFAULT_MARGIN
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Static fp8 scales (K, V), each [L, K]: margin * amax / fp8_max over `prompts`.

    Args:
        params, config: the model.
        prompts: calibration token sequences (real text the engine will serve is best).
        fmt: the float8 format.
        margin: headroom factor >= 1 over the calibration amax.
    """
    if not margin >= 1.0:
        raise ValueError(f"margin must be >= 1, got {margin!r}")
    k_amax, v_amax = kv_amax(params, config, prompts)
    for name, amax in (("K", k_amax), ("V", v_amax)):
        if not np.all(np.isfinite(amax) & (amax > 0)):
            raise ValueError(f"calibration gives {name} amax {amax.tolist()}: every layer and "
                             f"kv head needs finite, not all-zero activations")
    max_value = codecs.Fp8Format(fmt).max_value
    return margin * k_amax / max_value, margin * v_amax / max_value
