"""KV-semantic tracing: the trace is valid Trace Event Format and reconciles with the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax import EngineConfig, PreemptionMode, SamplingParams
from kvjax.bench.trace_report import analyse, validate_trace
from kvjax.engine.engine import Engine
from kvjax.memory.tiers import TierConfig
from kvjax.memory.transfer import TransferState, is_legal_transition
from kvjax.testing import tiny_model
from kvjax.trace import NULL_TRACER

# A small pool under prefix-sharing traffic: hits, evictions, spills and preemptions.
BASE = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=16,
            max_prefill_seqs=1, min_chunk_bucket=16, num_pages=20)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def traced(model):
    page_bytes = model.config.kv_bytes_per_token(model.dtype) * BASE["page_size"]
    engine = Engine(model, EngineConfig(**BASE, trace=True,
                                        preemption_mode=PreemptionMode.RECOMPUTE,
                                        tiers=TierConfig(host_bytes=64 * page_bytes)))
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(0, 120, size=12)]
    prompts = [shared + [int(t) for t in rng.integers(0, 120, size=14)] for _ in range(6)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.generate(prompts[:4], params)
    engine.generate(prompts, params)
    engine.update_weights(model.params, "v2")
    engine.generate(prompts[:1], params)
    return engine


def test_tracing_off_records_nothing(model):
    engine = Engine(model, EngineConfig(**BASE))
    assert engine.tracer is NULL_TRACER and engine.scheduler.tracer is NULL_TRACER
    assert engine.kv_cache.tracer is NULL_TRACER and engine.allocator.tracer is NULL_TRACER
    NULL_TRACER.emit("allocate", "page", "pages/device", page=0)
    NULL_TRACER.span("step", "step", "step", 0.0, 1.0)
    NULL_TRACER.counter("pages", device=1)
    assert NULL_TRACER.events == []
    with pytest.raises(ValueError):
        engine.export_trace("unused.json")


def test_trace_is_valid_trace_event_format(traced, tmp_path):
    path = tmp_path / "trace.json"
    traced.export_trace(path)
    trace = json.loads(path.read_text())
    assert validate_trace(trace) == []
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"arrive", "schedule", "finish", "allocate", "free", "step", "pages"} <= names


def test_page_events_reconcile_with_the_allocator(traced):
    t = traced.tracer
    # A page leaves the free list on allocation and comes back on a free; an eviction ends a
    # cached page's life and its allocation starts the next.
    off_free_list = traced.allocator.num_pages - traced.allocator.num_free_pages() + \
        traced.allocator.prefix_cache.num_evictable()
    assert t.count("allocate") - t.count("free") - t.count("evict") == off_free_list
    assert t.count("evict") == traced.allocator.stats.evictions


def test_request_and_prefix_events_reconcile_with_engine_stats(traced):
    t = traced.tracer
    assert t.count("preempt") == traced.stats["preemptions"]
    assert t.count("arrive") == t.count("finish") == 11
    assert t.count("weights_update") == traced.stats["weight_updates"] == 1
    assert t.count("prefix_hit") + t.count("prefix_miss") == \
        traced.allocator.stats.prefix_queries == t.count("prefix_lookup")
    lookups = [e.args for e in t.events if e.name == "prefix_lookup"]
    assert sum(a["hit_pages"] for a in lookups) == traced.allocator.stats.prefix_hits
    assert all(a["hit_pages"] <= len(a["wanted"]) for a in lookups)


def test_transfer_states_follow_the_state_machine(traced):
    per_transfer: dict[int, list[str]] = {}
    for e in traced.tracer.events:
        if e.cat == "transfer":
            per_transfer.setdefault(e.args["transfer_id"], []).append(e.name)
    assert per_transfer, "the traffic should spill pages to the host tier"
    for states in per_transfer.values():
        assert states[0] == TransferState.QUEUED.value
        for a, b in zip(states, states[1:], strict=False):
            assert is_legal_transition(TransferState(a), TransferState(b))


def test_report_analyses(traced):
    report = analyse(traced.tracer.to_chrome())
    assert 0.0 <= report["prefix_hit_rate"]["overall"] <= 1.0
    assert report["page_lifetime_s"]["count"] > 0
    assert report["num_steps"] > 0
