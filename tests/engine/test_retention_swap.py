"""A sequence retention compacted survives swap preemption: it comes back with the same tokens.

Oracle: the same engine with a pool large enough that nothing is preempted. Prompts are
prefilled whole in both runs (an evicting policy's choice depends on chunking), so a swap that
restores the compacted pages and the policy's record exactly gives identical greedy tokens,
through the plain host swap space or through the host tier. A tier copy that comes back short
(its transfers fail) cannot be recomputed from the token list: the sequence restarts instead.
"""

from __future__ import annotations

import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.config import PreemptionMode
from kvjax.engine.engine import Engine

P = 4
PROMPTS = [[7, 21, 3, 90, 14, 60, 33, 8, 5, 41, 77, 9, 10, 11, 12],
           [2, 99, 64, 18, 30, 11, 45, 70, 6, 81, 19, 9, 10, 11, 12],
           [7, 21, 3, 90, 14, 60, 33, 8, 12, 50, 3, 9, 10, 11, 12]]
POLICIES = {
    "streaming": dict(retention="streaming", retention_options=dict(num_sinks=2)),
    "h2o": dict(retention="h2o", retention_options=dict(num_recent=3)),
    "snapkv": dict(retention="snapkv", retention_options=dict(window=3, kernel=3)),
}


@pytest.fixture(scope="module")
def tiny():
    from kvjax.testing import tiny_model

    return tiny_model()


def _serve(model, policy: str, num_pages: int, tiers=None):
    from kvjax.memory.tiers import TierConfig

    engine = Engine(model, EngineConfig(
        tiers=tiers or TierConfig(),
        page_size=P, num_pages=num_pages, max_num_seqs=3, max_num_batched_tokens=32,
        max_prefill_chunk=32, min_chunk_bucket=32, max_model_len=32, retention_budget=10,
        enable_prefix_cache=False,
        preemption_mode=PreemptionMode.SWAP, **POLICIES[policy]))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, ignore_eos=True))
    return engine, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("policy", [
    pytest.param("h2o", marks=pytest.mark.slow),
    pytest.param("streaming", marks=pytest.mark.slow),
    pytest.param("snapkv", marks=pytest.mark.slow),
])
def test_swapped_compacted_sequences_match_a_run_without_preemption(tiny, policy):
    _, want = _serve(tiny, policy, num_pages=40)
    engine, got = _serve(tiny, policy, num_pages=7)
    assert engine.stats["swaps_out"] >= 1 and engine.stats["swaps_in"] >= 1
    assert engine.retention.stats["evictions"] >= 1
    assert got == want
    assert engine.allocator.num_used_pages() == 0


def _host_tier(**faults):
    from kvjax.memory.tiers import TierConfig
    from kvjax.memory.transfer import FaultConfig, TransferKind

    return TierConfig(host_bytes=1 << 20, faults=FaultConfig(
        kinds=(TransferKind.HOST_TO_DEVICE,), **faults) if faults else FaultConfig())


@pytest.mark.parametrize("policy", ["h2o", pytest.param("snapkv", marks=pytest.mark.slow)])
def test_compacted_sequences_swap_through_the_host_tier(tiny, policy):
    _, want = _serve(tiny, policy, num_pages=40)
    engine, got = _serve(tiny, policy, num_pages=7, tiers=_host_tier())
    assert engine.stats["swaps_out"] >= 1 and engine.stats["swaps_in"] >= 1
    assert engine.stats["bytes_host_to_device"] > 0
    assert engine.retention.stats["evictions"] >= 1
    assert got == want
    assert engine.allocator.num_used_pages() == 0


def test_a_compacted_sequence_whose_tier_copy_is_lost_restarts(tiny):
    engine, got = _serve(tiny, "h2o", num_pages=7, tiers=_host_tier(fail_fraction=1.0))
    assert engine.stats["swaps_out"] >= 1
    assert engine.stats["tier_swap_restarts"] >= 1
    assert [len(t) for t in got] == [10] * len(PROMPTS)
    assert engine.allocator.num_used_pages() == 0
