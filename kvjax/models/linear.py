"""x @ w[layer] over the stacked layer weights: XLA's matmul, or a native CPU kernel.

The decoder's matrices are stacked over layers ([L, In, Out], `kvjax.models.llama`) and its
layer loop is one scan. XLA copies each layer's slice before its matmul, and its matmul of a
few rows packs the weights once more, so a decode step on the CPU moved about twice the bytes
of the weights. `native_linear` (`linear.cc`, built and registered by `kvjax.cpu_kernels`)
reads the layer's rows in place, once; it pays off for few rows (decode steps), while XLA's
packed matmul wins for long float32 prefill chunks (`NATIVE_MAX_TOKENS`). It multiplies float32, and
bfloat16 as `matmul` does (float32 sums, the result rounded to bfloat16): on AVX-512 BF16 by
`vdpbf16ps` on pairs of bfloat16 lanes, elsewhere by widening to float32.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cpu_kernels

_SOURCE = pathlib.Path(__file__).with_name("linear.cc")
_TARGET = "kvjax_linear"
_KV_WRITE_TARGET = "kvjax_linear_kv_write"
# Steps of at most this many tokens use the native kernel under AUTO, per parameter dtype. In
# float32, XLA's packed matmul wins beyond 512 tokens (the matmuls alone: 1.08x at 1024, 1.39x
# at 2048; at 512 they are 1.19x, but the native step also fuses the KV write, and a server with
# this limit served more than with 128); the kernel's own packed product from 1024 rows still
# takes 1.1-1.2x XLA's time there (docs/benchmarks.md "The float32 packed matmul"). In
# bfloat16 the kernel's pair products beat XLA's widened dots at every size measured (0.98 of
# XLA's time at 2048), so it has no limit (docs/benchmarks.md "Serving settings by
# measurement; the native matmul at prefill sizes").
NATIVE_MAX_TOKENS = {jnp.dtype(jnp.float32): 512, jnp.dtype(jnp.bfloat16): None}


class LayerLinear(Protocol):
    """x [T, In] times layer `layer` (a scalar, traced or not) of stacked w [L, In, Out], or
    of its transpose where w is [L, Out, In] and `transpose` is set; summed in float32 and
    returned in `out_dtype` (None: x's)."""

    def __call__(self, x: jax.Array, w: jax.Array, layer: jax.Array, transpose: bool = False,
                 out_dtype: jnp.dtype | None = None) -> jax.Array: ...


def unavailable_reason() -> str | None:
    """None when the kernel is built and registered (building it on first call), else why not."""
    return cpu_kernels.register(_TARGET, _SOURCE, "KvjaxLinear")


def takes_step(num_tokens: int, dtype) -> bool:
    """Whether AUTO multiplies a step of `num_tokens` tokens of `dtype` parameters natively
    (the kernel built and registered, the dtype one it takes, within `NATIVE_MAX_TOKENS`)."""
    dtype = jnp.dtype(dtype)
    if dtype not in NATIVE_MAX_TOKENS or unavailable_reason() is not None:
        return False
    limit = NATIVE_MAX_TOKENS[dtype]
    return limit is None or num_tokens <= limit


def target_for(isa: cpu_kernels.Isa) -> str:
    """Registers `linear.cc` built for `isa` as an FFI target of its own (the AVX2 and generic
    branches on a CPU whose native build takes the AVX-512 ones); returns its name for
    `call_kernel`.

    Raises:
      ValueError: that build is unavailable on this machine.
    """
    if isa is cpu_kernels.Isa.NATIVE:
        target = _TARGET
    else:
        target = f"{_TARGET}_{isa.name.lower()}"
    reason = cpu_kernels.register(target, _SOURCE, "KvjaxLinear", isa)
    if reason is not None:
        raise ValueError(reason)
    return target


def matmul(x: jax.Array, w: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x [T, In] @ w [In, Out] by XLA, accumulated in float32 and returned in `out_dtype`
    (None: x's).

    XLA's own CPU dot emitter multiplies no bfloat16 into a bfloat16 result (YNNPACK, which
    takes the larger dots, does); a float32 accumulator is what bfloat16 weights want anyway.
    """
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)


def xla_linear(x: jax.Array, w: jax.Array, layer: jax.Array, transpose: bool = False,
               out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x @ w[layer] (x @ w[layer].T with `transpose`) by XLA (the slice is a dynamic slice),
    accumulated in float32 (`matmul`)."""
    return matmul(x, w[layer].T if transpose else w[layer], out_dtype)


NATIVE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # the kernel's x and w


def native_linear(x: jax.Array, w: jax.Array, layer: jax.Array, transpose: bool = False,
                  out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x @ w[layer] (x @ w[layer].T with `transpose`) reading the layer in place, summed in
    float32 and returned in `out_dtype` (None: x's), as `xla_linear`.

    x and w both float32 or both bfloat16 (`NATIVE_DTYPES`); other dtypes go to `xla_linear`.

    Raises:
      ValueError: the kernel is unavailable on this machine.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(reason)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if x.dtype != w.dtype or x.dtype not in NATIVE_DTYPES or x.ndim != 2 or w.ndim != 3 \
            or out_dtype not in (x.dtype, jnp.float32):
        return xla_linear(x, w, layer, transpose, out_dtype)
    return call_kernel(_TARGET, x, w, layer, transpose, out_dtype=out_dtype)


def call_kernel(target: str, x: jax.Array, w: jax.Array, layer: jax.Array,
                transpose: bool = False, *, invariant: bool = False,
                out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x @ w[layer] by the FFI target `target`, a registered build of `linear.cc`: x [T, In]
    and w [L, In, Out] (or [L, Out, In] with `transpose`) both float32, or both bfloat16.
    The result is in `out_dtype` (default x's; float32 for bfloat16 operands keeps the
    float32 sums unrounded). `invariant`: each row's result is the same whatever the other
    rows (`invariant_linear`; float32 only)."""
    out = w.shape[1] if transpose else w.shape[2]
    out_type = jax.ShapeDtypeStruct((x.shape[0], out), out_dtype or x.dtype)
    return jax.ffi.ffi_call(target, out_type)(
        x, w, jnp.asarray(layer, jnp.int32), transpose=transpose, invariant=invariant)


def kv_write_unavailable_reason() -> str | None:
    """None when the fused KV write kernel (`linear_kv_write`) is built and registered, else
    why not."""
    return cpu_kernels.register(_KV_WRITE_TARGET, _SOURCE, "KvjaxLinearKVWrite")


def linear_kv_write(x: jax.Array, wk: jax.Array, wv: jax.Array, layer: jax.Array,
                    bk: jax.Array | None, bv: jax.Array | None, cos: jax.Array, sin: jax.Array,
                    slots: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    pool_layer: jax.Array, *, invariant: bool = False,
                    k_norm: jax.Array | None = None, norm_eps: float = 1e-6,
                    norm_unit_offset: bool = False) -> tuple[jax.Array, jax.Array]:
    """K = RoPE(norm(x @ wk[layer] + bk)) and V = x @ wv[layer] + bv written by the projection
    itself into flat slots of layer `pool_layer` of the pages (the native kernel; the pages
    are aliased to its outputs, so with the pools donated XLA updates them in place).

    Args:
      x: [T, In] float32; wk, wv: [L, In, K*D] float32; layer: int32 scalar.
      bk, bv: [K*D] float32, the layer's biases, or None: none.
      cos, sin: [T, D/2] float32, RoPE's tables at each token's position (`RoPE.tables`).
      slots: [T] int32 flat slots (page * P + offset; -1: not written).
      k_pages, v_pages: [Lp, num_pages, P, K, D] float32; pool_layer: int32 scalar.
      invariant: the products in `invariant_linear`'s fixed order.
      k_norm: [D] float32, the keys' per-head RMSNorm weight (qk_norm; epsilon `norm_eps`,
        scaling by 1 + w with `norm_unit_offset`), or None: no norm. Not with `invariant`.
    Returns:
      (k_pages, v_pages) with the rows written.

    Raises:
      ValueError: the kernel is unavailable on this machine.
    """
    reason = kv_write_unavailable_reason()
    if reason is None and k_norm is not None and invariant:
        reason = "linear_kv_write: the invariant order normalizes no keys"
    if reason is not None:
        raise ValueError(reason)
    has_bias = bk is not None
    empty = jnp.zeros((0,), jnp.float32)
    return jax.ffi.ffi_call(
        _KV_WRITE_TARGET,
        (jax.ShapeDtypeStruct(k_pages.shape, jnp.float32),
         jax.ShapeDtypeStruct(v_pages.shape, jnp.float32)),
        input_output_aliases={10: 0, 11: 1})(
        x, wk, wv, bk if has_bias else empty, bv if has_bias else empty,
        jnp.asarray(layer, jnp.int32), cos, sin, slots, jnp.asarray(pool_layer, jnp.int32),
        k_pages, v_pages, empty if k_norm is None else k_norm.astype(jnp.float32),
        has_bias=has_bias, invariant=invariant, has_norm=k_norm is not None,
        norm_eps=np.float32(norm_eps), unit_offset=norm_unit_offset)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def invariant_linear(x: jax.Array, w: jax.Array, layer: jax.Array, transpose: bool = False,
                     out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x @ w[layer] (x @ w[layer].T with `transpose`) whose every row is bitwise the same
    whatever the other rows of x: the native kernel with its sums in an order fixed by In
    alone (batch-invariant numerics; float32 only).

    Differentiable: the backward pass is XLA's (gradients need no fixed order).

    Raises:
      ValueError: the kernel is unavailable on this machine, or x, w or out_dtype is not
        float32.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(reason)
    if x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.ndim != 2 or w.ndim != 3 \
            or jnp.dtype(out_dtype or x.dtype) != jnp.float32:
        raise ValueError(f"invariant_linear multiplies float32 x [T, In] by w [L, In, Out], "
                         f"got {x.dtype} {x.shape} and {w.dtype} {w.shape} into {out_dtype}")
    return call_kernel(_TARGET, x, w, layer, transpose, invariant=True)


def _invariant_fwd(x, w, layer, transpose, out_dtype):
    return invariant_linear(x, w, layer, transpose, out_dtype), (x, w, layer)


def _invariant_bwd(transpose, out_dtype, residuals, grad):
    del out_dtype  # float32, as x
    x, w, layer = residuals
    _, pullback = jax.vjp(lambda x, w: xla_linear(x, w, layer, transpose), x, w)
    grad_x, grad_w = pullback(grad)
    return grad_x, grad_w, np.zeros(np.shape(layer), jax.dtypes.float0)


invariant_linear.defvjp(_invariant_fwd, _invariant_bwd)
