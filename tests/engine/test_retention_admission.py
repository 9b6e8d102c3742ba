"""Admission under a retention budget: a pool of the same size serves more sequences at once.

A sequence under an evicting policy never holds much more than its budget, so the same pool
runs more of them concurrently, and a request longer than the pool fits when its bounded
footprint does. Oracle: the pool's page accounting (no page leaks, every request finishes
with all its tokens) and the retention=none run on the same pool.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason
from kvjax.testing import tiny_model

P = 4
POOL = dict(page_size=P, max_num_batched_tokens=16, max_prefill_chunk=8, min_chunk_bucket=8,
            max_num_seqs=8, max_prefill_seqs=2, num_pages=24, max_model_len=128)
STREAMING = dict(retention="streaming", retention_budget=12)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompt_of(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 120, size=length)]


def serve(model, num_requests: int, prompt_len: int, max_new: int, **config):
    """(peak running sequences, mean decoding rows per step, engine) for requests at t=0."""
    engine = Engine(model, EngineConfig(**{**POOL, **config}))
    for i in range(num_requests):
        engine.add_request(f"r{i}", prompt_of(prompt_len, seed=i),
                           SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    running, decoding, outputs = [], [], []
    while engine.has_unfinished():
        outputs += engine.step()
        running.append(engine.num_running)
        decoding.append(sum(s.num_pending == 1 for s in engine.scheduler.running))
    assert sorted(o.request_id for o in outputs) == [f"r{i}" for i in range(num_requests)]
    assert all(len(o.outputs[0].token_ids) == max_new
               and o.outputs[0].finish_reason is FinishReason.LENGTH for o in outputs)
    assert engine.allocator.num_used_pages() == 0, "pages leaked"
    return max(running), float(np.mean(decoding)), engine


def test_streaming_runs_more_sequences_at_once_in_the_same_pool(model):
    # 6 requests of 48 + 24 tokens: 18 pages each in a 24-page pool.
    exact_peak, exact_decoding, exact = serve(model, 6, 48, 24)
    peak, decoding, retained = serve(model, 6, 48, 24, **STREAMING)
    assert peak > exact_peak
    assert decoding > 1.5 * exact_decoding
    assert retained.stats["steps"] < exact.stats["steps"]
    assert retained.stats["preemptions"] < exact.stats["preemptions"]


def test_a_request_longer_than_the_pool_fits_under_a_rolling_budget(model):
    # 100 + 20 tokens need 30 pages; streaming holds at most 6 + 3 of them at once.
    with pytest.raises(ValueError, match="needs 30 KV pages but the pool has 24"):
        Engine(model, EngineConfig(**POOL)).add_request(
            "long", prompt_of(100, seed=0), SamplingParams(max_new_tokens=20))
    _, _, engine = serve(model, 2, 100, 20, **STREAMING)
    assert engine.retention.policy.budget < 100


def test_snapkv_is_still_sized_by_its_whole_prefill(model):
    engine = Engine(model, EngineConfig(**POOL, retention="snapkv", retention_budget=16,
                                        retention_options={"window": 4}))
    with pytest.raises(ValueError, match="needs 30 KV pages"):
        engine.add_request("long", prompt_of(100, seed=0), SamplingParams(max_new_tokens=20))


def test_preemption_under_retention_when_even_bounded_sequences_overflow(model):
    # 16-token chunks: up to 11 pages per h2o sequence, 6 sequences, 12 pages.
    _, _, engine = serve(model, 6, 30, 12, retention="h2o", retention_budget=12, num_pages=12,
                         max_prefill_chunk=16, min_chunk_bucket=16, max_num_batched_tokens=32)
    assert engine.stats["preemptions"] > 0, "the pool was meant to force preemption"
