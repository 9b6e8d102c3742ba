"""The token layout of a step, as the KV states and attention read it.

A step's T tokens are its decode rows' tokens, Wd per row (`StepShape.decode_width`: 1, or
1 + gamma in a speculative verify step: row r's tokens at [r * Wd, r * Wd + q_lens[r])), then
its prefill tokens packed one row after another with no padding between rows, then padding:

  tokens[0 : Bd * Wd]            decode rows 0 .. Bd-1
  tokens[Bd * Wd : ... + C]      prefill rows Bd .. Bd+Bp-1, row r's q_lens[r] tokens from
                                 row_starts[r], back to back; padding after the last row

so T = Bd * Wd + C with C the step's prefill-token bucket (`StepShape.chunk`). Attention and the
KIVI writes work on a padded per-row view of the prefill tokens, [Bp, Cr] with Cr the most
tokens one prefill row has (`StepShape.row_chunk`); `prefill_view` gathers it and
`unpack_prefill` gathers the packed tokens back. With one prefill row the view is a reshape.

The step input carries the layout as `row_starts` [R] (the index of each row's first token)
and `token_rows` [T] (each token's row; a padding token's offset in its row is >= the row's
q_len, so it counts as padding wherever rows are read).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def num_decode_tokens(shape: Any) -> int:
    """Bd * Wd: the index of a step's first prefill token."""
    return shape.num_decode * shape.decode_width


def row_chunk(shape: Any) -> int:
    """Cr: the width of the per-row view of a step's prefill tokens."""
    return shape.row_chunk or shape.chunk


def prefill_view(x: jax.Array, inp: Any, shape: Any) -> jax.Array:
    """x [T, ...] -> [Bp, Cr, ...]: prefill row b's tokens at [b, :q_len], padding after."""
    bd, bp, c = shape.num_decode, shape.num_prefill, shape.chunk
    first, cr = num_decode_tokens(shape), row_chunk(shape)
    if bp == 1:
        return x[first:first + cr][None]
    index = inp.row_starts[bd:, None] + jnp.arange(cr, dtype=jnp.int32)  # [Bp, Cr]
    return x[jnp.minimum(index, first + c - 1)]


def unpack_prefill(view: jax.Array, inp: Any, shape: Any) -> jax.Array:
    """[Bp, Cr, ...] -> [C, ...]: the packed prefill tokens (`prefill_view`'s inverse)."""
    bd, bp, c = shape.num_decode, shape.num_prefill, shape.chunk
    if bp == 1:
        return view[0]
    t = num_decode_tokens(shape) + jnp.arange(c, dtype=jnp.int32)  # [C]
    rows = inp.token_rows[t]
    offset = jnp.clip(t - inp.row_starts[rows], 0, row_chunk(shape) - 1)
    return view[jnp.clip(rows - bd, 0, bp - 1), offset]
