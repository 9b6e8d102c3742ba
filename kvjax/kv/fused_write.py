"""The fused KV write: a block's K and V written into their pages by the projection itself.

The step otherwise computes K = RoPE(x @ wk) and V = x @ wv as two [T, K, D] arrays, then
scatters them into the pool: each is written to memory once and read back once by the scatter.
Here one kernel multiplies, turns K by RoPE and stores each token's rows straight into its slot
of the donated pool (`kvjax.models.linear.linear_kv_write` on the CPU;
`pallas_kernels.fused_kv_write` is the same write as a Pallas kernel). RoPE comes before the
write (the cache holds turned keys), so the kernel applies it from cos/sin tables XLA computes
per token ([T, D/2], elementwise, a few bytes per token); a model that normalizes its keys
before RoPE (qk_norm) is refused (`kvjax.engine.compat`).

The write reads a typed view of the state: exact float32 K/V pages (`PagedKV`); other states
(codes, latent rows, Quest's summaries updated on write) say why not (`reason_for`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.kv.state import PagedKV, scatter_rows
from kvjax.models import linear
from kvjax.models.rope import turn


def reason_for(kv) -> str | None:
    """None when the fused write can write `kv`'s pages here, else a sentence saying why not."""
    if not isinstance(kv, PagedKV):
        return (f"the fused KV write stores float32 K and V rows into pages of their own, "
                f"which a {type(kv).__name__} does not hold")
    if kv.k_pages.dtype != jnp.float32:
        return f"the fused KV write stores float32 rows, not {kv.k_pages.dtype} pages"
    if jax.default_backend() != "cpu":
        return (f"the engine's fused KV write is the native CPU kernel, and the backend is "
                f"{jax.default_backend()!r} (pallas_kernels.fused_kv_write is not wired in)")
    return linear.kv_write_unavailable_reason()


def write_projected(kv: PagedKV, pool_layer: jax.Array, slots: jax.Array, x: jax.Array,
                    wk: jax.Array, wv: jax.Array, layer: jax.Array, bk: jax.Array | None,
                    bv: jax.Array | None, cos: jax.Array, sin: jax.Array, *,
                    invariant: bool = False) -> PagedKV:
    """`kv` with K = RoPE(x @ wk[layer] + bk) and V = x @ wv[layer] + bv written into flat
    slots [T] (-1: dropped) of layer `pool_layer`, by the native kernel.

    x: [T, In]; wk, wv: [L, In, K*D]; bk, bv: [K*D] (the layer's) or None; cos, sin:
    [T, D/2].
    `invariant`: the products in the batch-invariant order (`linear.invariant_linear`'s).
    """
    k_pages, v_pages = linear.linear_kv_write(x, wk, wv, layer, bk, bv, cos, sin, slots,
                                              kv.k_pages, kv.v_pages, pool_layer,
                                              invariant=invariant)
    return kv.replace(k_pages=k_pages, v_pages=v_pages)


def write_projected_reference(kv: PagedKV, pool_layer: jax.Array, slots: jax.Array,
                              x: jax.Array, wk: jax.Array, wv: jax.Array, layer: jax.Array,
                              bk: jax.Array | None, bv: jax.Array | None, cos: jax.Array,
                              sin: jax.Array) -> PagedKV:
    """What `write_projected` computes, materialized then scattered (jnp, float32)."""
    t, (k_heads, d) = x.shape[0], kv.k_pages.shape[3:]
    k = jnp.matmul(x, wk[layer], precision=jax.lax.Precision.HIGHEST)  # [T, K*D]
    v = jnp.matmul(x, wv[layer], precision=jax.lax.Precision.HIGHEST)
    if bk is not None:
        k, v = k + bk, v + bv
    k = turn(k.reshape(t, k_heads, d), cos, sin)  # [T, K, D]
    return kv.replace(k_pages=scatter_rows(kv.k_pages, pool_layer, slots, k),
                      v_pages=scatter_rows(kv.v_pages, pool_layer, slots,
                                           v.reshape(t, k_heads, d)))
