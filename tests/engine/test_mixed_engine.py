"""An engine on a mixed-precision pool (kv_codec='mixed'): exact tokens while every row is
exact, and in-place demotion instead of preemption under a tight budget.

The oracle of exactness is the cache-free greedy reference (and the default engine); a tight
budget's outcome is checked against the same engine with the fixed controller, which has only
preemption to make room.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.scheduler.controller import SLO
from kvjax.testing import TINY, greedy_reference, tiny_model

P = 4
TIGHT = dict(page_size=P, num_pages=9, max_num_seqs=3, max_num_batched_tokens=16,
             max_prefill_chunk=16, min_chunk_bucket=16, max_prefill_seqs=1, max_model_len=32,
             enable_prefix_cache=False)
KL_TABLE = {8: 0.01, 4: 0.05}  # nats per token the controller prices int8 / int4 at


def _serve(engine: Engine, prompts, num_new: int, **request) -> dict:
    """request id -> its finished RequestOutput."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=num_new,
                                                           ignore_eos=True),
                           **({k: v(i) for k, v in request.items()}))
    out = {}
    while engine.has_unfinished():
        out.update((o.request_id, o) for o in engine.step() if o.finished)
    return out


def _tokens(outputs: dict) -> dict[str, list[int]]:
    return {r: o.outputs[0].token_ids for r, o in outputs.items()}


def test_mixed_pool_at_exact_serves_the_greedy_reference_with_flat_compiles():
    """Rows written exact and never demoted give the cache-free reference's tokens through the
    pool's words, preempting under the tight budget like any pool; a second identical
    workload compiles nothing new and leaves the ledger empty."""
    model = tiny_model()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 120, 16)] for _ in range(3)]
    engine = Engine(model, EngineConfig(**TIGHT, kv_codec="mixed",
                                        kv_codec_options=dict(group=4)))
    want = {f"r{i}": greedy_reference(model, p, 8) for i, p in enumerate(prompts)}
    assert _tokens(_serve(engine, prompts, 8)) == want
    assert engine.stats["preemptions"] > 0
    compiles = engine.num_compiles
    assert _tokens(_serve(engine, prompts, 8)) == want
    assert engine.num_compiles == compiles
    ledger = engine.scheduler.in_place.ledger
    assert engine.allocator.num_used_pages() == 0 and ledger.bytes_held == 0
    assert ledger.bytes_freed == 0


def test_mixed_pool_options_are_checked():
    with pytest.raises(ValueError, match="write_bits"):
        EngineConfig(**TIGHT, kv_codec="mixed", kv_codec_options=dict(write_bits=(2, 0)))
    with pytest.raises(ValueError, match="colour"):
        EngineConfig(**TIGHT, kv_codec="mixed", kv_codec_options=dict(colour=1))
    with pytest.raises(ValueError, match="NATIVE"):
        EngineConfig(**TIGHT, kv_codec="mixed", attention_impl="native")


def _check_index_names_exact_rows(engine: Engine) -> list[int]:
    """Brute force over every page: each page the prefix cache indexes is at the write class
    in the ledger and each of its rows is exact on the device; returns the demoted pages."""
    cache, ledger = engine.allocator.prefix_cache, engine.scheduler.in_place.ledger
    k_bits, v_bits = np.asarray(engine.kv.k_bits), np.asarray(engine.kv.v_bits)
    slots = range(k_bits.shape[1])  # every page slot of the pool
    demoted = [p for p in slots if (k_bits[:, p] != 0).any() or (v_bits[:, p] != 0).any()
               or ledger.k_bits[p] or ledger.v_bits[p]]
    indexed = [p for p in slots if cache.is_indexed(p)]
    assert indexed and not set(indexed) & set(demoted), (indexed, demoted)
    return demoted


def test_prefix_hits_read_exact_pages_and_never_a_page_demoted_in_place():
    """With the prefix cache: a hit on exact pages gives the cache-free reference's tokens; a
    running sequence's in-place demotion keeps the reused prefix pages it holds exact (and
    indexed) and takes its other demoted pages out of the index, also after a swap brings
    its rows back in fresh pages, so a later request with that prefix hits the reused pages
    only and gives the reference's tokens. Nothing leaks; the last request compiles
    nothing."""
    model = tiny_model()
    rng = np.random.default_rng(1)
    shared = [int(t) for t in rng.integers(1, 120, 3 * P)]
    prompts = [shared + [int(t) for t in rng.integers(1, 120, P)] for _ in range(4)]
    want = [greedy_reference(model, p, 6) for p in prompts]
    engine = Engine(model, EngineConfig(**{**TIGHT, "num_pages": 16, "enable_prefix_cache":
                                           True}, kv_codec="mixed",
                                        kv_codec_options=dict(group=4)))
    ledger = engine.scheduler.in_place.ledger
    hits = engine.metrics()["prefix_hit_tokens"]
    assert _tokens(_serve(engine, prompts[:1], 6)) == {"r0": want[0]}
    assert _tokens(_serve(engine, prompts[1:2], 6)) == {"r0": want[1]}
    assert engine.metrics()["prefix_hit_tokens"] - hits == 3 * P  # the shared pages, exact
    # A third request hits them too, then its other full pages are demoted to int4
    # mid-decode: its own prompt page and its first generated one.
    engine.add_request("c", prompts[2], SamplingParams(max_new_tokens=6, ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.running[0].num_computed < 5 * P:
        engine.step()
    seq = engine.scheduler.running[0]
    assert engine.scheduler.in_place.apply({seq.seq_id: 4}, {seq.seq_id: seq}) == 2
    table = engine.allocator.block_table(seq.seq_id)
    assert _check_index_names_exact_rows(engine) == sorted(table[3:5])
    # Swapped out and back, its rounded rows come back in fresh pages, which stay unindexed.
    engine.pause("c", to_host=True)
    engine.step()
    engine.resume("c")
    while engine.has_unfinished():
        engine.step()
        _check_index_names_exact_rows(engine)
    assert engine.stats["swaps_in"] == 1
    hits, compiles = engine.metrics()["prefix_hit_tokens"], engine.num_compiles
    assert _tokens(_serve(engine, prompts[3:], 6)) == {"r0": want[3]}
    assert engine.metrics()["prefix_hit_tokens"] - hits == 3 * P  # the reused pages, kept
    _check_index_names_exact_rows(engine)
    assert engine.allocator.num_used_pages() == 0 and ledger.bytes_freed > 0
    cached = sum(map(engine.allocator.prefix_cache.is_indexed, range(len(ledger.k_bits))))
    assert ledger.bytes_held == pytest.approx(cached * ledger.write_page_bytes)
    assert engine.num_compiles == compiles


def test_tight_budget_demotes_in_place_instead_of_preempting():
    """Three requests whose pages outgrow a budget of 9 exact pages: the fixed controller
    preempts; the in-place controller re-encodes running sequences' cold pages at int8 / int4
    instead, within each request's KL budget, and preempts none. Nothing compiles after
    warm-up (every DEMOTE op is padded to one width), over two workloads."""
    model = tiny_model(dataclasses.replace(TINY, head_dim=32, name="tiny-d32"))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 120, 16)] for _ in range(3)]
    request = dict(slo=lambda i: SLO(ttft_s=60.0, tpot_s=60.0, kl_budget=0.1),
                   priority=lambda i: i)
    config = dict(TIGHT, kv_codec="mixed", kv_codec_options=dict(group=32))
    fixed = Engine(model, EngineConfig(**config))
    _serve(fixed, prompts, 8, **request)
    assert fixed.stats["preemptions"] > 0
    engine = Engine(model, EngineConfig(**config, controller="inplace",
                                        controller_options=dict(demote_kl=KL_TABLE)))
    ledger = engine.scheduler.in_place.ledger
    compiles = engine.warmup()
    for _ in range(2):
        out = _serve(engine, prompts, 8, **request)
        assert sorted(out) == ["r0", "r1", "r2"]
        assert all(len(t) == 8 for t in _tokens(out).values())
        assert engine.stats["preemptions"] == 0
        assert ledger.bytes_freed > 0 and ledger.bytes_held == 0
        assert engine.allocator.num_used_pages() == 0
        spent = [o.kl_spent for o in out.values()]
        assert max(spent) > 0 and all(kl <= 0.1 + 1e-9 for kl in spent), spent
        assert engine.num_compiles == compiles
