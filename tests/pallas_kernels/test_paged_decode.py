"""The paged decode kernel (CPU, Pallas interpret mode) against the float32 jnp oracle.

Every case uses a randomly permuted block table and fills every slot that holds no token (pages
no sequence owns, the tail of each last page, block-table entries past a length) with NaN, so a
read the lengths do not allow shows up as NaN in the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_decode import (
    Schedule,
    default_schedule,
    paged_decode_attention,
    paged_decode_attention_reference,
)

TOLERANCES = {
    jnp.float32: dict(atol=2e-5, rtol=2e-5),
    # The kernel rounds the softmax weights to bf16 before the value matmul.
    jnp.bfloat16: dict(atol=3e-2, rtol=3e-2),
}

# Interpreted on the CPU, compiled on a GPU or TPU (scripts/device_check.sh runs this file there).
INTERPRET = jax.default_backend() == "cpu"


def runnable(schedule: Schedule) -> Schedule:
    """Each schedule compiles only on its own platform; the interpreter runs both."""
    if not INTERPRET and schedule is not default_schedule():
        pytest.skip(f"the {schedule.value} schedule does not compile on {jax.default_backend()}")
    return schedule


def block_pages(page_size: int, pages: int) -> int:
    """Pages per compute block: as asked, or enough for Triton's 16-token dots when compiled."""
    return pages if INTERPRET else max(pages, 16 // page_size)


def make_case(seed: int, kv_lens: list[int], *, page_size: int, num_kv_heads: int, group: int,
              head_dim: int, dtype) -> dict:
    """q [B, N, D], NaN-poisoned pages [num_pages, P, K, D], permuted block tables [B, Pmax]."""
    rng = np.random.default_rng(seed)
    b = len(kv_lens)
    pmax = -(-max(kv_lens) // page_size) + 1  # One stale entry past the longest sequence.
    num_pages = b * pmax + 3
    block_tables = rng.permutation(num_pages)[:b * pmax].reshape(b, pmax).astype(np.int32)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pages, v_pages = rng.standard_normal(shape), rng.standard_normal(shape)
    holds_token = np.zeros((num_pages, page_size), bool)
    for row, length in enumerate(kv_lens):
        for t in range(length):
            holds_token[block_tables[row, t // page_size], t % page_size] = True
    k_pages[~holds_token] = np.nan
    v_pages[~holds_token] = np.nan
    q = rng.standard_normal((b, num_kv_heads * group, head_dim))
    return dict(q=jnp.asarray(q, dtype), k_pages=jnp.asarray(k_pages, dtype),
                v_pages=jnp.asarray(v_pages, dtype), block_tables=jnp.asarray(block_tables),
                kv_lens=jnp.asarray(kv_lens, jnp.int32))


def check_against_reference(case: dict, dtype, **kwargs) -> None:
    options = {k: kwargs[k] for k in ("soft_cap", "sliding_window") if k in kwargs}
    want = paged_decode_attention_reference(**case, **options)
    got = paged_decode_attention(**case, interpret=INTERPRET, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOLERANCES[dtype])


def lengths(page_size: int) -> list[int]:
    """A single token, non-multiples of the page size, an exact multiple, a padded row."""
    return [1, 2 * page_size + 3, 0, 3 * page_size, page_size - 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [4, 16])
def test_looped_matches_reference(page_size, group, dtype):
    case = make_case(page_size + group, lengths(page_size), page_size=page_size,
                     num_kv_heads=2, group=group, head_dim=64, dtype=dtype)
    check_against_reference(case, dtype, schedule=runnable(Schedule.LOOPED),
                            pages_per_compute_block=block_pages(page_size, 2), num_splits=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page_size,dtype", [(4, jnp.float32), (16, jnp.bfloat16)],
                         ids=["p4-f32", "p16-bf16"])
def test_pipelined_matches_reference(page_size, dtype):
    case = make_case(7, lengths(page_size), page_size=page_size, num_kv_heads=2, group=3,
                     head_dim=64, dtype=dtype)
    check_against_reference(case, dtype, schedule=runnable(Schedule.PIPELINED),
                            pages_per_compute_block=block_pages(page_size, 2), num_splits=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_head_dim_128_default_knobs(schedule):
    case = make_case(3, [37, 5], page_size=16, num_kv_heads=1, group=4, head_dim=128,
                     dtype=jnp.float32)
    check_against_reference(case, jnp.float32, schedule=runnable(schedule))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_soft_cap_and_sliding_window(schedule):
    case = make_case(5, [1, 29, 6, 0], page_size=4, num_kv_heads=2, group=2, head_dim=64,
                     dtype=jnp.float32)
    check_against_reference(case, jnp.float32, schedule=runnable(schedule), soft_cap=3.0,
                            sliding_window=9, pages_per_compute_block=block_pages(4, 2),
                            num_splits=3)


@pytest.mark.timeout(120)
def test_split_k_does_not_change_the_result():
    """Long and short rows together: splits past a short row's end must contribute nothing."""
    case = make_case(11, [97, 3, 64], page_size=4, num_kv_heads=1, group=2, head_dim=64,
                     dtype=jnp.float32)
    outs = [paged_decode_attention(**case, pages_per_compute_block=block_pages(4, 2),
                                   num_splits=splits, interpret=INTERPRET) for splits in (1, 5)]
    want = paged_decode_attention_reference(**case)
    for out in outs:
        np.testing.assert_allclose(out, want, **TOLERANCES[jnp.float32])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_full_product(schedule, page_size, group, dtype):
    case = make_case(page_size * group, [1, 5 * page_size + 1, 0, 7, 8 * page_size],
                     page_size=page_size, num_kv_heads=3, group=group, head_dim=64, dtype=dtype)
    for pages, splits in ((1, 4), (4, 1)):
        check_against_reference(case, dtype, schedule=runnable(schedule),
                                pages_per_compute_block=block_pages(page_size, pages),
                                num_splits=splits, soft_cap=30.0, sliding_window=3 * page_size)


def test_rejects_bad_arguments():
    case = make_case(0, [5], page_size=4, num_kv_heads=2, group=2, head_dim=64,
                     dtype=jnp.float32)
    with pytest.raises(ValueError, match="not a multiple of kv heads"):
        paged_decode_attention(**{**case, "q": case["q"][:, :3]}, interpret=True)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(**case, sliding_window=0, interpret=True)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(**case, num_splits=0, interpret=True)
    with pytest.raises(ValueError, match="power-of-2"):
        paged_decode_attention(**case, pages_per_compute_block=3, schedule=Schedule.LOOPED)



@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_traced_window_serves_windowed_and_global_layers(schedule):
    """The engine's per-layer window is a traced int32 scalar: one compiled call gives the
    windowed oracle for a window > 0 and the global one for 0."""
    case = make_case(6, [1, 29, 6, 0, 17], page_size=4, num_kv_heads=2, group=2, head_dim=64,
                     dtype=jnp.float32)
    run = jax.jit(lambda window: paged_decode_attention(
        **case, sliding_window=window, schedule=runnable(schedule),
        pages_per_compute_block=block_pages(4, 2), num_splits=2, interpret=INTERPRET))
    for window, options in ((9, dict(sliding_window=9)), (0, {})):
        want = paged_decode_attention_reference(**case, **options)
        np.testing.assert_allclose(run(jnp.int32(window)), want, **TOLERANCES[jnp.float32])
