"""Paged decode attention as a Pallas kernel: one query token per sequence against its KV pages.

Same leading arguments as `reference.paged_decode_attention_reference`: q [B, N, D], k_pages /
v_pages [num_pages, P, K, D], block_tables [B, Pmax] int32, kv_lens [B] int32.

The work is cut into compute blocks of `pages_per_compute_block` pages. Each sequence's live
blocks (those holding tokens inside the sliding window, up to kv_len) are split evenly into
`num_splits` contiguous ranges (split-K); each split runs an online softmax over its blocks for
the G query heads of one kv head at once (GQA: a [G, D] x [D, S_blk] matmul per block) and
writes an unnormalised partial output with its running max and sum. A small jnp step combines
the splits. A split with an empty range (short sequence, padded row) reads no page.

The sliding window may be a Python int or a traced int32 scalar (the engine's per-layer value,
0 for a global layer, so one program serves both): a traced window reaches the kernel as a
per-row input, [B] int32, beside the lengths.

Two schedules express the same computation (see pallas_kernels/README.md):

  * `Schedule.PIPELINED` (TPU, Mosaic): `PrefetchScalarGridSpec` puts the block tables and
    lengths in SMEM; grid (B, splits, blocks per split), the last axis sequential with the
    softmax state in VMEM scratch; the index maps turn (row, split, step) into page numbers so
    the pipeline DMAs exactly the pages of the block and repeats the last one past the end
    (a repeated block index is not re-fetched).
  * `Schedule.LOOPED` (GPU, Triton): grid (B, K, splits), every program a fori_loop over its
    blocks that gathers the block's pages through the block table (`k_ref[page_ids]`).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from kvjax.shapes import next_power_of_2
from pallas_kernels import targets

# Finite stand-in for -inf: masked scores never produce inf - inf = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Key/value tokens per compute block when pages_per_compute_block is not given.
DEFAULT_BLOCK_TOKENS = 128
# Triton's dots want every side (rows, head dim, block tokens) to be at least 16.
MIN_TRITON_ROWS = 16


class Schedule(enum.Enum):
    """How a kernel walks the KV pages: the per-backend variant of one computation."""

    PIPELINED = "pipelined"  # TPU Mosaic: scalar prefetch, sequential grid axis, VMEM scratch.
    LOOPED = "looped"  # GPU Triton: parallel grid, in-kernel loop gathering pages.


def default_schedule(backend: str | None = None) -> Schedule:
    """PIPELINED on TPU; LOOPED on GPU and on CPU, where it compiles and interprets faster."""
    backend = targets.current_platform() if backend is None else backend
    return Schedule.PIPELINED if backend == "tpu" else Schedule.LOOPED


def default_pages_per_compute_block(page_size: int, max_pages: int,
                                    max_block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """About 128 tokens per block (a power of two of pages; fewer where `max_block_tokens`,
    what the GPU's shared memory holds, says so), no more pages than a row holds, but at least
    the 16 tokens Triton's dots need (extra table entries are masked padding)."""
    pages = max(1, min(max_block_tokens // page_size, next_power_of_2(max_pages)))
    return max(pages, next_power_of_2(-(-MIN_TRITON_ROWS // page_size)))


# Triton's software pipeline (num_stages) keeps this many copies of each loaded block in
# shared memory.
TRITON_STAGES = 2


def gpu_smem_estimate(*, rows: int, head_dim: int, block_tokens: int, dtype) -> int:
    """Shared memory (bytes) a LOOPED program asks for: the query tile and TRITON_STAGES
    buffered K and V blocks, in the compute dtype. Float32 tiles take about half as much
    again (measured by compiling for an H100: the IEEE dots keep extra operand copies), so
    they count 1.5 times; the estimate is conservative, the deviceless compile tier checks it.
    """
    itemsize = jnp.dtype(dtype).itemsize
    tiles = rows * head_dim * itemsize + TRITON_STAGES * 2 * block_tokens * head_dim * itemsize
    return tiles * 3 // 2 if itemsize >= 4 else tiles


def gpu_block_tokens(*, rows: int, head_dim: int, dtype,
                     start: int = DEFAULT_BLOCK_TOKENS) -> int:
    """Tokens per compute block (a power of two, at most `start`, at least Triton's 16) whose
    tiles fit the shared memory of the GPU being compiled for (`targets.current_gpu`)."""
    budget = targets.current_gpu().shared_memory_per_block
    tokens = start
    while tokens > MIN_TRITON_ROWS and gpu_smem_estimate(
            rows=rows, head_dim=head_dim, block_tokens=tokens, dtype=dtype) > budget:
        tokens //= 2
    return tokens


def max_block_tokens(*, rows: int, head_dim: int, dtype, interpret: bool) -> int:
    """The compute-block cap for a LOOPED call: the GPU's shared memory when compiled for a
    GPU, else the default (interpret mode and TPU have no such limit)."""
    if interpret or targets.current_platform() != "gpu":
        return DEFAULT_BLOCK_TOKENS
    return gpu_block_tokens(rows=rows, head_dim=head_dim, dtype=dtype)


def padded_group(group: int, interpret: bool) -> int:
    """Query heads per kv head as the LOOPED kernel sees them: Triton's tl.dot wants a power of
    two of at least 16 rows; interpret mode pads to the power of two only."""
    rows = next_power_of_2(group)
    return rows if interpret else max(rows, MIN_TRITON_ROWS)


def check_paged_args(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                     block_tables: jax.Array, kv_lens: jax.Array, *, soft_cap: float | None,
                     sliding_window: int | None, pages_per_compute_block: int | None) -> None:
    """Validates the shapes and knobs shared by the decode and prefill kernels."""
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be "
                         "[num_pages, P, K, D]")
    n, d = q.shape[-2:]
    k_heads, kd = k_pages.shape[2:]
    if d != kd:
        raise ValueError(f"q head dim {d} != page head dim {kd}")
    if n % k_heads:
        raise ValueError(f"q heads {n} are not a multiple of kv heads {k_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables {block_tables.shape} must be [B={q.shape[0]}, Pmax]")
    if kv_lens.shape != (q.shape[0],):
        raise ValueError(f"kv_lens {kv_lens.shape} must be [B={q.shape[0]}]")
    if not (jnp.issubdtype(block_tables.dtype, jnp.integer)
            and jnp.issubdtype(kv_lens.dtype, jnp.integer)):
        raise ValueError(f"block_tables ({block_tables.dtype}) and kv_lens ({kv_lens.dtype}) "
                         "must be integer")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    if isinstance(sliding_window, int) and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if pages_per_compute_block is not None and pages_per_compute_block <= 0:
        raise ValueError(f"pages_per_compute_block must be positive, got {pages_per_compute_block}")


def check_triton_block(*, rows: int, head_dim: int, pages_per_block: int, page_size: int
                       ) -> None:
    """Triton (the GPU path) loads power-of-2 sized tensors and its dots want every side >= 16."""
    sizes = dict(rows=rows, head_dim=head_dim, pages_per_compute_block=pages_per_block,
                 page_size=page_size)
    for name, size in sizes.items():
        if size & (size - 1):
            raise ValueError(f"the GPU (Triton) kernel needs a power-of-2 {name}, got {size}")
    for name, size in (("rows", rows), ("head_dim", head_dim),
                       ("pages_per_compute_block * page_size", pages_per_block * page_size)):
        if size < MIN_TRITON_ROWS:
            raise ValueError(f"the GPU (Triton) kernel needs {name} >= {MIN_TRITON_ROWS}, "
                             f"got {size}")


def pad_block_tables(block_tables: jax.Array, pages_per_block: int) -> jax.Array:
    """[B, Pmax] -> [B, ceil(Pmax / pages_per_block) * pages_per_block] int32, padded with 0.

    Padding entries sit past every sequence's length, so they are masked like any stale entry.
    """
    pmax = block_tables.shape[1]
    pad = -pmax % pages_per_block
    return jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pad)))


def cap_logits(s: jax.Array, soft_cap: float | None) -> jax.Array:
    """soft_cap * tanh(s / soft_cap) when a cap is set, as the oracle applies it."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def fold_logits(s: jax.Array, visible: jax.Array, carry, value_matmul: Callable[[jax.Array], Any]
                ) -> tuple[jax.Array, jax.Array, Any]:
    """Folds a block's float32 logits s [R, S_blk] into a running softmax.

    Args:
      s: [R, S_blk] scaled (and capped) logits; entries not `visible` may be anything, NaN too.
      visible: [R, S_blk] or [1, S_blk] bool.
      carry: (running max [R, 1], running sum [R, 1], unnormalised output: an array [R, D] or
        a tuple of them).
      value_matmul: softmax weights p [R, S_blk] float32 (0 where not visible) -> this block's
        contribution to the output, with the structure of carry[2].
    """
    m_prev, l_prev, acc_prev = carry
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, 1]
    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)  # [R, S_blk]
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc = jax.tree.map(lambda a, pv: alpha * a + pv, acc_prev, value_matmul(p))
    return m_new, l_new, acc


def dot_precision(dtype) -> lax.Precision:
    """Float32 operands get float32 matmuls (Triton's default would be TF32), like the oracle."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def matmul_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [R, D] x b [S, D] -> [R, S] float32 (operands in a shared dtype)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=dot_precision(b.dtype),
                           preferred_element_type=jnp.float32)


def matmul_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [R, S] x b [S, D] -> [R, D] float32 (operands in a shared dtype)."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=dot_precision(b.dtype),
                           preferred_element_type=jnp.float32)


def online_softmax_step(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                        carry: tuple[jax.Array, jax.Array, jax.Array], *, sm_scale: float,
                        soft_cap: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Folds one block of keys into the running softmax of R query rows (float32 state).

    Args:
      q: [R, D]; k, v: [S_blk, D] (v zeroed where its slot holds no token: 0 * NaN is NaN).
      visible: [R, S_blk] or [1, S_blk] bool, which keys each row attends to.
      carry: (running max [R, 1], running sum [R, 1], unnormalised output [R, D]).
    """
    s = cap_logits(matmul_nt(q, k) * sm_scale, soft_cap)  # [R, S_blk]
    # bf16 pages: the softmax weights are rounded to bf16 for the value matmul.
    return fold_logits(s, visible, carry, lambda p: matmul_nn(p.astype(v.dtype), v))


def pop_window(refs, windowed: bool, row) -> tuple[jax.Array | None, list]:
    """(the row's window, the other refs) of a kernel whose refs after the lengths start with
    the windows (`window_rows`, scalar-prefetched [B], or this row's [1]) when `windowed`."""
    if not windowed:
        return None, list(refs)
    win_ref, *refs = refs
    return win_ref[row], refs


def window_rows(sliding_window: int | jax.Array | None, batch: int) -> jax.Array | None:
    """The window as a per-row kernel input [B] int32 (<= 0: none), or None: no window."""
    if sliding_window is None:
        return None
    return jnp.broadcast_to(jnp.asarray(sliding_window, jnp.int32), (batch,))


def split_block_range(kv_len: jax.Array, split: jax.Array, *, block_tokens: int,
                      num_splits: int, sliding_window: jax.Array | int | None
                      ) -> tuple[jax.Array, jax.Array]:
    """Compute blocks [lo, hi) that `split` covers for a decode query at kv_len - 1."""
    first_token = (0 if sliding_window is None else jnp.where(
        sliding_window > 0, jnp.maximum(kv_len - sliding_window, 0), 0))
    first = first_token // block_tokens
    end = (kv_len + block_tokens - 1) // block_tokens
    per_split = (end - first + num_splits - 1) // num_splits
    lo = first + split * per_split
    return lo, jnp.minimum(lo + per_split, end)


def decode_visible(pos: jax.Array, kv_len: jax.Array, sliding_window: jax.Array | int | None
                   ) -> tuple[jax.Array, jax.Array]:
    """(key slot holds a token, key visible to the query at kv_len - 1) for positions `pos`."""
    in_seq = pos < kv_len
    visible = in_seq if sliding_window is None else in_seq & (
        (sliding_window <= 0) | (pos >= kv_len - sliding_window))
    return in_seq, visible


def token_column_mask(block: jax.Array, block_tokens: int, kv_len: jax.Array) -> jax.Array:
    """[S_blk, 1] bool: which slots of the block hold a token, one per sublane.

    Built from an iota along the sublanes rather than by reshaping the lane-major [1, S_blk]
    row: Mosaic cannot relayout a [1, S] boolean vector to [S, 1, 1] (an "unsupported shape
    cast" when compiled for a TPU).
    """
    pos = block * block_tokens + lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)
    return pos < kv_len


def pipelined_decode_call(fold_block: Callable, *, scalars: list[jax.Array],
                          queries: list[jax.Array], pools: list[jax.Array],
                          block_range: Callable, page_of: Callable, pages_per_block: int,
                          widths: tuple[int, ...], num_splits: int, steps: int,
                          interpret: bool, name: str) -> tuple[jax.Array, ...]:
    """A decode kernel on the PIPELINED (TPU) schedule: grid (B, splits, steps), the last axis
    sequential, the softmax state of all K kv heads in VMEM scratch.

    Each page of a compute block is one BlockSpec per pool whose index map reads the page
    number from SMEM, so the pipeline DMAs exactly the block's pages (all K kv heads of a page:
    a single-head block would have a second-minor dim of 1, which Mosaic does not tile) and
    double-buffers them; past a split's end it repeats the last live block's pages, which the
    pipeline does not fetch again.

    Args:
      fold_block: (row, block, scalar_refs, blocks) -> head_fold, where blocks holds each
        pool's pages of the block concatenated, [S_blk, K, ...], and head_fold(h, q_rows,
        carry) -> carry folds them into kv head h's softmax state: q_rows one [G, D_i] per
        query, carry (max [G, 1], sum [G, 1], a tuple of unnormalised outputs [G, w]).
      scalars: int32 arrays scalar-prefetched into SMEM (flat block tables, lengths, ...).
      queries: [B, N, D_i] each.
      pools: [num_pages, P, K, ...] each (pages, codes, scales).
      block_range: (row, split, *scalar_refs) -> compute blocks [lo, hi) of the split.
      page_of: (row, block, i, *scalar_refs) -> page number of page i of a live block.
      widths: the width of each unnormalised output.
    Returns:
      One partial output [B, splits, K, G, w] per width, then softmax max and sum
      [B, splits, K, G, 1].
    """
    b, n = queries[0].shape[:2]
    k_heads = pools[0].shape[2]
    g = n // k_heads

    def page_map(i, ndim):
        def index_map(row, split, step, *scalar_refs):
            lo, hi = block_range(row, split, *scalar_refs)
            block = jnp.minimum(lo + step, jnp.maximum(hi - 1, 0))
            return (page_of(row, block, i, *scalar_refs),) + (0,) * (ndim - 1)
        return index_map

    page_specs = []
    for pool in pools:
        page_specs += [pl.BlockSpec((pl.squeezed, *pool.shape[1:]), page_map(i, pool.ndim))
                       for i in range(pages_per_block)]
    part_map = lambda row, split, step, *_: (row, split, 0, 0, 0)
    part_specs = [pl.BlockSpec((pl.squeezed, pl.squeezed, k_heads, g, w), part_map)
                  for w in (*widths, 1, 1)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(b, num_splits, steps),
        in_specs=[*[pl.BlockSpec((pl.squeezed, n, x.shape[2]), lambda row, *_: (row, 0, 0))
                    for x in queries], *page_specs],
        out_specs=part_specs,
        scratch_shapes=[pltpu.VMEM((k_heads, g, w), jnp.float32) for w in (1, 1, *widths)],
    )
    kernel = functools.partial(
        _pipelined_decode_kernel, fold_block=fold_block, block_range=block_range,
        num_scalars=len(scalars), num_queries=len(queries), num_pools=len(pools),
        pages_per_block=pages_per_block, num_outputs=len(widths))
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, num_splits, k_heads, g, w), jnp.float32)
                   for w in (*widths, 1, 1)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=name,
    )(*scalars, *queries, *[pool for pool in pools for _ in range(pages_per_block)])


def _pipelined_decode_kernel(*refs, fold_block: Callable, block_range: Callable,
                             num_scalars: int, num_queries: int, num_pools: int,
                             pages_per_block: int, num_outputs: int):
    """One (row, split, step) grid point of `pipelined_decode_call`: fold a block of pages
    for all K kv heads."""
    row, split, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    scalar_refs, refs = refs[:num_scalars], refs[num_scalars:]
    q_refs, refs = refs[:num_queries], refs[num_queries:]
    num_pages = num_pools * pages_per_block
    page_refs, refs = refs[:num_pages], refs[num_pages:]
    o_refs, (m_ref, l_ref), refs = refs[:num_outputs], refs[num_outputs:num_outputs + 2], \
        refs[num_outputs + 2:]
    m_sc, l_sc, *acc_scs = refs
    num_kv_heads, group = m_sc.shape[:2]
    lo, hi = block_range(row, split, *scalar_refs)
    block = lo + step

    @pl.when(step == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        for acc_sc in acc_scs:
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(block < hi)
    def _fold():
        blocks = [jnp.concatenate([r[...] for r in page_refs[j:j + pages_per_block]], axis=0)
                  for j in range(0, num_pages, pages_per_block)]  # each [S_blk, K, ...]
        head_fold = fold_block(row, block, scalar_refs, blocks)
        qs = [r[...] for r in q_refs]  # each [N, D_i]
        for h in range(num_kv_heads):
            carry = (m_sc[h], l_sc[h], tuple(acc_sc[h] for acc_sc in acc_scs))
            row_max, row_sum, accs = head_fold(
                h, [q[h * group:(h + 1) * group] for q in qs], carry)
            m_sc[h], l_sc[h] = row_max, row_sum
            for acc_sc, acc in zip(acc_scs, accs, strict=True):
                acc_sc[h] = acc

    @pl.when(step == pl.num_programs(2) - 1)
    def _emit():
        for o_ref, acc_sc in zip(o_refs, acc_scs, strict=True):
            o_ref[...] = acc_sc[...]
        m_ref[...] = m_sc[...]
        l_ref[...] = l_sc[...]


def table_walk(*, page_size: int, pages_per_block: int, num_splits: int, width: int
               ) -> tuple[Callable, Callable]:
    """(block_range, page_of) of `pipelined_decode_call` walking a row's block table.

    The scalars are (block_tables flattened [B * width], kv_lens [B], and optionally the
    per-row windows [B]); past the row's last page, page_of repeats it, so the pipeline does
    not fetch it again.
    """
    block_tokens = pages_per_block * page_size

    def block_range(row, split, bt_ref, lens_ref, *win_ref):
        return split_block_range(lens_ref[row], split, block_tokens=block_tokens,
                                 num_splits=num_splits,
                                 sliding_window=win_ref[0][row] if win_ref else None)

    def page_of(row, block, i, bt_ref, lens_ref, *_):
        last = jnp.maximum((lens_ref[row] - 1) // page_size, 0)
        return bt_ref[row * width + jnp.minimum(block * pages_per_block + i, last)]

    return block_range, page_of


def table_block_masks(row, block, scalar_refs, block_tokens: int
                      ) -> tuple[jax.Array, jax.Array]:
    """(visible [1, S_blk], in_seq [S_blk, 1]) of a compute block under `table_walk`'s
    scalars: which keys the row's query sees (lane-major, for the logits), which slots hold a
    token (sublane-major, to zero the values)."""
    _, lens_ref, *win_ref = scalar_refs
    kv_len = lens_ref[row]
    pos = block * block_tokens + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
    _, visible = decode_visible(pos, kv_len, win_ref[0][row] if win_ref else None)
    return visible, token_column_mask(block, block_tokens, kv_len)


def pages_head_fold(k: jax.Array, v: jax.Array, visible: jax.Array, in_seq_col: jax.Array, *,
                    sm_scale: float, soft_cap: float | None) -> Callable:
    """The `pipelined_decode_call` head fold over a block of float pages.

    Args:
      k, v: [S_blk, K, D] the block's pages; visible: [1, S_blk] keys the query sees;
        in_seq_col: [S_blk, 1] slots holding a token (the values elsewhere are zeroed).
    """
    def head_fold(h, q_rows, carry):
        row_max, row_sum, (acc,) = carry
        v_h = jnp.where(in_seq_col, v[:, h], jnp.zeros((), v.dtype))  # [S_blk, D]
        row_max, row_sum, acc = online_softmax_step(
            q_rows[0], k[:, h], v_h, visible, (row_max, row_sum, acc), sm_scale=sm_scale,
            soft_cap=soft_cap)
        return row_max, row_sum, (acc,)
    return head_fold


def _pipelined_decode(q, k_pages, v_pages, block_tables, kv_lens, *, pages_per_block: int,
                      num_splits: int, sm_scale: float, soft_cap: float | None,
                      windows: jax.Array | None, interpret: bool):
    """Partials [B, splits, K, G, D] (and max, sum [B, splits, K, G, 1]) on the TPU schedule."""
    p = k_pages.shape[1]
    pmax = block_tables.shape[1]

    def fold_block(row, block, scalar_refs, blocks):
        visible, in_seq_col = table_block_masks(row, block, scalar_refs, pages_per_block * p)
        return pages_head_fold(*blocks, visible, in_seq_col, sm_scale=sm_scale,
                               soft_cap=soft_cap)

    block_range, page_of = table_walk(page_size=p, pages_per_block=pages_per_block,
                                      num_splits=num_splits, width=pmax)
    # SMEM pads 2D arrays to (8, 128) words per row group; a flat table packs densely.
    scalars = [block_tables.reshape(-1), kv_lens.astype(jnp.int32)]
    return pipelined_decode_call(
        fold_block, scalars=scalars + ([] if windows is None else [windows]), queries=[q],
        pools=[k_pages, v_pages], block_range=block_range, page_of=page_of,
        pages_per_block=pages_per_block, widths=(q.shape[2],), num_splits=num_splits,
        steps=pl.cdiv(pl.cdiv(pmax, pages_per_block), num_splits), interpret=interpret,
        name="paged_decode_pipelined")


def fold_split(o_ref, m_ref, l_ref, *, lo: jax.Array, hi: jax.Array, fold: Callable,
               rows: int, widths: tuple[int, ...]) -> None:
    """Runs `fold(block, carry)` over blocks [lo, hi) and stores a LOOPED program's partials.

    The unnormalised output is one [rows, w] array per entry of `widths`, stored side by side
    in o_ref [rows, sum(widths)] (a single array when there is one width).
    """
    acc = tuple(jnp.zeros((rows, w), jnp.float32) for w in widths)
    init = (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            acc[0] if len(widths) == 1 else acc)
    row_max, row_sum, acc = lax.fori_loop(lo, hi, fold, init)
    if len(widths) == 1:
        o_ref[...] = acc
    else:
        offsets = np.cumsum((0,) + widths)
        for part, start, width in zip(acc, offsets[:-1], widths, strict=True):
            o_ref[:, pl.ds(int(start), width)] = part
    m_ref[...] = row_max
    l_ref[...] = row_sum


def _looped_decode_kernel(bt_ref, len_ref, *refs, pages_per_block: int, page_size: int,
                          num_splits: int, sm_scale: float, soft_cap: float | None,
                          windowed: bool):
    """One (row, kv head, split) program: loop over the split's blocks of pages."""
    sliding_window, refs = pop_window(refs, windowed, 0)
    q_ref, k_ref, v_ref, o_ref, m_ref, l_ref = refs
    block_tokens = pages_per_block * page_size
    kv_len = len_ref[0]
    lo, hi = split_block_range(kv_len, pl.program_id(2), block_tokens=block_tokens,
                               num_splits=num_splits, sliding_window=sliding_window)
    q = q_ref[...]  # [G, D]
    rows, d = q.shape

    def fold(block, carry):
        page_ids = bt_ref[pl.ds(block * pages_per_block, pages_per_block)]  # [pages]
        k = k_ref[page_ids].reshape(block_tokens, d)  # [S_blk, D]
        v = v_ref[page_ids].reshape(block_tokens, d)
        pos = block * block_tokens + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        in_seq, visible = decode_visible(pos, kv_len, sliding_window)  # [1, S_blk]
        v = jnp.where(in_seq.reshape(block_tokens, 1), v, jnp.zeros_like(v))
        return online_softmax_step(q, k, v, visible, carry, sm_scale=sm_scale,
                                   soft_cap=soft_cap)

    fold_split(o_ref, m_ref, l_ref, lo=lo, hi=hi, fold=fold, rows=rows, widths=(d,))


def head_view_spec(pool: jax.Array) -> pl.BlockSpec:
    """A LOOPED program's view of a pool [num_pages, P, K, ...]: every page of its kv head."""
    rest = pool.shape[3:]
    return pl.BlockSpec((*pool.shape[:2], pl.squeezed, *rest),
                        lambda row, h, split: (0, 0, h) + (0,) * len(rest))


def grouped_queries(q: jax.Array, num_kv_heads: int, rows: int) -> jax.Array:
    """q [B, N, D] -> [B, K, rows, D]: each kv head's G query heads, zero-padded to `rows`."""
    b, n, d = q.shape
    qg = q.reshape(b, num_kv_heads, n // num_kv_heads, d)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, rows - n // num_kv_heads), (0, 0)))


def looped_decode_call(kernel: Callable, *, tables: list[jax.Array], kv_lens: jax.Array,
                       queries: list[jax.Array], pools: list[jax.Array], out_dim: int,
                       num_splits: int, interpret: bool, name: str,
                       windows: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode kernel on the LOOPED (GPU) schedule: grid (B, K, splits), all parallel.

    Args:
      kernel: called with refs (*tables [W_i], kv_len [1], window [1] (only with `windows`),
        *queries [Gp, D_i], *pools (their kv head's view, `head_view_spec`), out
        [Gp, out_dim], max [Gp, 1], sum [Gp, 1]).
      tables: per-row int32 arrays [B, W_i] (block tables, page selections).
      queries: [B, K, Gp, D_i] each.
      pools: page pools [num_pages, P, K, ...] (codes, scales, pages).
      windows: [B] int32 per-row sliding windows (`window_rows`), or None.
    Returns:
      Partials [B, splits, K, Gp, out_dim] and softmax max, sum [B, splits, K, Gp, 1].
    """
    b, k_heads, gp = queries[0].shape[:3]
    part_map = lambda row, h, split: (row, split, h, 0, 0)
    stat_shape = jax.ShapeDtypeStruct((b, num_splits, k_heads, gp, 1), jnp.float32)
    stat_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, gp, 1), part_map)
    table_specs = [pl.BlockSpec((pl.squeezed, t.shape[1]), lambda row, h, split: (row, 0))
                   for t in tables]
    query_specs = [pl.BlockSpec((pl.squeezed, pl.squeezed, gp, x.shape[3]),
                                lambda row, h, split: (row, h, 0, 0)) for x in queries]
    row_spec = pl.BlockSpec((1,), lambda row, h, split: (row,))
    windows = [] if windows is None else [windows]
    return pl.pallas_call(
        kernel,
        grid=(b, k_heads, num_splits),
        in_specs=[*table_specs, row_spec, *[row_spec] * len(windows),
                  *query_specs, *[head_view_spec(x) for x in pools]],
        out_specs=[pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, gp, out_dim),
                                part_map), stat_spec, stat_spec],
        out_shape=[jax.ShapeDtypeStruct((b, num_splits, k_heads, gp, out_dim), jnp.float32),
                   stat_shape, stat_shape],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=TRITON_STAGES),
        interpret=interpret,
        name=name,
    )(*tables, kv_lens.astype(jnp.int32), *windows, *queries, *pools)


def _looped_decode(q, k_pages, v_pages, block_tables, kv_lens, *, pages_per_block: int,
                   num_splits: int, sm_scale: float, soft_cap: float | None,
                   windows: jax.Array | None, interpret: bool):
    """Partials [B, splits, K, Gp, D] (and max, sum [B, splits, K, Gp, 1]) on the GPU schedule."""
    d = q.shape[2]
    p, k_heads = k_pages.shape[1:3]
    gp = padded_group(q.shape[1] // k_heads, interpret)
    if not interpret:
        check_triton_block(rows=gp, head_dim=d, pages_per_block=pages_per_block, page_size=p)
    kernel = functools.partial(
        _looped_decode_kernel, pages_per_block=pages_per_block, page_size=p,
        num_splits=num_splits, sm_scale=sm_scale, soft_cap=soft_cap,
        windowed=windows is not None)
    return looped_decode_call(
        kernel, tables=[block_tables], kv_lens=kv_lens,
        queries=[grouped_queries(q, k_heads, gp)], pools=[k_pages, v_pages], out_dim=d,
        num_splits=num_splits, interpret=interpret, name="paged_decode_looped",
        windows=windows)


def combine_splits(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array) -> jax.Array:
    """Merges split-K partials into [B, K, G, D].

    Args:
      acc: [B, splits, K, G, D] unnormalised outputs.
      row_max, row_sum: [B, splits, K, G, 1] running softmax max and sum of each split.
    Rows whose every split saw no visible key (sum 0) come out as zeros.
    """
    m_max = jnp.max(row_max, axis=1, keepdims=True)  # [B, 1, K, G, 1]
    w = jnp.exp(row_max - m_max)  # [B, splits, K, G, 1]
    l_sum = jnp.sum(w * row_sum, axis=1)  # [B, K, G, 1]
    out = jnp.sum(w * acc, axis=1)  # [B, K, G, D]
    return jnp.where(l_sum > 0, out / jnp.where(l_sum > 0, l_sum, 1.0), 0.0)


def default_num_splits(batch: int, num_kv_heads: int, num_blocks: int, backend: str) -> int:
    """Enough (row, kv head, split) programs to fill a GPU; 1 elsewhere.

    On TPU the pipelined grid already overlaps DMA with compute on one core, and interpret mode
    gains nothing from more grid steps.
    """
    if backend != "gpu":
        return 1
    target_programs = 2 * targets.current_gpu().num_sms
    return int(max(1, min(num_blocks, pl.cdiv(target_programs, batch * num_kv_heads))))


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    schedule: Schedule | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention over paged KV: query b sits at position kv_lens[b] - 1 of its sequence.

    Args:
      q: [B, N, D].
      k_pages, v_pages: [num_pages, P, K, D].
      block_tables: [B, Pmax] int32; entries past a sequence's length may hold any valid page.
      kv_lens: [B] int32; 0 marks a padded row (its output is zeros).
      sm_scale: logit scale, 1 / sqrt(D) by default.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
      sliding_window: if set, the query sees only its last `sliding_window` tokens (a Python
        int > 0, or an int32 scalar, traced or not, where <= 0 means no window); blocks wholly
        before the window are not read.
      pages_per_compute_block: pages folded per online-softmax step (about 128 tokens default).
      num_splits: split-K partitions of each sequence's live blocks (default per backend).
      schedule: PIPELINED (TPU) or LOOPED (GPU); default per backend.
      interpret: run through the Pallas interpreter (any backend, CPU included).
    Returns:
      [B, N, D] in q's dtype.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [B, N, D], got shape {q.shape}")
    check_paged_args(q, k_pages, v_pages, block_tables, kv_lens, soft_cap=soft_cap,
                     sliding_window=sliding_window,
                     pages_per_compute_block=pages_per_compute_block)
    b, n, d = q.shape
    p, k_heads = k_pages.shape[1:3]
    schedule = default_schedule() if schedule is None else schedule
    block_tables, pages_per_block, num_splits = decode_blocking(
        block_tables, batch=b, num_kv_heads=k_heads, page_size=p,
        pages_per_compute_block=pages_per_compute_block, num_splits=num_splits,
        max_block_tokens=max_block_tokens(
            rows=padded_group(n // k_heads, interpret), head_dim=d, dtype=q.dtype,
            interpret=interpret or schedule is Schedule.PIPELINED))
    impl = _pipelined_decode if schedule is Schedule.PIPELINED else _looped_decode
    partials = impl(q, k_pages, v_pages, block_tables, kv_lens,
                    pages_per_block=pages_per_block, num_splits=num_splits,
                    sm_scale=1.0 / np.sqrt(d) if sm_scale is None else sm_scale,
                    soft_cap=soft_cap, windows=window_rows(sliding_window, b),
                    interpret=interpret)
    return finish_decode(*partials, q=q, num_kv_heads=k_heads)


def decode_blocking(block_tables: jax.Array, *, batch: int, num_kv_heads: int, page_size: int,
                    pages_per_compute_block: int | None, num_splits: int | None,
                    max_block_tokens: int = DEFAULT_BLOCK_TOKENS
                    ) -> tuple[jax.Array, int, int]:
    """(block tables padded to whole compute blocks, pages per block, splits) for a decode call.

    Defaults: about 128 tokens per block (at most `max_block_tokens`), `default_num_splits`
    for the backend; splits never exceed the blocks a row can hold.
    """
    if num_splits is not None and num_splits <= 0:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    pages_per_block = (default_pages_per_compute_block(page_size, block_tables.shape[1],
                                                       max_block_tokens)
                       if pages_per_compute_block is None else pages_per_compute_block)
    block_tables = pad_block_tables(block_tables, pages_per_block)
    num_blocks = block_tables.shape[1] // pages_per_block
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, num_blocks,
                                        targets.current_platform())
    return block_tables, pages_per_block, min(num_splits, num_blocks)


def finish_decode(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array, *, q: jax.Array,
                  num_kv_heads: int) -> jax.Array:
    """Split-K partials [B, splits, K, Gp, D] -> the output [B, N, D] in q's dtype."""
    b, n, d = q.shape
    out = combine_splits(acc, row_max, row_sum)  # [B, K, Gp, D]
    return out[:, :, :n // num_kv_heads].reshape(b, n, d).astype(q.dtype)
