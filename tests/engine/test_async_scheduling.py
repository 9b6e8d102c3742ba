"""Asynchronous scheduling: step t+1 is scheduled and dispatched before step t's tokens are read.

Oracle: the cache-free dense greedy reference, and the same engine with async_scheduling off.
Each case stresses what the overlap could break (vLLM hit this class of bug): preemption with a
token in flight (recompute and swap), scrubbing, stop tokens, aborts, n > 1 forks and weight
updates mid-flight; no token may be duplicated, lost or computed from stale KV.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import EngineConfig, PreemptionMode, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason, WeightUpdatePolicy
from kvjax.testing import greedy_reference, tiny_model

NEW = 10
BASE = dict(page_size=4, max_num_batched_tokens=32, max_prefill_chunk=16, max_num_seqs=6,
            debug_provenance=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def workload(model):
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(0, 120, size=12)]
    prompts = [(shared if i % 2 else []) + [int(t) for t in rng.integers(0, 120, size=n)]
               for i, n in enumerate((5, 9, 3, 14, 7, 11))]
    return prompts, [greedy_reference(model, p, NEW) for p in prompts]


def generate(model, prompts, *, is_async: bool, **overrides):
    engine = Engine(model, EngineConfig(**{**BASE, **overrides}, async_scheduling=is_async))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    return engine, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name,overrides", [
    pytest.param("plenty", dict(num_pages=128), marks=pytest.mark.slow),
    ("recompute", dict(num_pages=14)),
    ("swap", dict(num_pages=14, preemption_mode=PreemptionMode.SWAP)),
    pytest.param("scrub", dict(num_pages=14, scrub_freed_pages=True), marks=pytest.mark.slow),
])
def test_async_matches_sync_and_the_reference(model, workload, name, overrides):
    prompts, refs = workload
    async_engine, got_async = generate(model, prompts, is_async=True, **overrides)
    _, got_sync = generate(model, prompts, is_async=False, **overrides)
    assert got_async == refs
    assert got_sync == refs
    if name != "plenty":
        assert async_engine.stats["preemptions"] > 0, "the pool was meant to force preemption"
    if name == "swap":
        assert async_engine.stats["swaps_in"] > 0
    assert async_engine.stats["stale_kv_reads"] == 0
    assert async_engine.allocator.num_used_pages() == 0


def test_overlap_really_happens(model, workload):
    """Each step dispatches the next before the previous one's tokens are read."""
    prompts, _ = workload
    engine = Engine(model, EngineConfig(**BASE, num_pages=128))
    for i, p in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW))
    seen = []
    for _ in range(4):
        engine.step()
        seen.append(engine.core.has_step_in_flight)
    assert all(seen)
    engine.drain()
    assert not engine.core.has_step_in_flight


def test_stop_token_ends_the_output_at_the_stop(model, workload):
    """The token sampled after a stop (already in flight) is never emitted."""
    prompts, refs = workload
    stop = refs[0][3]
    for is_async in (True, False):
        engine = Engine(model, EngineConfig(**BASE, num_pages=128, async_scheduling=is_async))
        (out,) = engine.generate([prompts[0]],
                                 SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,)))
        first = refs[0].index(stop)
        assert out.outputs[0].token_ids == refs[0][:first + 1]
        assert out.outputs[0].finish_reason is FinishReason.STOP


def test_abort_with_a_step_in_flight_and_parallel_samples(model, workload):
    prompts, refs = workload
    engine = Engine(model, EngineConfig(**BASE, num_pages=128))
    engine.add_request("keep", prompts[1], SamplingParams(max_new_tokens=NEW))
    engine.add_request("pair", prompts[2], SamplingParams(max_new_tokens=NEW, n=2))
    engine.add_request("gone", prompts[3], SamplingParams(max_new_tokens=NEW))
    for _ in range(3):
        engine.step()
    engine.abort("gone")
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
    assert done["gone"].outputs[0].finish_reason is FinishReason.ABORT
    assert done["gone"].outputs[0].token_ids == refs[3][:len(done["gone"].outputs[0].token_ids)]
    assert done["keep"].outputs[0].token_ids == refs[1]
    assert [o.token_ids for o in done["pair"].outputs] == [refs[2], refs[2]]  # greedy: equal
    assert engine.allocator.num_used_pages() == 0


@pytest.mark.parametrize("policy", [
    WeightUpdatePolicy.RECOMPUTE,
    pytest.param(WeightUpdatePolicy.FINISH_OLD, marks=pytest.mark.slow),
])
def test_weight_update_mid_flight_matches_sync(model, workload, policy):
    prompts, _ = workload
    new = tiny_model(seed=1)
    results = []
    for is_async in (True, False):
        engine = Engine(model, EngineConfig(**BASE, num_pages=64, async_scheduling=is_async))
        for i, p in enumerate(prompts[:3]):
            engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW))
        for _ in range(3):
            engine.step()
        engine.update_weights(new.params, "v1", in_flight=policy)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
        assert engine.stats["stale_kv_reads"] == 0
        results.append(done)
    assert results[0] == results[1]


@pytest.mark.parametrize("is_async", [True, False])
def test_compile_count_flat_after_warmup(model, workload, is_async):
    prompts, _ = workload
    # No shared pages, so no copy-on-write copies (their programs compile on first use).
    engine = Engine(model, EngineConfig(**BASE, num_pages=14, async_scheduling=is_async,
                                        preemption_mode=PreemptionMode.SWAP,
                                        enable_prefix_cache=False))
    compiled = engine.warmup()
    engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    engine.generate(prompts[::-1], SamplingParams(max_new_tokens=NEW))
    assert engine.stats["preemptions"] > 0 and engine.stats["swaps_in"] > 0
    assert engine.num_compiles == compiled
