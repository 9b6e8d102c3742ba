"""The fused KV write's oracle: K and V materialized, K turned by RoPE, both scattered (jnp,
float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fused_kv_write_reference(x: jax.Array, wk: jax.Array, wv: jax.Array, cos: jax.Array,
                             sin: jax.Array, slots: jax.Array, k_pages: jax.Array,
                             v_pages: jax.Array, *, layer: jax.Array | int = 0,
                             pool_layer: jax.Array | int = 0, bk: jax.Array | None = None,
                             bv: jax.Array | None = None, k_norm: jax.Array | None = None,
                             norm_eps: float = 1e-6, norm_unit_offset: bool = False
                             ) -> tuple[jax.Array, jax.Array]:
    """K = RoPE(norm(x @ wk[layer] + bk)), V = x @ wv[layer] + bv, row t stored at flat slot
    slots[t] (-1: nowhere) of layer `pool_layer` of the pages.

    Args:
      x: [T, In]; wk, wv: [L, In, K*D]; bk, bv: [K*D] or None.
      k_norm: [D], the keys' per-head RMSNorm weight (scaling by 1 + w with
        `norm_unit_offset`, epsilon `norm_eps`), or None: no norm.
      cos, sin: [T, D/2], RoPE's rotate-half tables at each token's position.
      slots: [T] int32; k_pages, v_pages: [Lp, num_pages, P, K, D].
    Returns:
      (k_pages, v_pages) with the rows written.
    """
    t = x.shape[0]
    lp, num_pages, page, heads, d = k_pages.shape
    hi = jax.lax.Precision.HIGHEST
    k = jnp.matmul(x.astype(jnp.float32), wk[layer].astype(jnp.float32), precision=hi)
    v = jnp.matmul(x.astype(jnp.float32), wv[layer].astype(jnp.float32), precision=hi)
    if bk is not None:
        k, v = k + bk, v + bv  # [T, K*D]
    k = k.reshape(t, heads, d)
    if k_norm is not None:
        w = k_norm.astype(jnp.float32)
        k = k * jax.lax.rsqrt(jnp.mean(k * k, axis=-1, keepdims=True) + norm_eps) * (
            1.0 + w if norm_unit_offset else w)
    k1, k2 = k[..., :d // 2], k[..., d // 2:]
    c, s = cos[:, None], sin[:, None]  # [T, 1, D/2]
    k = jnp.concatenate([k1 * c - k2 * s, k2 * c + k1 * s], axis=-1)  # [T, K, D]
    n = num_pages * page
    rows = jnp.where((slots >= 0) & (slots < n), slots, n)

    def put(pages, values):
        flat = pages.reshape(lp, n, heads, d)
        flat = flat.at[pool_layer, rows].set(values.astype(pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return put(k_pages, k), put(v_pages, v.reshape(t, heads, d))
