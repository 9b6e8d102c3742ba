"""Chunked (ragged) prefill attention as a Pallas kernel: a padded chunk of queries per sequence.

Same leading arguments as `reference.paged_prefill_attention_reference`: q [B, C, N, D], k_pages /
v_pages [num_pages, P, K, D], block_tables [B, Pmax] int32, kv_lens [B] int32, q_lens [B] int32.
Row b's queries are the last q_lens[b] tokens of its sequence (query c sits at position
kv_lens[b] - q_lens[b] + c), attend causally to every earlier token, and queries c >= q_lens[b]
are padding whose output is zeros.

The chunk is cut into query blocks of `block_q` tokens; a (row, query block) pair folds, with an
online softmax, only the compute blocks of pages its queries can see: from the sliding window's
start (or token 0) to its last query's position. A query block made only of padding reads no page.
The window is a Python int or a traced int32 scalar (<= 0: none), which reaches the kernel as a
per-row input [B] beside the lengths (`paged_decode.window_rows`).
GQA: the G query heads of one kv head and the block_q queries form the rows of one matmul.

The two schedules mirror paged_decode (see pallas_kernels/README.md):

  * `Schedule.PIPELINED` (TPU, Mosaic): grid (B, query blocks, kv blocks), the last axis
    sequential, page numbers from the scalar-prefetched block table in the index maps, and the
    queries laid out [B, K, G, C, D] so each kv head's rows are one contiguous [G * block_q, D].
  * `Schedule.LOOPED` (GPU, Triton): grid (B, K, query blocks), a fori_loop over kv blocks that
    gathers each block's pages through the block table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from kvjax.shapes import next_power_of_2
from pallas_kernels import targets
from pallas_kernels.paged_decode.kernel import (
    DEFAULT_BLOCK_TOKENS,
    MASK_VALUE,
    MIN_TRITON_ROWS,
    TRITON_STAGES,
    Schedule,
    check_paged_args,
    check_triton_block,
    default_pages_per_compute_block,
    default_schedule,
    gpu_block_tokens,
    online_softmax_step,
    pad_block_tables,
    pop_window,
    token_column_mask,
    window_rows,
)

# Queries per block when block_q is not given (fewer if the chunk is shorter).
_DEFAULT_BLOCK_Q = 64
# Most query rows (block_q * padded group) of one GPU program, and its warps: the logits tile
# [rows, S_blk] float32 is spread over the warps' registers.
_MAX_GPU_ROWS = 128
_GPU_PREFILL_WARPS = 8


def _gpu_group(group: int, block_q: int) -> int:
    """Query heads per kv head in a compiled GPU program: a power of two, padded so a short
    query block still gives Triton's dot its 16 rows."""
    return max(next_power_of_2(group), MIN_TRITON_ROWS // block_q)


def _query_block_range(kv_len: jax.Array, q_len: jax.Array, q_block: jax.Array, *,
                       block_q: int, block_tokens: int,
                       sliding_window: jax.Array | int | None) -> tuple[jax.Array, jax.Array]:
    """Compute blocks [lo, hi) that the queries of `q_block` see; empty for a padding block."""
    start = kv_len - q_len  # Position of query 0.
    first_q = q_block * block_q
    last_q = jnp.minimum(first_q + block_q, q_len) - 1
    first_token = (0 if sliding_window is None else jnp.where(
        sliding_window > 0, jnp.maximum(start + first_q - sliding_window + 1, 0), 0))
    lo = first_token // block_tokens
    hi = (start + last_q + block_tokens) // block_tokens  # ceil((start + last_q + 1) / tokens)
    return lo, jnp.where(first_q < q_len, hi, lo)


def _prefill_visible(query: jax.Array, pos: jax.Array, kv_len: jax.Array, q_len: jax.Array,
                     sliding_window: jax.Array | int | None) -> jax.Array:
    """Which keys at `pos` the chunk queries with indices `query` see (broadcasting)."""
    q_pos = kv_len - q_len + query
    visible = (query < q_len) & (pos <= q_pos)
    if sliding_window is not None:
        visible &= (sliding_window <= 0) | (pos > q_pos - sliding_window)
    return visible


def _pipelined_prefill_kernel(bt_ref, lens_ref, qlens_ref, *refs, pages_per_block: int,
                              page_size: int, block_q: int, sm_scale: float,
                              soft_cap: float | None, windowed: bool):
    """One (row, query block, kv step) grid point: fold a block of pages for all K kv heads."""
    b, q_block, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    sliding_window, refs = pop_window(refs, windowed, b)
    q_ref, *refs = refs
    k_refs, v_refs = refs[:pages_per_block], refs[pages_per_block:2 * pages_per_block]
    o_ref, m_sc, l_sc, acc_sc = refs[2 * pages_per_block:]
    block_tokens = pages_per_block * page_size
    kv_len, q_len = lens_ref[b], qlens_ref[b]
    lo, hi = _query_block_range(kv_len, q_len, q_block, block_q=block_q,
                                block_tokens=block_tokens, sliding_window=sliding_window)
    block = lo + step
    num_kv_heads, group = q_ref.shape[:2]
    d = q_ref.shape[-1]

    @pl.when(step == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(block < hi)
    def _fold():
        k = jnp.concatenate([r[...] for r in k_refs], axis=0)  # [S_blk, K, D]
        v = jnp.concatenate([r[...] for r in v_refs], axis=0)
        pos = block * block_tokens + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        in_seq_col = token_column_mask(block, block_tokens, kv_len)  # [S_blk, 1]
        query = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        visible = _prefill_visible(query, pos, kv_len, q_len, sliding_window)  # [bq, S_blk]
        visible = jnp.broadcast_to(visible[None], (group, block_q, block_tokens))
        visible = visible.reshape(group * block_q, block_tokens)  # [G*bq, S_blk], g-major rows
        for h in range(num_kv_heads):
            q = q_ref[h].reshape(group * block_q, d)  # [G*bq, D]
            carry = (m_sc[h], l_sc[h], acc_sc[h])
            v_h = jnp.where(in_seq_col, v[:, h], jnp.zeros((), v.dtype))  # [S_blk, D]
            row_max, row_sum, acc = online_softmax_step(q, k[:, h], v_h, visible, carry,
                                                        sm_scale=sm_scale, soft_cap=soft_cap)
            m_sc[h], l_sc[h], acc_sc[h] = row_max, row_sum, acc

    @pl.when(step == pl.num_programs(2) - 1)
    def _emit():
        row_sum = l_sc[...]
        out = jnp.where(row_sum > 0, acc_sc[...] / jnp.where(row_sum > 0, row_sum, 1.0),
                        0.0)  # [K, G*bq, D]
        o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)


def _pipelined_prefill(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, block_q: int,
                       pages_per_block: int, sm_scale: float, soft_cap: float | None,
                       windows: jax.Array | None, interpret: bool) -> jax.Array:
    """[B, C_pad, N, D] (C_pad a multiple of block_q) on the TPU schedule."""
    b, c, n, d = q.shape
    _, p, k_heads, _ = k_pages.shape
    g = n // k_heads
    pmax = block_tables.shape[1]
    block_tokens = pages_per_block * p
    qt = q.reshape(b, c, k_heads, g, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, C_pad, D]
    bt_flat = block_tables.reshape(-1)

    def page_map(i):
        def index_map(row, q_block, step, bt_ref, lens_ref, qlens_ref, *win_ref):
            kv_len = lens_ref[row]
            lo, hi = _query_block_range(
                kv_len, qlens_ref[row], q_block, block_q=block_q, block_tokens=block_tokens,
                sliding_window=win_ref[0][row] if win_ref else None)
            block = jnp.minimum(lo + step, jnp.maximum(hi - 1, 0))
            slot = jnp.minimum(block * pages_per_block + i, jnp.maximum((kv_len - 1) // p, 0))
            return bt_ref[row * pmax + slot], 0, 0, 0
        return index_map

    page_specs = [pl.BlockSpec((pl.squeezed, p, k_heads, d), page_map(i))
                  for i in range(pages_per_block)]
    q_spec = pl.BlockSpec((pl.squeezed, k_heads, g, block_q, d),
                          lambda row, q_block, *_: (row, 0, 0, q_block, 0))
    scalars = [bt_flat, kv_lens.astype(jnp.int32), q_lens.astype(jnp.int32)]
    scalars += [] if windows is None else [windows]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(b, c // block_q, pl.cdiv(pmax, pages_per_block)),
        in_specs=[q_spec, *page_specs, *page_specs],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((k_heads, g * block_q, 1), jnp.float32),
                        pltpu.VMEM((k_heads, g * block_q, 1), jnp.float32),
                        pltpu.VMEM((k_heads, g * block_q, d), jnp.float32)],
    )
    kernel = functools.partial(
        _pipelined_prefill_kernel, pages_per_block=pages_per_block, page_size=p,
        block_q=block_q, sm_scale=sm_scale, soft_cap=soft_cap, windowed=windows is not None)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_prefill_pipelined",
    )(*scalars, qt,
      *([k_pages] * pages_per_block), *([v_pages] * pages_per_block))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, c, n, d)  # [B, C_pad, N, D]


def _looped_prefill_kernel(bt_ref, len_ref, qlen_ref, *refs, pages_per_block: int,
                           page_size: int, sm_scale: float, soft_cap: float | None,
                           windowed: bool):
    """One (row, kv head, query block) program: loop over the blocks its queries see."""
    sliding_window, refs = pop_window(refs, windowed, 0)
    q_ref, k_ref, v_ref, o_ref = refs
    block_q, gp, d = q_ref.shape
    rows = block_q * gp
    block_tokens = pages_per_block * page_size
    kv_len, q_len = len_ref[0], qlen_ref[0]
    q_block = pl.program_id(2)
    lo, hi = _query_block_range(kv_len, q_len, q_block, block_q=block_q,
                                block_tokens=block_tokens, sliding_window=sliding_window)
    q = q_ref[...].reshape(rows, d)  # [bq*Gp, D], query-major rows
    query = q_block * block_q + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // gp  # [rows, 1]

    def fold(block, carry):
        page_ids = bt_ref[pl.ds(block * pages_per_block, pages_per_block)]  # [pages]
        k = k_ref[page_ids].reshape(block_tokens, d)  # [S_blk, D]
        v = v_ref[page_ids].reshape(block_tokens, d)
        pos = block * block_tokens + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        v = jnp.where((pos < kv_len).reshape(block_tokens, 1), v, jnp.zeros_like(v))
        visible = _prefill_visible(query, pos, kv_len, q_len, sliding_window)  # [rows, S_blk]
        return online_softmax_step(q, k, v, visible, carry, sm_scale=sm_scale,
                                   soft_cap=soft_cap)

    init = (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))
    _, row_sum, acc = lax.fori_loop(lo, hi, fold, init)
    out = jnp.where(row_sum > 0, acc / jnp.where(row_sum > 0, row_sum, 1.0), 0.0)  # [rows, D]
    o_ref[...] = out.reshape(block_q, gp, d).astype(o_ref.dtype)


def _looped_prefill(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, block_q: int,
                    pages_per_block: int, sm_scale: float, soft_cap: float | None,
                    windows: jax.Array | None, interpret: bool) -> jax.Array:
    """[B, C_pad, N, D] (C_pad a multiple of block_q) on the GPU schedule."""
    b, c, n, d = q.shape
    num_pages, p, k_heads, _ = k_pages.shape
    g = n // k_heads
    gp = next_power_of_2(g)
    if not interpret:
        gp = _gpu_group(g, block_q)
        check_triton_block(rows=block_q * gp, head_dim=d, pages_per_block=pages_per_block,
                           page_size=p)
    qg = q.reshape(b, c, k_heads, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0)))  # [B, C_pad, K, Gp, D]
    pmax = block_tables.shape[1]
    page_spec = pl.BlockSpec((num_pages, p, pl.squeezed, d),
                             lambda row, h, q_block: (0, 0, h, 0))
    q_spec = pl.BlockSpec((pl.squeezed, block_q, pl.squeezed, gp, d),
                          lambda row, h, q_block: (row, q_block, h, 0, 0))
    len_spec = pl.BlockSpec((1,), lambda row, h, q_block: (row,))
    kernel = functools.partial(
        _looped_prefill_kernel, pages_per_block=pages_per_block, page_size=p,
        sm_scale=sm_scale, soft_cap=soft_cap, windowed=windows is not None)
    windows = [] if windows is None else [windows]
    out = pl.pallas_call(
        kernel,
        grid=(b, k_heads, c // block_q),
        in_specs=[pl.BlockSpec((pl.squeezed, pmax), lambda row, h, q_block: (row, 0)),
                  len_spec, len_spec, *[len_spec] * len(windows), q_spec, page_spec,
                  page_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=_GPU_PREFILL_WARPS,
                                                num_stages=TRITON_STAGES),
        interpret=interpret,
        name="ragged_prefill_looped",
    )(block_tables, kv_lens.astype(jnp.int32), q_lens.astype(jnp.int32), *windows, qg, k_pages,
      v_pages)
    return out[:, :, :, :g].reshape(b, c, n, d)


def ragged_prefill_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    schedule: Schedule | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Chunked-prefill attention over paged KV: row b holds the last q_lens[b] tokens.

    Args:
      q: [B, C, N, D]; queries c >= q_lens[b] are padding (their output is zeros).
      k_pages, v_pages: [num_pages, P, K, D].
      block_tables: [B, Pmax] int32; entries past a sequence's length may hold any valid page.
      kv_lens: [B] int32, tokens in the cache including this chunk.
      q_lens: [B] int32, 0 <= q_lens <= min(C, kv_lens).
      sm_scale: logit scale, 1 / sqrt(D) by default.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
      sliding_window: if set, a query sees only its last `sliding_window` tokens (a Python
        int > 0, or an int32 scalar, traced or not, where <= 0 means no window); blocks wholly
        before a query block's window are not read.
      block_q: queries per block (the chunk is padded to a multiple; default min(C, 64)).
      pages_per_compute_block: pages folded per online-softmax step (about 128 tokens default).
      schedule: PIPELINED (TPU) or LOOPED (GPU); default per backend.
      interpret: run through the Pallas interpreter (any backend, CPU included).
    Returns:
      [B, C, N, D] in q's dtype.
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [B, C, N, D], got shape {q.shape}")
    check_paged_args(q, k_pages, v_pages, block_tables, kv_lens, soft_cap=soft_cap,
                     sliding_window=sliding_window,
                     pages_per_compute_block=pages_per_compute_block)
    if q_lens.shape != kv_lens.shape:
        raise ValueError(f"q_lens {q_lens.shape} must be [B={q.shape[0]}]")
    if block_q is not None and block_q <= 0:
        raise ValueError(f"block_q must be positive, got {block_q}")
    b, c, n, d = q.shape
    p = k_pages.shape[1]
    schedule = default_schedule() if schedule is None else schedule
    on_gpu = (not interpret and schedule is Schedule.LOOPED
              and targets.current_platform() == "gpu")
    if block_q is None:
        block_q = min(next_power_of_2(c), _DEFAULT_BLOCK_Q)
        if on_gpu:
            # A [block_q * Gp, S_blk] float32 logits tile lives in registers: past
            # _MAX_GPU_ROWS rows it spills (measured for an H100).
            block_q = max(1, min(block_q, _MAX_GPU_ROWS // _gpu_group(n // k_pages.shape[2],
                                                                      block_q)))
    max_tokens = (gpu_block_tokens(rows=block_q * _gpu_group(n // k_pages.shape[2], block_q),
                                   head_dim=d, dtype=q.dtype) if on_gpu
                  else DEFAULT_BLOCK_TOKENS)
    pages_per_block = (default_pages_per_compute_block(p, block_tables.shape[1], max_tokens)
                       if pages_per_compute_block is None else pages_per_compute_block)
    block_tables = pad_block_tables(block_tables, pages_per_block)
    c_pad = pl.cdiv(c, block_q) * block_q
    q_padded = jnp.pad(q, ((0, 0), (0, c_pad - c), (0, 0), (0, 0)))  # [B, C_pad, N, D]
    impl = _pipelined_prefill if schedule is Schedule.PIPELINED else _looped_prefill
    out = impl(q_padded, k_pages, v_pages, block_tables, kv_lens, q_lens, block_q=block_q,
               pages_per_block=pages_per_block,
               sm_scale=1.0 / np.sqrt(d) if sm_scale is None else sm_scale,
               soft_cap=soft_cap, windows=window_rows(sliding_window, b), interpret=interpret)
    return out[:, :c]
