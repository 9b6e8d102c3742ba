"""The chunked prefill kernel (CPU, Pallas interpret mode) against the float32 jnp oracle, and
the engine with attention_impl=PALLAS against the cache-free dense forward pass.

Block tables are randomly permuted and every slot that holds no token is NaN, so a read the
lengths do not allow shows up as NaN in the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.step import AttentionImpl
from kvjax.testing import greedy_reference, tiny_model
from pallas_kernels.paged_decode import Schedule, default_schedule
from pallas_kernels.ragged_prefill import (
    paged_prefill_attention_reference,
    ragged_prefill_attention,
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


def make_case(seed: int, kv_lens: list[int], q_lens: list[int], chunk: int, *, page_size: int,
              num_kv_heads: int, group: int, head_dim: int, dtype) -> dict:
    """q [B, C, N, D], NaN-poisoned pages [num_pages, P, K, D], permuted block tables."""
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
    q = rng.standard_normal((b, chunk, num_kv_heads * group, head_dim))
    return dict(q=jnp.asarray(q, dtype), k_pages=jnp.asarray(k_pages, dtype),
                v_pages=jnp.asarray(v_pages, dtype), block_tables=jnp.asarray(block_tables),
                kv_lens=jnp.asarray(kv_lens, jnp.int32), q_lens=jnp.asarray(q_lens, jnp.int32))


def check_against_reference(case: dict, dtype, **kwargs) -> None:
    options = {k: kwargs[k] for k in ("soft_cap", "sliding_window") if k in kwargs}
    want = paged_prefill_attention_reference(**case, **options)
    got = ragged_prefill_attention(**case, interpret=INTERPRET, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOLERANCES[dtype])


def ragged_rows(page_size: int) -> tuple[list[int], list[int]]:
    """(kv_lens, q_lens), chunk 8: a one-token prompt, a first chunk, a later partial chunk
    ending mid-page, a full chunk after an exact page multiple, and a padded row."""
    return ([1, 6, 2 * page_size + 3, 3 * page_size + 8, 0], [1, 6, 5, 8, 0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [4, 16])
def test_looped_matches_reference(page_size, group, dtype):
    kv_lens, q_lens = ragged_rows(page_size)
    case = make_case(page_size + group, kv_lens, q_lens, 8, page_size=page_size, num_kv_heads=2,
                     group=group, head_dim=64, dtype=dtype)
    check_against_reference(case, dtype, schedule=runnable(Schedule.LOOPED), block_q=4,
                            pages_per_compute_block=block_pages(page_size, 2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page_size,dtype", [(4, jnp.float32), (16, jnp.bfloat16)],
                         ids=["p4-f32", "p16-bf16"])
def test_pipelined_matches_reference(page_size, dtype):
    kv_lens, q_lens = ragged_rows(page_size)
    case = make_case(7, kv_lens, q_lens, 8, page_size=page_size, num_kv_heads=2, group=3,
                     head_dim=64, dtype=dtype)
    check_against_reference(case, dtype, schedule=runnable(Schedule.PIPELINED), block_q=4,
                            pages_per_compute_block=block_pages(page_size, 2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_head_dim_128_default_knobs(schedule):
    case = make_case(3, [40, 7], [5, 7], 7, page_size=16, num_kv_heads=1, group=4,
                     head_dim=128, dtype=jnp.float32)
    check_against_reference(case, jnp.float32, schedule=runnable(schedule))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_soft_cap_and_sliding_window(schedule):
    case = make_case(5, [1, 29, 12, 0], [1, 8, 3, 0], 8, page_size=4, num_kv_heads=2, group=2,
                     head_dim=64, dtype=jnp.float32)
    check_against_reference(case, jnp.float32, schedule=runnable(schedule), soft_cap=3.0,
                            sliding_window=6, block_q=2,
                            pages_per_compute_block=block_pages(4, 1))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_full_product(schedule, page_size, group, dtype):
    kv_lens = [1, 12, 5 * page_size + 1, 8 * page_size, 0, 16]
    q_lens = [1, 12, 11, 16, 0, 2]
    case = make_case(page_size * group, kv_lens, q_lens, 16, page_size=page_size,
                     num_kv_heads=3, group=group, head_dim=64, dtype=dtype)
    for block_q, pages in ((16, 1), (4, 4)):
        check_against_reference(case, dtype, schedule=runnable(schedule), block_q=block_q,
                                pages_per_compute_block=block_pages(page_size, pages),
                                soft_cap=30.0,
                                sliding_window=3 * page_size)


def test_rejects_bad_arguments():
    case = make_case(0, [5], [5], 8, page_size=4, num_kv_heads=2, group=2, head_dim=64,
                     dtype=jnp.float32)
    with pytest.raises(ValueError, match="q_lens"):
        ragged_prefill_attention(**{**case, "q_lens": case["q_lens"][:, None]}, interpret=True)
    with pytest.raises(ValueError, match="block_q"):
        ragged_prefill_attention(**case, block_q=0, interpret=True)
    with pytest.raises(ValueError, match="soft_cap"):
        ragged_prefill_attention(**case, soft_cap=-1.0, interpret=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_pallas_gives_the_reference_greedy_tokens():
    """Chunked prefill (chunks of 8 over pages of 4) then decode through the kernels, exact,
    int8 and int8 with a scale and zero per 4 channels."""
    model = tiny_model()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 120, size=n)] for n in (3, 13, 21)]
    max_new = 6
    base = dict(page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=16,
                max_prefill_chunk=8, min_chunk_bucket=8)
    got = {}
    codecs = {"none": ("none", {}), "int8": ("int8", {}), "int8-g4": ("int8", {"group": 4})}
    for codec, (name, options) in codecs.items():
        for impl in (AttentionImpl.REFERENCE, AttentionImpl.PALLAS):
            engine = Engine(model, EngineConfig(attention_impl=impl, kv_codec=name,
                                                kv_codec_options=options, **base))
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new))
            got[codec, impl] = [o.outputs[0].token_ids for o in outs]
        # int8 decode reads codes in the quantized kernel; its prefill dequantizes in jnp.
        assert got[codec, AttentionImpl.PALLAS] == got[codec, AttentionImpl.REFERENCE], codec
    assert got["none", AttentionImpl.PALLAS] == [greedy_reference(model, p, max_new)
                                                 for p in prompts]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_traced_window_serves_windowed_and_global_layers(schedule):
    """The engine's per-layer window is a traced int32 scalar: one compiled call gives the
    windowed oracle for a window > 0 and the global one for 0."""
    case = make_case(8, [1, 29, 12, 0], [1, 8, 3, 0], 8, page_size=4, num_kv_heads=2, group=2,
                     head_dim=64, dtype=jnp.float32)
    run = jax.jit(lambda window: ragged_prefill_attention(
        **case, sliding_window=window, schedule=runnable(schedule), block_q=2,
        pages_per_compute_block=block_pages(4, 1), interpret=INTERPRET))
    for window, options in ((6, dict(sliding_window=6)), (0, {})):
        want = paged_prefill_attention_reference(**case, **options)
        np.testing.assert_allclose(run(jnp.int32(window)), want, **TOLERANCES[jnp.float32])
