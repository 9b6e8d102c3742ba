"""Sparse page-subset decode attention: each row reads only the pages a selection chose.

Same leading arguments as `reference.sparse_decode_attention_reference`: q [B, N, D], k_pages /
v_pages [num_pages, P, K, D], block_tables [B, W] int32, kv_lens [B] int32, and page_indices
[B, R] int32: for each row, R indices into its block table, in the form
`kvjax.kv.quest.select_pages` returns them: an entry is live when it is below the row's page
count ceil(kv_lens / P), live entries come first, and the rest is padding. A live entry j
stands for table page block_tables[b, page_indices[b, j]] with its tokens at their original
positions (page_indices[b, j] * P + offset), visible while below kv_lens[b]. The query attends
to the tokens of the live pages only.

Unlike narrowing the block table and then running the dense decode kernel (what the engine's
Quest step does in jnp), the kernel takes the selection itself: no [B, W] table is rebuilt per
layer, and each program reads min(ceil(kv_lens / P), R) pages. Rows with fewer pages than R
read all of them.

Schedules (`paged_decode.Schedule`, default per backend): LOOPED (GPU, Pallas Triton), grid
(B, K, splits); a compute block is `pages_per_compute_block` consecutive selection entries,
gathered with two indexed loads (entries -> table indices -> pages). PIPELINED (TPU, Mosaic):
`paged_decode`'s scalar-prefetch pipeline, grid (B, splits, blocks), each page's index map
reading entry, table index and page from SMEM. Split-K cuts a row's live entries into
contiguous ranges in both. Interpret mode runs either on any backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_decode.kernel import (
    Schedule,
    check_paged_args,
    check_triton_block,
    decode_blocking,
    default_schedule,
    finish_decode,
    fold_split,
    grouped_queries,
    looped_decode_call,
    max_block_tokens,
    online_softmax_step,
    padded_group,
    pages_head_fold,
    pipelined_decode_call,
    split_block_range,
)


def _sparse_decode_kernel(sel_ref, bt_ref, len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                          num_entries: int, pages_per_block: int, page_size: int,
                          num_splits: int, sm_scale: float, soft_cap: float | None):
    """One (row, kv head, split) program: fold the split's blocks of selected pages."""
    block_tokens = pages_per_block * page_size
    kv_len = len_ref[0]
    width = bt_ref.shape[0]
    num_live = jnp.minimum((kv_len + page_size - 1) // page_size, num_entries)
    # Blocks of selection entries: the dense helper over num_live "tokens" of block size ppb.
    lo, hi = split_block_range(num_live, pl.program_id(2), block_tokens=pages_per_block,
                               num_splits=num_splits, sliding_window=None)
    q = q_ref[...]  # [G, D]
    rows, d = q.shape

    def fold(block, carry):
        entry = block * pages_per_block + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
        index = jnp.clip(sel_ref[pl.ds(block * pages_per_block, pages_per_block)], 0,
                         width - 1)  # [pages] table indices
        page_ids = bt_ref[index]  # [pages]
        k = k_ref[page_ids].reshape(block_tokens, d)  # [S_blk, D]
        v = v_ref[page_ids].reshape(block_tokens, d)
        offset = lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 1)
        pos = index[:, None] * page_size + offset  # [pages, P] original positions
        live = (pos < kv_len) & (entry < num_live)[:, None]
        live = live.reshape(1, block_tokens)  # [1, S_blk]
        v = jnp.where(live.reshape(block_tokens, 1), v, jnp.zeros_like(v))
        return online_softmax_step(q, k, v, live, carry, sm_scale=sm_scale, soft_cap=soft_cap)

    fold_split(o_ref, m_ref, l_ref, lo=lo, hi=hi, fold=fold, rows=rows, widths=(d,))



def _pipelined_sparse(q, k_pages, v_pages, block_tables, kv_lens, page_indices, *,
                      num_entries: int, pages_per_block: int, num_splits: int, sm_scale: float,
                      soft_cap: float | None, interpret: bool):
    """Partials [B, splits, K, G, D] (and max, sum [B, splits, K, G, 1]) on the TPU schedule.

    The selection (page_indices [B, R], padded to whole blocks) and the block table are
    flattened into SMEM; each page of a block is DMA'd through both (entry -> table index ->
    page). Token positions are built per page from the entries' table indices with selects on
    a lane (logits) and a sublane (values) iota, the layouts Mosaic keeps without relayouts.
    """
    p = k_pages.shape[1]
    width, padded_entries = block_tables.shape[1], page_indices.shape[1]
    block_tokens = pages_per_block * p

    def num_live(row, lens_ref):
        return jnp.minimum((lens_ref[row] + p - 1) // p, num_entries)

    def table_index(row, entry, sel_ref):
        return jnp.clip(sel_ref[row * padded_entries + entry], 0, width - 1)

    def block_range(row, split, sel_ref, bt_ref, lens_ref):
        return split_block_range(num_live(row, lens_ref), split, block_tokens=pages_per_block,
                                 num_splits=num_splits, sliding_window=None)

    def page_of(row, block, i, sel_ref, bt_ref, lens_ref):
        # Past the row's last live entry, repeat it: the pipeline does not fetch it again.
        entry = jnp.minimum(block * pages_per_block + i,
                            jnp.maximum(num_live(row, lens_ref) - 1, 0))
        return bt_ref[row * width + table_index(row, entry, sel_ref)]

    def positions(row, block, sel_ref, lens_ref, shape, axis):
        """Original positions of the block's slots (kv_len where the entry is not live)."""
        slot = lax.broadcasted_iota(jnp.int32, shape, axis)
        kv_len = lens_ref[row]
        pos = jnp.full(shape, kv_len, jnp.int32)
        for i in range(pages_per_block):
            entry = block * pages_per_block + i
            start = jnp.where(entry < num_live(row, lens_ref),
                              table_index(row, entry, sel_ref) * p - i * p, kv_len)
            pos = jnp.where((slot >= i * p) & (slot < (i + 1) * p), start + slot, pos)
        return pos

    def fold_block(row, block, scalar_refs, blocks):
        sel_ref, _, lens_ref = scalar_refs
        kv_len = lens_ref[row]
        live = positions(row, block, sel_ref, lens_ref, (1, block_tokens), 1) < kv_len
        live_col = positions(row, block, sel_ref, lens_ref, (block_tokens, 1), 0) < kv_len
        return pages_head_fold(*blocks, live, live_col, sm_scale=sm_scale, soft_cap=soft_cap)

    scalars = [page_indices.astype(jnp.int32).reshape(-1), block_tables.reshape(-1),
               kv_lens.astype(jnp.int32)]
    return pipelined_decode_call(
        fold_block, scalars=scalars, queries=[q], pools=[k_pages, v_pages],
        block_range=block_range, page_of=page_of, pages_per_block=pages_per_block,
        widths=(q.shape[2],), num_splits=num_splits,
        steps=pl.cdiv(padded_entries // pages_per_block, num_splits), interpret=interpret,
        name="sparse_decode_pipelined")


def sparse_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    schedule: Schedule | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention over the selected pages of each row (see the module docstring).

    Args:
      q: [B, N, D].
      k_pages, v_pages: [num_pages, P, K, D].
      block_tables: [B, W] int32.
      kv_lens: [B] int32; 0 marks a padded row (its output is zeros).
      page_indices: [B, R] int32 indices into each row's block table, live entries first.
      sm_scale, soft_cap: as `paged_decode.paged_decode_attention`.
      pages_per_compute_block: selected pages folded per online-softmax step.
      num_splits: split-K partitions of each row's live entries (default per backend).
      schedule: PIPELINED (TPU) or LOOPED (GPU); default per backend.
      interpret: run through the Pallas interpreter (any backend, CPU included).
    Returns:
      [B, N, D] in q's dtype.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [B, N, D], got shape {q.shape}")
    check_paged_args(q, k_pages, v_pages, block_tables, kv_lens, soft_cap=soft_cap,
                     sliding_window=None, pages_per_compute_block=pages_per_compute_block)
    if (page_indices.ndim != 2 or page_indices.shape[0] != q.shape[0]
            or not jnp.issubdtype(page_indices.dtype, jnp.integer)):
        raise ValueError(f"page_indices {page_indices.shape} ({page_indices.dtype}) must be "
                         f"integer [B={q.shape[0]}, R]")
    b, n, d = q.shape
    p, k_heads = k_pages.shape[1:3]
    num_entries = page_indices.shape[1]  # R, before padding to whole compute blocks
    schedule = default_schedule() if schedule is None else schedule
    pipelined_schedule = schedule is Schedule.PIPELINED
    gp = n // k_heads if pipelined_schedule else padded_group(n // k_heads, interpret)
    page_indices, pages_per_block, num_splits = decode_blocking(
        page_indices, batch=b, num_kv_heads=k_heads, page_size=p,
        pages_per_compute_block=pages_per_compute_block, num_splits=num_splits,
        max_block_tokens=max_block_tokens(rows=gp, head_dim=d, dtype=q.dtype,
                                          interpret=interpret or pipelined_schedule))
    sm_scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    if pipelined_schedule:
        partials = _pipelined_sparse(
            q, k_pages, v_pages, block_tables.astype(jnp.int32), kv_lens, page_indices,
            num_entries=num_entries, pages_per_block=pages_per_block, num_splits=num_splits,
            sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret)
        return finish_decode(*partials, q=q, num_kv_heads=k_heads)
    if not interpret:
        check_triton_block(rows=gp, head_dim=d, pages_per_block=pages_per_block, page_size=p)
    kernel = functools.partial(
        _sparse_decode_kernel, num_entries=num_entries, pages_per_block=pages_per_block,
        page_size=p, num_splits=num_splits, sm_scale=sm_scale, soft_cap=soft_cap)
    partials = looped_decode_call(
        kernel, tables=[page_indices, block_tables.astype(jnp.int32)], kv_lens=kv_lens,
        queries=[grouped_queries(q, k_heads, gp)], pools=[k_pages, v_pages], out_dim=d,
        num_splits=num_splits, interpret=interpret, name="sparse_decode")
    return finish_decode(*partials, q=q, num_kv_heads=k_heads)
