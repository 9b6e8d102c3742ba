"""The fused KV write: a block's K and V written into their pages by the projection itself.

The step otherwise computes K = RoPE(norm(x @ wk)) and V = x @ wv as two [T, K, D] arrays, then
scatters them into the pool: each is written to memory once and read back once by the scatter.
Here one kernel multiplies, normalizes each key head (qk_norm models: Qwen3, Gemma 3), turns K
by RoPE and stores each token's rows straight into its slot of the donated pool: on the CPU the
native kernel (`kvjax.models.linear.linear_kv_write`), in steps whose matmuls are native; where
the step's attention is the Pallas kernels (GPU/TPU, or attention_impl=pallas anywhere, through
the interpreter on the CPU) the Pallas kernel (`pallas_kernels.fused_kv_write`), in every step.
RoPE comes before the write (the cache holds turned keys), so the kernel applies it from
cos/sin tables XLA computes per token ([T, D/2], elementwise, a few bytes per token).

The write reads a typed view of the state: K/V pages of their own (`PagedKV`; float32 for the
native kernel); other states (codes, latent rows, Quest's summaries updated on write) say why
not (`reason_for`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.kv.state import PagedKV, scatter_rows
from kvjax.models import linear
from kvjax.models.rope import turn


def reason_for(kv, param_dtype=jnp.float32, *, pallas: bool = False, qk_norm: bool = False,
               batch_invariant: bool = False) -> str | None:
    """None when the fused write can write `kv`'s pages here, else a sentence saying why not.

    `pallas`: the step's attention is the Pallas kernels, so the Pallas kernel writes; else the
    native CPU kernel. `qk_norm`: the model normalizes its keys; `batch_invariant`: the step
    runs the batch-invariant mode."""
    if not isinstance(kv, PagedKV):
        return (f"the fused KV write stores K and V rows into pages of their own, "
                f"which a {type(kv).__name__} does not hold")
    if pallas:
        if not jnp.issubdtype(kv.k_pages.dtype, jnp.floating) or kv.k_pages.dtype.itemsize < 2:
            return f"the Pallas fused KV write stores float rows, not {kv.k_pages.dtype} pages"
        return None
    if kv.k_pages.dtype != jnp.float32:
        return f"the fused KV write stores float32 rows, not {kv.k_pages.dtype} pages"
    if jnp.dtype(param_dtype) != jnp.float32:
        return f"the kernel multiplies float32 parameters, not {jnp.dtype(param_dtype)}"
    if jax.default_backend() != "cpu":
        return (f"the native fused KV write runs on the CPU, and the backend is "
                f"{jax.default_backend()!r} with attention that is not the Pallas kernels "
                f"(set attention_impl to auto or pallas)")
    if qk_norm and batch_invariant:
        return ("the batch-invariant mode sums each key head's squares in its own fixed "
                "order, which the kernel's key norm does not reproduce bit for bit")
    return linear.kv_write_unavailable_reason()


def write_projected(kv: PagedKV, pool_layer: jax.Array, slots: jax.Array, x: jax.Array,
                    wk: jax.Array, wv: jax.Array, layer: jax.Array, bk: jax.Array | None,
                    bv: jax.Array | None, cos: jax.Array, sin: jax.Array, *,
                    k_norm: jax.Array | None = None, norm_eps: float = 1e-6,
                    norm_unit_offset: bool = False, invariant: bool = False,
                    pallas: bool = False) -> PagedKV:
    """`kv` with K = RoPE(norm(x @ wk[layer] + bk)) and V = x @ wv[layer] + bv written into
    flat slots [T] (-1: dropped) of layer `pool_layer`, by the native kernel, or with `pallas`
    by the Pallas kernel (interpreted when compiled for the CPU).

    x: [T, In]; wk, wv: [L, In, K*D] (or the layer's [In, K*D] with `pallas`, layer then
    ignored); bk, bv: [K*D] (the layer's) or None; cos, sin: [T, D/2]; k_norm: [D], the
    layer's key RMSNorm weight (qk_norm; epsilon `norm_eps`, scaling by 1 + w with
    `norm_unit_offset`), or None: no norm.
    `invariant`: the products in the batch-invariant order (`linear.invariant_linear`'s;
    native only, without k_norm).
    """
    norm = dict(k_norm=k_norm, norm_eps=norm_eps, norm_unit_offset=norm_unit_offset)
    if pallas:
        from pallas_kernels import targets  # Imported lazily: kernels sit above kvjax.kv.
        from pallas_kernels.fused_kv_write import fused_kv_write

        if wk.ndim == 2:  # the layer's slice (a scan over layers): a stack of one
            wk, wv, layer = wk[None], wv[None], 0
        k_pages, v_pages = fused_kv_write(
            x, wk, wv, cos, sin, slots, kv.k_pages, kv.v_pages, layer=layer,
            pool_layer=pool_layer, bk=bk, bv=bv, **norm,
            interpret=targets.current_platform() == "cpu")
    else:
        k_pages, v_pages = linear.linear_kv_write(x, wk, wv, layer, bk, bv, cos, sin, slots,
                                                  kv.k_pages, kv.v_pages, pool_layer,
                                                  invariant=invariant, **norm)
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
