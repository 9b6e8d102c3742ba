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

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


def jit(fun: Callable, *, dtype=None, **kwargs: Any) -> Program:
    """`jax.jit(fun, **kwargs)` compiled with `compiler_options(dtype=dtype)`, as a `Program`
    that counts its own compiles."""
    return Program(fun, compiler_options=compiler_options(dtype=dtype), **kwargs)


class Program:
    """A jitted function that owns its compiled programs and counts them.

    `jax.jit` keys its caches by the Python function, so two jits of one module-level function
    share entries, and jax keeps them in one process-wide LRU: a count read from those caches
    moves when another engine compiles the same function or when an entry is evicted. A
    Program jits a closure of its own and records the signature (static arguments; the pytree
    structure, shape, dtype, weak type, sharding and committedness of the others) of each call
    that compiled; `num_compiles` is how many distinct signatures it has compiled, whatever
    other programs or evictions do.

    Args:
      fun: the function to compile.
      compiler_options: XLA options (`compiler_options()`), or None.
      **jit_kwargs: passed to `jax.jit` (static_argnums, static_argnames, donate_argnums,
        out_shardings, ...).
    """

    def __init__(self, fun: Callable, *, compiler_options: dict[str, str] | None = None,
                 **jit_kwargs: Any):
        self.__wrapped__ = fun
        self._signatures: set = set()
        self._traced = False
        static_names = _as_tuple(jit_kwargs.get("static_argnames"))
        self._static_positions = set(_as_tuple(jit_kwargs.get("static_argnums")))
        self._static_names = set(static_names)
        try:
            params = list(inspect.signature(fun).parameters)
        except (TypeError, ValueError):
            params = []
        self._static_positions |= {i for i, name in enumerate(params) if name in static_names}
        self._static_names |= {params[i] for i in self._static_positions if i < len(params)}

        @functools.wraps(fun)
        def traced(*args, **kwargs):
            self._traced = True  # Runs only while jax traces: a new program.
            return fun(*args, **kwargs)

        self._jitted = jax.jit(traced, compiler_options=compiler_options, **jit_kwargs)

    @property
    def num_compiles(self) -> int:
        """Distinct programs this Program has compiled."""
        return len(self._signatures)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        before, self._traced = self._jitted._cache_size(), False
        out = self._jitted(*args, **kwargs)
        if self._traced or self._jitted._cache_size() > before:
            self._signatures.add(self._signature(args, kwargs))
        return out

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.lower(*args, **kwargs)

    def _signature(self, args: tuple, kwargs: dict) -> tuple:
        positional = tuple(a if i in self._static_positions else _abstract(a)
                           for i, a in enumerate(args))
        named = tuple(sorted((k, v if k in self._static_names else _abstract(v))
                             for k, v in kwargs.items()))
        return positional, named


def _as_tuple(x: Any) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _abstract(tree: Any) -> tuple:
    """What jit compiles one program per: the tree's structure and its leaves' types."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(_abstract_leaf(x) for x in leaves)


def _abstract_leaf(x: Any) -> Any:
    if isinstance(x, jax.core.Tracer):  # Called inside another trace: inlined there.
        return x.aval
    if isinstance(x, jax.Array):
        return x.shape, x.dtype, x.weak_type, x.sharding, x.committed
    if isinstance(x, (np.ndarray, np.generic)):
        return x.shape, x.dtype
    if isinstance(x, (bool, int, float, complex)):
        return type(x)
    return x
