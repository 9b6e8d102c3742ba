"""The attention functions the engine's step calls when `attention_impl` is PALLAS.

`attention_fns()` returns (decode_fn, prefill_fn) with exactly the signatures of
`kvjax.kv.attention.paged_decode_attention_reference` and `paged_prefill_attention_reference`.
Each kernel runs compiled on GPU (Triton schedule) and TPU (Mosaic schedule); on a CPU backend it
runs through the Pallas interpreter, which is slow but computes the same values, so
`attention_impl=pallas` works everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from pallas_kernels.paged_decode.kernel import paged_decode_attention
from pallas_kernels.ragged_prefill.kernel import ragged_prefill_attention


def attention_fns() -> tuple[Callable[..., jax.Array], Callable[..., jax.Array]]:
    """(decode_fn, prefill_fn) for the default backend, interpreted when it is the CPU."""
    interpret = jax.default_backend() == "cpu"

    def decode_fn(
        q: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        block_tables: jax.Array,
        kv_lens: jax.Array,
        *,
        sm_scale: float | None = None,
        soft_cap: float | None = None,
        sliding_window: int | None = None,
    ) -> jax.Array:
        """q [B, N, D], pages [num_pages, P, K, D], block_tables [B, Pmax] -> [B, N, D]."""
        return paged_decode_attention(
            q, k_pages, v_pages, block_tables, kv_lens, sm_scale=sm_scale, soft_cap=soft_cap,
            sliding_window=sliding_window, interpret=interpret)

    def prefill_fn(
        q: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        block_tables: jax.Array,
        kv_lens: jax.Array,
        q_lens: jax.Array,
        *,
        sm_scale: float | None = None,
        soft_cap: float | None = None,
        sliding_window: int | None = None,
    ) -> jax.Array:
        """q [B, C, N, D], pages [num_pages, P, K, D], block_tables [B, Pmax] -> [B, C, N, D]."""
        return ragged_prefill_attention(
            q, k_pages, v_pages, block_tables, kv_lens, q_lens, sm_scale=sm_scale,
            soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret)

    return decode_fn, prefill_fn
