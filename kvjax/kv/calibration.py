"""KV calibration: static per-layer, per-kv-head fp8 scales and low-rank key bases from a
calibration set.

`fp8_kv_scales` runs the model densely (no KV cache) over calibration token sequences and
records, per layer and kv head, the largest |K| and |V| the attention sees: exactly the
post-RoPE keys and the values a KV cache stores. The scales are margin * amax / fp8_max, so a
calibrated fp8 codec (`kvjax.kv.codecs.Fp8Codec`) saturates only values more than `margin`
times beyond anything in the calibration set.

`key_bases` runs the model the same way and accumulates, per layer and kv head, the second
moment K^T K [D, D] of the post-RoPE keys; its top-r eigenvectors are the rank-r basis that
keeps the most of the keys' energy, i.e. the least squared error ||k - k U U^T|| summed over
the calibration keys (uncentered: attention scores are raw dot products, so the mean key is
signal, not an offset to remove).
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


@functools.partial(jax.jit, static_argnames=("config",))
def _key_moments(params, tokens: jax.Array, *, config: ModelConfig) -> jax.Array:
    """Per layer and kv head, the sum of k k^T over one sequence's post-RoPE keys: [L, K, D, D]."""
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def attend(layer, q, k, v, moments):
        k32 = k.astype(jnp.float32)  # [T, K, D]
        moments = moments.at[layer].add(jnp.einsum("tkd,tke->kde", k32, k32))  # [K, D, D]
        out = dense_attention_reference(q, k, v, positions)  # [T, N, D]
        return out.astype(q.dtype), moments

    zeros = jnp.zeros((config.num_layers, config.num_kv_heads, config.head_dim,
                       config.head_dim), jnp.float32)
    _, moments = llama.decode_body(params, config, tokens, positions, attend, zeros)
    return moments


def key_bases(params, config: ModelConfig, prompts: Sequence[Sequence[int]], rank: int
              ) -> np.ndarray:
    """Orthonormal rank-`rank` key bases per layer and kv head: [L, D, r, K] float32.

    Column j of basis[l, :, :, h] is the j-th eigenvector (by eigenvalue, largest first) of
    the second moment of layer l's post-RoPE keys of kv head h over `prompts`.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("calibration needs at least one non-empty prompt")
    if not 1 <= rank <= config.head_dim:
        raise ValueError(f"rank={rank!r} must lie in [1, head_dim={config.head_dim}]")
    moments = np.zeros((config.num_layers, config.num_kv_heads, config.head_dim,
                        config.head_dim), np.float64)
    for prompt in prompts:
        moments += np.asarray(_key_moments(params, jnp.asarray(prompt, jnp.int32),
                                           config=config), np.float64)
    if not np.all(np.isfinite(moments)):
        raise ValueError("calibration keys are not finite")
    _, vectors = np.linalg.eigh(moments)  # ascending eigenvalues: [L, K, D, D]
    top = vectors[..., ::-1][..., :rank]  # [L, K, D, r]
    return np.ascontiguousarray(np.transpose(top, (0, 2, 3, 1)), np.float32)  # [L, D, r, K]
