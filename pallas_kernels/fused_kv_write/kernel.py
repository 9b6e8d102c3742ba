"""The fused KV write as a Pallas kernel: each token's K and V rows computed and stored into
their page slot by the kernel itself, the pools aliased to the outputs (in place when donated).

K = RoPE(norm(x @ wk + bk)) and V = x @ wv + bv, where `norm` is the keys' per-head RMSNorm
of qk_norm models (Qwen3, Gemma 3; none without `k_norm`). Each kv head's K is computed as its
two rotate-half halves, so RoPE pairs lanes of two products and no program reshapes or slices
a row across heads.

Two schedules express the same write (the attention kernels' split, pallas_kernels/README.md):

  * PIPELINED (TPU, Mosaic; and the CPU's interpreter): grid (T,), one program per token.
    Scalar-prefetched index arrays pick the token's input row and its destination block
    `[K, D]` (page slot // P, slot % P of layer `pool_layer`); the weights' block is the whole
    layer `[In, K*D]`. A token with slot -1 (padding) recomputes and rewrites the row of the
    step's first written token instead (the same values to the same place), so no program
    writes outside the tokens' own slots; a step with no slot to write runs no kernel.
  * LOOPED (GPU, Triton): grid (T, K), one program per token and kv head, its products summed
    over chunks of In (Triton loads power-of-2 tiles); the program reads its slot and stores
    its head's rows into the pool (a padding token stores nothing).

Checked against `fused_kv_write_reference` in interpret mode on the CPU, both schedules
(tests/pallas_kernels/test_fused_kv_write_kernel.py), and compiled for GPU and TPU inside the
engine's step (tests_deviceless).
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import targets

_HI = jax.lax.Precision.HIGHEST


class Schedule(enum.Enum):
    PIPELINED = "pipelined"  # TPU Mosaic (and the CPU interpreter): scalar prefetch.
    LOOPED = "looped"  # GPU Triton: the program reads its slot, chunked products.


def default_schedule() -> Schedule:
    """LOOPED when compiled for a GPU, else PIPELINED."""
    return Schedule.LOOPED if targets.current_platform() == "gpu" else Schedule.PIPELINED


def _norm_and_turn(k1, k2, w1, w2, c, s, *, d: int, norm_eps: float | None, unit_offset: bool):
    """A head's key halves [.., D/2] normalized (when norm_eps is set) and turned by RoPE."""
    if norm_eps is not None:
        square = jnp.sum(k1 * k1, axis=-1, keepdims=True) + jnp.sum(k2 * k2, axis=-1,
                                                                     keepdims=True)
        r = jax.lax.rsqrt(square / d + norm_eps)
        k1 = k1 * r * (1.0 + w1 if unit_offset else w1)
        k2 = k2 * r * (1.0 + w2 if unit_offset else w2)
    return k1 * c - k2 * s, k2 * c + k1 * s


def _pipelined_kernel(src_ref, dst_ref, layers_ref, x_ref, wk_ref, wv_ref, bk_ref, bv_ref,
                      norm_ref, cos_ref, sin_ref, k_any, v_any, k_out, v_out, *, heads: int,
                      d: int, norm_eps: float | None, unit_offset: bool):
    del src_ref, dst_ref, layers_ref, k_any, v_any  # read by the index maps; aliased pools
    half = d // 2
    x = x_ref[...].astype(jnp.float32)  # [1, In]
    c, s = cos_ref[...], sin_ref[...]  # [1, D/2]

    def product(w_ref, b_ref, start, width):
        w = w_ref[:, pl.ds(start, width)].astype(jnp.float32)  # [In, width]
        return jnp.dot(x, w, precision=_HI) + b_ref[:, pl.ds(start, width)]  # [1, width]

    w1, w2 = norm_ref[:, pl.ds(0, half)], norm_ref[:, pl.ds(half, half)]  # [1, D/2]
    for h in range(heads):
        k1, k2 = _norm_and_turn(product(wk_ref, bk_ref, h * d, half),
                                product(wk_ref, bk_ref, h * d + half, half), w1, w2, c, s,
                                d=d, norm_eps=norm_eps, unit_offset=unit_offset)
        k_out[pl.ds(h, 1), pl.ds(0, half)] = k1.astype(k_out.dtype)
        k_out[pl.ds(h, 1), pl.ds(half, half)] = k2.astype(k_out.dtype)
        v_out[pl.ds(h, 1), :] = product(wv_ref, bv_ref, h * d, d).astype(v_out.dtype)


# Mosaic's default scoped VMEM (16 MiB on v5e) is less than an 8B model's two layer weights
# double-buffered; every current TPU has at least 64 MiB of VMEM (v7x), 128 MiB before.
_VMEM_CAP = 60 * 2**20


def _vmem_limit(wk: jax.Array, in_dim: int, n: int) -> int:
    """Scoped VMEM for the PIPELINED call: wk and wv's layer blocks, double-buffered, and 4 MiB
    for the rest; ValueError past `_VMEM_CAP` (the weights would need tiling over In)."""
    need = 2 * 2 * in_dim * n * jnp.dtype(wk.dtype).itemsize + 4 * 2**20
    if need > _VMEM_CAP:
        raise ValueError(f"the TPU fused KV write holds a layer's wk and wv in VMEM: "
                         f"{need / 2**20:.0f} MiB for In={in_dim}, K*D={n} exceeds "
                         f"{_VMEM_CAP / 2**20:.0f} MiB")
    return max(need, 16 * 2**20)


def _pipelined(x, wk, wv, bias, norm, cos, sin, slots, k_pages, v_pages, layer, pool_layer, *,
               norm_eps, unit_offset, interpret):
    t, in_dim = x.shape
    lp, num_pages, page, heads, d = k_pages.shape
    n = heads * d
    valid = (slots >= 0) & (slots < num_pages * page)  # [T]
    first = jnp.argmax(valid).astype(jnp.int32)
    src = jnp.where(valid, jnp.arange(t, dtype=jnp.int32), first)  # [T]
    dst = slots[src].astype(jnp.int32)  # [T]
    layers = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(pool_layer, jnp.int32)])

    def row(i, src, dst, layers):
        return src[i], 0, 0

    def weights(i, src, dst, layers):
        return layers[0], 0, 0

    def whole(i, src, dst, layers):
        return 0, 0

    def out(i, src, dst, layers):
        return layers[1], dst[i] // page, dst[i] % page, 0, 0

    pool_spec = pl.BlockSpec((None, None, None, heads, d), out)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(t,),
        in_specs=[pl.BlockSpec((None, 1, in_dim), row),
                  pl.BlockSpec((None, in_dim, n), weights),
                  pl.BlockSpec((None, in_dim, n), weights),
                  pl.BlockSpec((1, n), whole), pl.BlockSpec((1, n), whole),
                  pl.BlockSpec((1, d), whole),
                  pl.BlockSpec((None, 1, d // 2), row), pl.BlockSpec((None, 1, d // 2), row),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pool_spec, pool_spec])
    call = pl.pallas_call(
        functools.partial(_pipelined_kernel, heads=heads, d=d, norm_eps=norm_eps,
                          unit_offset=unit_offset),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={11: 0, 12: 1},
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=_vmem_limit(wk, in_dim, n)),
        interpret=interpret, name="fused_kv_write")
    rows = lambda a: a.reshape(t, 1, a.shape[-1])  # noqa: E731  [T, 1, width]
    return jax.lax.cond(
        jnp.any(valid),
        lambda kp, vp: tuple(call(src, dst, layers, rows(x), wk, wv,
                                  *[b.reshape(1, n) for b in bias], norm.reshape(1, d),
                                  rows(cos), rows(sin), kp, vp)),
        lambda kp, vp: (kp, vp), k_pages, v_pages)


def _looped_kernel(slot_ref, layer_ref, x_ref, wk_ref, wv_ref, bk_ref, bv_ref, norm_ref,
                   cos_ref, sin_ref, k_in, v_in, k_out, v_out, *, page: int, num_slots: int,
                   chunk: int, norm_eps: float | None, unit_offset: bool):
    del k_in, v_in  # aliased to the outputs
    in_dim, d = wk_ref.shape
    half = d // 2
    h = pl.program_id(1)
    slot = slot_ref[0]

    def body(i, acc):
        rows = pl.ds(i * chunk, chunk)
        x = x_ref[rows].astype(jnp.float32)[:, None]  # [C, 1]
        parts = [wk_ref[rows, pl.ds(0, half)], wk_ref[rows, pl.ds(half, half)], wv_ref[rows, :]]
        return tuple(a + jnp.sum(x * w.astype(jnp.float32), axis=0)
                     for a, w in zip(acc, parts, strict=True))

    zeros = (jnp.zeros((half,), jnp.float32),) * 2 + (jnp.zeros((d,), jnp.float32),)
    k1, k2, v = jax.lax.fori_loop(0, in_dim // chunk, body, zeros)
    k1 = k1 + bk_ref[pl.ds(0, half)]
    k2 = k2 + bk_ref[pl.ds(half, half)]
    k1, k2 = _norm_and_turn(k1, k2, norm_ref[pl.ds(0, half)], norm_ref[pl.ds(half, half)],
                            cos_ref[...], sin_ref[...], d=d, norm_eps=norm_eps,
                            unit_offset=unit_offset)
    v = v + bv_ref[...]

    @pl.when((slot >= 0) & (slot < num_slots))
    def _store():
        at = (layer_ref[0], slot // page, slot % page, h)
        k_out[(*at, pl.ds(0, half))] = k1.astype(k_out.dtype)
        k_out[(*at, pl.ds(half, half))] = k2.astype(k_out.dtype)
        v_out[(*at, slice(None))] = v.astype(v_out.dtype)


def _chunk(in_dim: int) -> int:
    """The largest power of two up to 64 that divides In (Triton's tiles), at least 16."""
    for c in (64, 32, 16):
        if in_dim % c == 0:
            return c
    raise ValueError(f"the GPU (Triton) fused KV write needs In divisible by 16, got {in_dim}")


def _looped(x, wk, wv, bias, norm, cos, sin, slots, k_pages, v_pages, layer, pool_layer, *,
            norm_eps, unit_offset, interpret):
    t, in_dim = x.shape
    lp, num_pages, page, heads, d = k_pages.shape
    if d & (d - 1) or d < 32:
        raise ValueError(f"the GPU (Triton) fused KV write needs a power-of-2 head dim >= 32, "
                         f"got {d}")
    wk, wv = (jax.lax.dynamic_index_in_dim(w, jnp.asarray(layer, jnp.int32), keepdims=False)
              for w in (wk, wv))  # [In, K*D]
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, h: (0,) * a.ndim)  # noqa: E731
    per_token = lambda width: pl.BlockSpec((None, width), lambda i, h: (i, 0))  # noqa: E731
    head = lambda i, h: (0, h)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_looped_kernel, page=page, num_slots=num_pages * page,
                          chunk=_chunk(in_dim), norm_eps=norm_eps, unit_offset=unit_offset),
        grid=(t, heads),
        in_specs=[pl.BlockSpec((1,), lambda i, h: (i,)), pl.BlockSpec((1,), lambda i, h: (0,)),
                  per_token(in_dim), pl.BlockSpec((in_dim, d), head),
                  pl.BlockSpec((in_dim, d), head), pl.BlockSpec((d,), lambda i, h: (h,)),
                  pl.BlockSpec((d,), lambda i, h: (h,)), whole(norm), per_token(d // 2),
                  per_token(d // 2), whole(k_pages), whole(v_pages)],
        out_specs=[whole(k_pages), whole(v_pages)],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={10: 0, 11: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="fused_kv_write_looped",
    )(slots.astype(jnp.int32), jnp.asarray(pool_layer, jnp.int32).reshape(1), x, wk, wv,
      *bias, norm, cos, sin, k_pages, v_pages)


def fused_kv_write(x: jax.Array, wk: jax.Array, wv: jax.Array, cos: jax.Array,
                   sin: jax.Array, slots: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                   *, layer: jax.Array | int = 0, pool_layer: jax.Array | int = 0,
                   bk: jax.Array | None = None, bv: jax.Array | None = None,
                   k_norm: jax.Array | None = None, norm_eps: float = 1e-6,
                   norm_unit_offset: bool = False, interpret: bool = False,
                   schedule: Schedule | None = None) -> tuple[jax.Array, jax.Array]:
    """`fused_kv_write_reference`'s result by the kernel (same arguments); `schedule`: None,
    the target's (`default_schedule`)."""
    n = wk.shape[-1]
    d = k_pages.shape[-1]
    f32 = jnp.float32
    zeros = jnp.zeros((n,), f32)
    bias = [(zeros if b is None else b).reshape(n).astype(f32) for b in (bk, bv)]
    norm = (jnp.zeros((d,), f32) if k_norm is None else k_norm).reshape(d).astype(f32)
    run = _looped if (schedule or default_schedule()) is Schedule.LOOPED else _pipelined
    return run(x, wk, wv, bias, norm, cos.astype(f32), sin.astype(f32), slots, k_pages, v_pages,
               layer, pool_layer, norm_eps=None if k_norm is None else float(norm_eps),
               unit_offset=norm_unit_offset, interpret=interpret)
