"""Prefill/decode disaggregation: tokens equal a colocated engine's, and the KV really moves.

Oracles: a single colocated engine's tokens and logprobs, and page arithmetic: the decode
engine must compute only the tokens after each prompt's last full page (plus the first
token), so everything before it came through the transfer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax import EngineConfig, KVLayout, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason
from kvjax.router import Arrival, DisaggregatedEngine, SimClock, replay_disaggregated
from kvjax.testing import tiny_model

MAX_NEW = 6
PAGE = 4
CONFIG = EngineConfig(page_size=PAGE, num_pages=128, max_num_batched_tokens=256,
                      max_prefill_chunk=32, min_chunk_bucket=32, max_num_seqs=8,
                      max_prefill_seqs=8)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def colocated(model):
    return Engine(model, CONFIG)


@pytest.fixture(scope="module")
def pair(model):
    """Prefill and decode engines, shared by the tests so each compiles once."""
    return Engine(model, CONFIG, clock=SimClock()), Engine(model, CONFIG, clock=SimClock())


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(0, 120, size=10)]
    lengths = [8, 3, 13, 4, 21, 16, 7][:count]  # page multiples and not
    return [(shared if i % 2 else []) + [int(t) for t in rng.integers(0, 120, size=n)]
            for i, n in enumerate(lengths)]


def _full(n: int) -> int:
    return n // PAGE * PAGE


def test_tokens_match_colocated_and_only_the_tail_is_recomputed(pair, colocated):
    prompts = _prompts(0, 7)
    sampling = SamplingParams(max_new_tokens=MAX_NEW)
    reference = colocated.generate(prompts, sampling)
    prefill, decode = pair
    before = dict(decode.stats), decode.prefix_cache_stats()
    server = DisaggregatedEngine(prefill, decode)
    outputs = server.generate(prompts, sampling)
    for out, ref in zip(outputs, reference, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        np.testing.assert_allclose(out.outputs[0].logprobs, ref.outputs[0].logprobs, atol=1e-5)
        assert out.outputs[0].finish_reason is FinishReason.LENGTH
        assert out.prompt_ids == ref.prompt_ids
    computed = decode.stats["prefill_tokens"] - before[0]["prefill_tokens"]
    assert computed == sum(len(p) - _full(len(p)) + 1 for p in prompts)
    stats = server.stats
    assert stats["transferred_tokens"] + stats["reused_tokens"] == sum(_full(len(p))
                                                                       for p in prompts)
    assert stats["reused_tokens"] > 0  # the shared prefix went over once
    # Admissions hit every full page; pinning the imported pages looked up the reused ones.
    hits = decode.prefix_cache_stats()["prefix_hit_tokens"] - before[1]["prefix_hit_tokens"]
    assert hits == sum(_full(len(p)) for p in prompts) + stats["reused_tokens"]
    assert stats["transfer_bytes"] == stats["transferred_tokens"] // PAGE * decode.kv_bytes_per_page
    assert prefill.stats["decode_tokens"] == 0
    assert decode.allocator.num_used_pages() == prefill.allocator.num_used_pages() == 0


def test_a_prefix_the_decode_engine_holds_is_not_sent_again(pair, colocated):
    prefill, decode = pair
    rng = np.random.default_rng(7)
    shared = [int(t) for t in rng.integers(0, 120, size=12)]
    server = DisaggregatedEngine(prefill, decode)
    sampling = SamplingParams(max_new_tokens=3)
    first = server.generate([shared + [1, 2, 3, 4, 5]], sampling)
    assert server.stats["transferred_tokens"] == 16
    second = server.generate([shared + [9, 8, 7, 6]], sampling)
    assert server.stats["transferred_tokens"] == 16 + 4  # only the page after the shared 12
    reference = colocated.generate([shared + [1, 2, 3, 4, 5], shared + [9, 8, 7, 6]], sampling)
    assert [o.outputs[0].token_ids for o in first + second] == [
        o.outputs[0].token_ids for o in reference]


def test_a_request_that_ends_at_its_first_token_never_moves(pair, colocated):
    prefill, decode = pair
    prompt = _prompts(1, 1)[0]
    (ref,) = colocated.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW))
    first_token = ref.outputs[0].token_ids[0]
    server = DisaggregatedEngine(prefill, decode)
    one, stopped = server.generate(
        [prompt, prompt], [SamplingParams(max_new_tokens=1),
                           SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(first_token,))])
    assert one.outputs[0].token_ids == stopped.outputs[0].token_ids == [first_token]
    assert one.outputs[0].finish_reason is FinishReason.LENGTH
    assert stopped.outputs[0].finish_reason is FinishReason.STOP
    assert server.stats["transfers"] == 0 and not server.has_unfinished()


def test_invalid_pairs_and_requests_raise(model, pair):
    prefill, decode = pair
    with pytest.raises(ValueError, match="provenance"):
        DisaggregatedEngine(prefill, Engine(model, dataclasses.replace(CONFIG, page_size=8)))
    with pytest.raises(ValueError, match="prefix cache"):
        DisaggregatedEngine(prefill, Engine(model, dataclasses.replace(
            CONFIG, enable_prefix_cache=False)))
    with pytest.raises(ValueError, match="paged layout"):
        DisaggregatedEngine(Engine(model, dataclasses.replace(
            CONFIG, kv_layout=KVLayout.CONTIGUOUS, num_pages=None, max_num_seqs=2)), decode)
    server = DisaggregatedEngine(prefill, decode)
    with pytest.raises(ValueError, match="n=2"):
        server.add_request("x", [1, 2, 3], SamplingParams(n=2))
    (bad,) = server.generate([[500]])
    assert "500" in bad.error


def test_replay_on_simulated_clocks_keeps_tokens_and_orders_times(pair, colocated):
    prefill, decode = pair
    prompts = _prompts(2, 5)
    sampling = SamplingParams(max_new_tokens=MAX_NEW)
    reference = colocated.generate(prompts, sampling)
    start = max(prefill.clock(), decode.clock())
    arrivals = [Arrival(f"r{i}", start + 0.02 * i, tuple(p), sampling)
                for i, p in enumerate(prompts)]
    server = DisaggregatedEngine(prefill, decode)
    outputs = {o.request_id: o for o in replay_disaggregated(server, arrivals)}
    for a, ref in zip(arrivals, reference, strict=True):
        out = outputs[a.request_id]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        times = out.token_times
        assert len(times) == MAX_NEW and times[0] == out.first_token_time
        assert a.arrival_time < times[0] and np.all(np.diff(times) >= 0)
    assert server.stats["transfer_time_s"] > 0


def test_warmup_compiles_every_transfer_and_leaves_kv_unchanged(pair, colocated):
    prefill, decode = pair
    server = DisaggregatedEngine(prefill, decode)
    before = np.asarray(decode.kv.k_pages)
    prompts = _prompts(3, 4)
    server.warmup(max_prompt_len=max(len(p) for p in prompts), engines=False)
    np.testing.assert_array_equal(np.asarray(decode.kv.k_pages), before)
    compiled = server.num_compiles
    sampling = SamplingParams(max_new_tokens=3)
    outputs = server.generate(prompts, sampling)
    assert server.num_compiles == compiled and server.stats["transfers"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in colocated.generate(prompts, sampling)]
