"""The sparse page-subset decode kernel (CPU, Pallas interpret mode) against its oracle.

Every case uses a randomly permuted block table and NaN in every slot the selection does not
read: pages no row owns, unselected pages, the tail of each last page. A stray read shows up as
NaN in the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kv_cases import INTERPRET, TOLERANCES, block_pages, paged_layout, runnable

from kvjax.kv import quest
from kvjax.kv.attention import paged_decode_attention_reference
from pallas_kernels.paged_decode import Schedule
from pallas_kernels.sparse_decode import (
    selected_token_mask,
    sparse_decode_attention,
    sparse_decode_attention_reference,
)


def make_case(seed: int, kv_lens: list[int], num_read: int, *, page_size: int,
              num_kv_heads: int, group: int, head_dim: int, dtype) -> dict:
    """q, NaN-poisoned pages, permuted tables and a Quest-style selection of num_read pages."""
    rng = np.random.default_rng(seed)
    block_tables, _ = paged_layout(rng, kv_lens, page_size)
    kv_lens_arr = jnp.asarray(kv_lens, jnp.int32)
    scores = jnp.asarray(rng.standard_normal(block_tables.shape), jnp.float32)
    # A budget above the table width reads every page (as dispatch.quest_sparse_decode clamps).
    num_read = min(num_read, block_tables.shape[1])
    page_indices, _ = quest.select_pages(scores, kv_lens_arr, page_size, num_read)
    read = np.asarray(selected_token_mask(jnp.asarray(block_tables), kv_lens_arr, page_indices,
                                          page_size))  # [B, W*P]
    num_pages = block_tables.max() + 4
    reads_slot = np.zeros((num_pages, page_size), bool)
    rows, tokens = np.nonzero(read)
    reads_slot[block_tables[rows, tokens // page_size], tokens % page_size] = True
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pages, v_pages = rng.standard_normal(shape), rng.standard_normal(shape)
    k_pages[~reads_slot], v_pages[~reads_slot] = np.nan, np.nan
    q = rng.standard_normal((len(kv_lens), num_kv_heads * group, head_dim))
    return dict(q=jnp.asarray(q, dtype), k_pages=jnp.asarray(k_pages, dtype),
                v_pages=jnp.asarray(v_pages, dtype), block_tables=jnp.asarray(block_tables),
                kv_lens=kv_lens_arr, page_indices=page_indices)


def check_against_reference(case: dict, dtype, **kwargs) -> jax.Array:
    options = {k: kwargs[k] for k in ("soft_cap",) if k in kwargs}
    want = sparse_decode_attention_reference(**case, **options)
    got = sparse_decode_attention(**case, interpret=INTERPRET, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOLERANCES[dtype])
    return got


def lengths(page_size: int) -> list[int]:
    """One token, fewer pages than the budget, non-multiples and a multiple of P, a padded row."""
    return [1, 2 * page_size + 3, 0, 6 * page_size, 5 * page_size - 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [4, 16])
def test_matches_reference(page_size, group, dtype):
    case = make_case(page_size + group, lengths(page_size), 3, page_size=page_size,
                     num_kv_heads=2, group=group, head_dim=64, dtype=dtype)
    check_against_reference(case, dtype, pages_per_compute_block=block_pages(page_size, 2),
                            num_splits=2)


@pytest.mark.timeout(120)
def test_soft_cap_and_split_k():
    case = make_case(5, [1, 29, 6, 0, 97], 7, page_size=4, num_kv_heads=2, group=2,
                     head_dim=64, dtype=jnp.float32)
    for splits in (1, 3):
        check_against_reference(case, jnp.float32, soft_cap=3.0, num_splits=splits,
                                pages_per_compute_block=block_pages(4, 2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pipelined_matches_reference(dtype):
    """The TPU schedule: pages DMA'd through selection and table, positions built per page."""
    case = make_case(11, lengths(4), 3, page_size=4, num_kv_heads=2, group=3, head_dim=64,
                     dtype=dtype)
    check_against_reference(case, dtype, soft_cap=30.0, pages_per_compute_block=2,
                            num_splits=2, schedule=runnable(Schedule.PIPELINED))


@pytest.mark.timeout(120)
def test_equals_quest_narrowed_dense_attention():
    """The engine's Quest path (narrowed tables, dense decode) reads the same tokens."""
    case = make_case(7, [45, 3, 64, 17], 3, page_size=8, num_kv_heads=1, group=4,
                     head_dim=64, dtype=jnp.float32)
    got = sparse_decode_attention(**case, interpret=INTERPRET)
    chosen = jnp.take_along_axis(case["block_tables"], case["page_indices"], axis=1)
    # select_pages always keeps the last page, so the narrowed length is the selected tokens.
    _, lens = quest.select_pages(jnp.zeros(case["block_tables"].shape), case["kv_lens"], 8, 3)
    want = paged_decode_attention_reference(case["q"], case["k_pages"], case["v_pages"],
                                            chosen, lens)
    np.testing.assert_allclose(got, want, **TOLERANCES[jnp.float32])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_read", [1, 4, 16])
@pytest.mark.parametrize("page_size", [4, 16])
def test_full_product(page_size, num_read, dtype):
    case = make_case(page_size * num_read, [1, 5 * page_size + 1, 0, 7, 12 * page_size],
                     num_read, page_size=page_size, num_kv_heads=3, group=2, head_dim=64,
                     dtype=dtype)
    for pages, splits in ((1, 4), (4, 1)):
        check_against_reference(case, dtype, soft_cap=30.0, num_splits=splits,
                                pages_per_compute_block=block_pages(page_size, pages))


def test_rejects_bad_selection():
    case = make_case(0, [9], 2, page_size=4, num_kv_heads=2, group=2, head_dim=64,
                     dtype=jnp.float32)
    with pytest.raises(ValueError, match="page_indices"):
        sparse_decode_attention(**{**case, "page_indices": case["page_indices"][0]},
                                interpret=True)
    with pytest.raises(ValueError, match="page_indices"):
        sparse_decode_attention(**{**case, "page_indices": case["page_indices"] * 1.0},
                                interpret=True)
