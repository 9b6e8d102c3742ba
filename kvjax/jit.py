"""`jax.jit` with the XLA options every kvjax program compiles with.

On the CPU backend, XLA's `float-normalization-bf16` pass rewrites each bfloat16 operation
it does not list as native (dynamic slices, gathers, scatters, dynamic-update-slices,
elementwise ops) into float32: converts around the operation. Loop-invariant code motion then
hoists the convert of a loop-invariant operand out of the layer scan, so a bfloat16 step
converts every stacked weight matrix ([L, In, Out]), the embedding ([V, H]) and the whole KV
page pool ([L, num_pages, P, K, D], and back) to float32 on every call: a decode step of the
embedded model took 40x its float32 time and the pool's float32 copies multiplied the
memory. The CPU emitters compile those operations in bfloat16 directly (the arithmetic that
needs range, RMSNorm, softmax and the dots' accumulation, is float32 in the model code: dots
take `preferred_element_type=float32`), so kvjax programs skip the pass on the CPU. Float32
programs are unchanged (the pass touches only bfloat16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# Disabled on the CPU backend only: GPU and TPU compilers rely on their normalization passes.
CPU_DISABLED_PASSES = ("float-normalization-bf16",)
# In bfloat16 programs YNNPACK takes dot fusions only: its standalone ("individual") dots,
# which it also takes by default, gave wrong bfloat16 results once the pass above is off (a
# 37-token chat prompt of the embedded model decoded to other tokens than float32 and the
# dense forward pass); fused dots agree. Float32 programs keep XLA's default.
CPU_BF16_YNN_FUSION_TYPE = "LIBRARY_FUSION_TYPE_DOT"


def compiler_options(backend: str | None = None, *, dtype=None) -> dict[str, str] | None:
    """The XLA options of kvjax programs on `backend` (None: the default backend) whose model
    computes in `dtype` (None: programs without matmuls)."""
    if (backend or jax.default_backend()) != "cpu":
        return None
    options = {"xla_disable_hlo_passes": ",".join(CPU_DISABLED_PASSES)}
    if dtype is not None and jnp.dtype(dtype) == jnp.bfloat16:
        options["xla_cpu_experimental_ynn_fusion_type"] = CPU_BF16_YNN_FUSION_TYPE
    return options


def jit(fun: Callable, *, dtype=None, **kwargs: Any) -> Any:
    """`jax.jit(fun, **kwargs)` compiled with `compiler_options(dtype=dtype)`."""
    return jax.jit(fun, compiler_options=compiler_options(dtype=dtype), **kwargs)
