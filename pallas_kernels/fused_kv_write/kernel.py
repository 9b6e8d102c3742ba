"""The fused KV write as a Pallas kernel: each token's K and V rows computed and stored into
their page slot by one program, the pools aliased to the outputs (in place when donated).

Grid: one program per token. Scalar-prefetched index arrays pick the token's input row and its
destination block `[K, D]` (page slot // P, slot % P of layer `pool_layer`); the weights'
block is the whole layer `[In, K*D]`. A token with slot -1 (padding) recomputes and rewrites
the row of the step's first written token instead (the same values to the same place), so no
program writes outside the tokens' own slots; a step with no slot to write runs no kernel.

Checked against `fused_kv_write_reference` in interpret mode on the CPU
(tests/pallas_kernels/test_fused_kv_write_kernel.py); the engine's fused write on the CPU is the
native kernel (`kvjax.kv.fused_write`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(src_ref, dst_ref, layers_ref, x_ref, wk_ref, wv_ref, bk_ref, bv_ref, cos_ref,
            sin_ref, k_any, v_any, k_out, v_out, *, heads: int, d: int, has_bias: bool):
    del src_ref, dst_ref, layers_ref, k_any, v_any  # read by the index maps; aliased pools
    hi = jax.lax.Precision.HIGHEST
    x = x_ref[...].astype(jnp.float32)  # [1, In]
    k = jnp.dot(x, wk_ref[...].astype(jnp.float32), precision=hi)  # [1, K*D]
    v = jnp.dot(x, wv_ref[...].astype(jnp.float32), precision=hi)
    if has_bias:
        k, v = k + bk_ref[...], v + bv_ref[...]
    k = k.reshape(heads, d)
    k1, k2 = k[:, :d // 2], k[:, d // 2:]
    c, s = cos_ref[...], sin_ref[...]  # [1, D/2]
    k_out[...] = jnp.concatenate([k1 * c - k2 * s, k2 * c + k1 * s], axis=-1).astype(
        k_out.dtype)  # [K, D]
    v_out[...] = v.reshape(heads, d).astype(v_out.dtype)


def fused_kv_write(x: jax.Array, wk: jax.Array, wv: jax.Array, cos: jax.Array,
                   sin: jax.Array, slots: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                   *, layer: jax.Array | int = 0, pool_layer: jax.Array | int = 0,
                   bk: jax.Array | None = None, bv: jax.Array | None = None,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`fused_kv_write_reference`'s result by the kernel (same arguments)."""
    t, in_dim = x.shape
    lp, num_pages, page, heads, d = k_pages.shape
    n = heads * d
    valid = (slots >= 0) & (slots < num_pages * page)  # [T]
    first = jnp.argmax(valid).astype(jnp.int32)
    src = jnp.where(valid, jnp.arange(t, dtype=jnp.int32), first)  # [T]
    dst = slots[src].astype(jnp.int32)  # [T]
    layers = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(pool_layer, jnp.int32)])
    has_bias = bk is not None
    zeros = jnp.zeros((n,), jnp.float32)
    bias = [(b if has_bias else zeros).reshape(1, n).astype(jnp.float32) for b in (bk, bv)]

    def row(i, src, dst, layers):
        return src[i], 0

    def weights(i, src, dst, layers):
        return layers[0], 0, 0

    def whole(i, src, dst, layers):
        return 0, 0

    def out(i, src, dst, layers):
        return layers[1], dst[i] // page, dst[i] % page, 0, 0

    pool_spec = pl.BlockSpec((None, None, None, heads, d), out)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(t,),
        in_specs=[pl.BlockSpec((1, in_dim), row),
                  pl.BlockSpec((None, in_dim, n), weights),
                  pl.BlockSpec((None, in_dim, n), weights),
                  pl.BlockSpec((1, n), whole), pl.BlockSpec((1, n), whole),
                  pl.BlockSpec((1, d // 2), row), pl.BlockSpec((1, d // 2), row),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pool_spec, pool_spec])
    call = pl.pallas_call(
        functools.partial(_kernel, heads=heads, d=d, has_bias=has_bias),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={10: 0, 11: 1}, interpret=interpret)
    f32 = jnp.float32
    return jax.lax.cond(
        jnp.any(valid),
        lambda kp, vp: tuple(call(src, dst, layers, x, wk, wv, *bias, cos.astype(f32),
                                  sin.astype(f32), kp, vp)),
        lambda kp, vp: (kp, vp), k_pages, v_pages)
