"""Multi-head latent attention (DeepSeek-V2/V3) over a cache of latents: pure functions.

A layer's attention params (`x @ W` orientation, stacked on a leading L axis like the rest of
`kvjax.models.llama`'s pytree; Nq = N * (d_nope + d_r) with d_nope = qk_nope_head_dim and
d_r = qk_rope_head_dim, d_c = kv_lora_rank, d_v = v_head_dim):

  wq:        [L, H, Nq]             without a query low-rank projection (q_lora_rank 0)
  wq_a:      [L, H, q_lora_rank]    with one: x @ wq_a, RMSNorm (q_a_norm), @ wq_b
  q_a_norm:  [L, q_lora_rank]
  wq_b:      [L, q_lora_rank, Nq]
  wkv_a:     [L, H, d_c + d_r]      the latent (before kv_a_norm), then the RoPE key part
  kv_a_norm: [L, d_c]
  wkv_b:     [L, d_c, N * (d_nope + d_v)]   per head: W_UK_n [d_c, d_nope], then W_UV_n
  wo:        [L, N * d_v, H]

Each head's query is [q_nope_n, q_r_n] and its key [c @ W_UK_n, k_r], so its logit is
(W_UK_n q_nope_n) . c + q_r_n . k_r: the query absorbed into the latent space, [W_UK_n q_nope_n,
q_r_n] of width d_c + d_r, meets the cached [c, k_r] as one key of one "kv head". The value
c @ W_UV_n is linear in c, so attention averages the cached rows and the first d_c columns of
the result, times W_UV_n, are the head's output. Every attention path (the blockwise jnp one,
the paged pool, the prefix cache) then reads pages of [c, k_r] as MQA with K = 1 and D = d_c +
d_r, values equal to the keys; prefill and decode both run this absorbed form, which is exact
(only the order of float sums differs from expanding K and V per head).

The RoPE rotates in the rotate-half convention; DeepSeek's checkpoints rotate interleaved
pairs, so the loader permutes the RoPE columns of wq / wq_b and wkv_a (a permutation of both
the query's and the key's RoPE columns leaves their dot product unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig

Params = dict[str, Any]


def attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes ([in, out] for matrices, no L axis) of a layer's MLA params."""
    c, m = config, config.mla
    nq = c.num_heads * m.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "wkv_a": (c.hidden_size, m.cache_dim),
        "kv_a_norm": (m.kv_lora_rank,),
        "wkv_b": (m.kv_lora_rank, c.num_heads * (m.qk_nope_head_dim + m.v_head_dim)),
        "wo": (c.num_heads * m.v_head_dim, c.hidden_size),
    }
    if m.q_lora_rank:
        shapes.update(wq_a=(c.hidden_size, m.q_lora_rank), q_a_norm=(m.q_lora_rank,),
                      wq_b=(m.q_lora_rank, nq))
    else:
        shapes["wq"] = (c.hidden_size, nq)
    return shapes


NORMS = ("kv_a_norm", "q_a_norm")  # the attention params that are RMSNorm weights


def rope_permutation(rope_dim: int) -> np.ndarray:
    """[d_r] column order that maps interleaved RoPE pairs (2i, 2i + 1) to rotate-half pairs
    (i, i + d_r / 2): the even columns, then the odd ones."""
    return np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])


def attention(config: ModelConfig, attend, x: jax.Array, positions: jax.Array, p: Params,
              layer_index: jax.Array, cache: Any, matmul: Callable, norm: Callable
              ) -> tuple[jax.Array, Any]:
    """One layer's latent attention. x: [T, H], already through the layer's attn_norm.

    `attend(layer, q [T, N, d_c + d_r], k [T, 1, d_c + d_r], v, cache)` writes k (v is the
    same array: values live in the latent) and returns [T, N, d_c + d_r]. `matmul(x, w)`
    multiplies by a matrix of `p`; `norm(x, w)` is the model's RMSNorm.
    Returns the attention block's output [T, H] and the cache.
    """
    c, m = config, config.mla
    t, n = x.shape[0], c.num_heads
    if m.q_lora_rank:
        q = matmul(norm(matmul(x, p["wq_a"]), p["q_a_norm"]), p["wq_b"])
    else:
        q = matmul(x, p["wq"])
    q = q.reshape(t, n, m.qk_head_dim)  # [T, N, d_nope + d_r]
    q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
    ckv = matmul(x, p["wkv_a"])  # [T, d_c + d_r]
    latent = norm(ckv[:, :m.kv_lora_rank], p["kv_a_norm"])  # [T, d_c]
    k_rope = c.rope.apply(ckv[:, None, m.kv_lora_rank:], positions)  # [T, 1, d_r]
    q_rope = c.rope.apply(q_rope, positions)  # [T, N, d_r]
    # A native linear reads matrices whole ([L, in, out]); the absorption needs this layer's.
    w_kv_b = p["wkv_b"] if p["wkv_b"].ndim == 2 else p["wkv_b"][layer_index]
    w_kv_b = w_kv_b.reshape(m.kv_lora_rank, n, m.qk_nope_head_dim + m.v_head_dim)
    w_uk, w_uv = w_kv_b[..., :m.qk_nope_head_dim], w_kv_b[..., m.qk_nope_head_dim:]
    q_latent = jnp.einsum("tnd,cnd->tnc", q_nope, w_uk,
                          preferred_element_type=jnp.float32)  # [T, N, d_c]
    # Attention scales logits by head_dim**-0.5 (head_dim = d_c + d_r); the model's scale
    # goes into the query instead.
    scale = m.attn_scale * np.sqrt(c.head_dim)
    q_cat = jnp.concatenate([q_latent, q_rope.astype(jnp.float32)], axis=-1) * scale
    kv = jnp.concatenate([latent, k_rope[:, 0]], axis=-1)[:, None]  # [T, 1, d_c + d_r]
    out, cache = attend(layer_index, q_cat.astype(x.dtype), kv, kv, cache)  # [T, N, d_c + d_r]
    heads = jnp.einsum("tnc,cnd->tnd", out[..., :m.kv_lora_rank].astype(x.dtype), w_uv,
                       preferred_element_type=jnp.float32)  # [T, N, d_v]
    return matmul(heads.reshape(t, n * m.v_head_dim).astype(x.dtype), p["wo"]), cache
