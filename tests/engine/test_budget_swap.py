"""Budget schedules through swap preemption and snapshots: a sequence whose table groups
(PyramidKV) or (layer, kv head) tables (AdaKV) keep budgets of their own leaves the device
with every table's pages, cached length and retention record, and comes back with all of them.

Oracle: the same engine with a pool large enough that nothing is preempted. Prompts are
prefilled whole in both runs, so a swap that restores every table exactly gives identical
greedy tokens. Each swap gives the pool back the pages the allocator counts for the sequence,
which equal its tables' kept tokens in pages; it comes back holding as many; nothing leaks;
and a warmed-up engine compiles nothing while it swaps.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.config import PreemptionMode
from kvjax.engine.engine import Engine
from kvjax.memory.block_manager import RELEASED
from kvjax.memory.tiers import TierConfig
from kvjax.scheduler.controller import Decisions
from kvjax.scheduler.preemption import decide_preemption
from kvjax.shapes import pages_for

P = 4
PROMPTS = [[int(t) for t in np.random.default_rng(0).integers(0, 120, size=n)]
           for n in (24, 21, 27)]
NUM_NEW = 24
# Pages of one layer (pyramid) or one kv head of one layer (adakv) per token run: the pool
# admits every request alone but not all three as they decode.
TIGHT = {"pyramid": 28, "adakv": 56}
MODES = {
    "swap": dict(preemption_mode=PreemptionMode.SWAP),
    # The cost model at a link this fast picks swapping for every preemption.
    "auto": dict(preemption_mode=PreemptionMode.AUTO, tiers=TierConfig(
        swap_bandwidth_bytes_per_s=1e15, recompute_tokens_per_s=1.0)),
}


@pytest.fixture(scope="module")
def tiny():
    from kvjax.testing import tiny_model

    return tiny_model()


def _engine(model, schedule: str, num_pages: int, mode: str = "swap") -> Engine:
    # Every prompt (21-27 tokens) prefills in one chunk of the one chunk bucket, 32, so
    # warm-up compiles only the step shapes the runs use.
    return Engine(model, EngineConfig(
        page_size=P, num_pages=num_pages, max_num_seqs=3, max_prefill_seqs=1,
        max_num_batched_tokens=32, max_prefill_chunk=32, min_chunk_bucket=32,
        max_model_len=64, enable_prefix_cache=False, scrub_freed_pages=True,
        retention="snapkv", retention_budget=8, retention_options=dict(window=4, kernel=3),
        retention_schedule=schedule, **MODES[mode]))


def _tokens(engine: Engine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def unpreempted(tiny):
    """Each schedule's greedy tokens with room for every sequence at once."""
    cache = {}

    def tokens(schedule: str) -> list[list[int]]:
        if schedule not in cache:
            engine = _engine(tiny, schedule, num_pages=8 * TIGHT[schedule])
            cache[schedule] = _tokens(engine)
            assert engine.stats["preemptions"] == 0
        return cache[schedule]

    return tokens


def _watch_swaps(engine: Engine) -> list[dict]:
    """Records, at each swap out and back in, the pages the sequence holds, what the pool
    gained or lost, and the pages its tables' kept tokens need."""
    kv, events = engine.kv_cache, []
    swap_out, swap_in = kv.swap_out, kv.swap_in

    def tables_pages(seq_id, num_computed):
        held = num_computed - kv.retention.num_evicted(seq_id)
        shifts = kv.retention.group_shifts(seq_id)
        return sum(pages_for(held + s, P) for s in shifts), shifts

    def out(seq_id, num_computed, **kwargs):
        need, shifts = tables_pages(seq_id, num_computed)
        held, free = kv.allocator.num_held_pages(seq_id), kv.allocator.num_free_pages()
        swap_out(seq_id, num_computed, **kwargs)
        events.append(dict(seq=seq_id, out=True, held=held, need=need, shifts=shifts,
                           moved=kv.allocator.num_free_pages() - free))
        return None

    def back(seq_id, token_ids, num_computed, *args):
        free = kv.allocator.num_free_pages()
        need, _ = tables_pages(seq_id, num_computed)
        ok = swap_in(seq_id, token_ids, num_computed, *args)
        if ok:
            events.append(dict(seq=seq_id, out=False, need=need,
                               held=kv.allocator.num_held_pages(seq_id),
                               moved=free - kv.allocator.num_free_pages()))
        return ok

    kv.swap_out, kv.swap_in = out, back
    return events


@pytest.mark.parametrize("schedule,mode", [("pyramid", "swap"), ("adakv", "swap"),
                                           ("pyramid", "auto"), ("adakv", "auto")])
def test_budget_tables_swap_out_and_back(tiny, unpreempted, schedule, mode):
    engine = _engine(tiny, schedule, TIGHT[schedule], mode)
    warm = engine.warmup()
    events = _watch_swaps(engine)
    got = _tokens(engine)
    assert engine.num_compiles == warm, "a swap compiled after warm-up"
    assert engine.stats["swaps_out"] == engine.stats["swaps_in"] == engine.stats["preemptions"]
    outs = [e for e in events if e["out"]]
    assert len(outs) == engine.stats["swaps_out"] > 0, "the pool was meant to force swaps"
    assert any(len(set(e["shifts"])) > 1 for e in outs), \
        "the case must swap a sequence whose tables hold different numbers of tokens"
    for e in events:  # the pool gives and takes exactly the pages the tables' tokens need
        assert e["moved"] == e["held"] == e["need"], e
    assert got == unpreempted(schedule)
    assert engine.kv_cache.allocator.num_free_pages() == TIGHT[schedule]  # nothing leaked
    assert engine.kv_cache.allocator.num_used_pages() == 0
    # AUTO priced each swap at the pages the sequence's tables held when it was preempted.
    priced = [d["swap_bytes"] for d in engine.stats["preemption_decisions"]]
    assert priced == ([e["held"] * engine.kv_spec.page_bytes for e in outs]
                      if mode == "auto" else [])


def _held_pages(engine: Engine, seq_id: str) -> int:
    """Pages in the sequence's block tables, counted entry by entry."""
    return sum(int(page) != RELEASED
               for table in engine.kv_cache.allocator.block_tables(seq_id) for page in table)


@pytest.mark.parametrize("schedule", ["pyramid", "adakv"])
def test_auto_preemption_prices_a_compacted_swap_at_the_pages_held(tiny, schedule):
    """Once its press compacted it, a sequence's swap is priced at the pages its block tables
    hold times the page bytes, what the swap moves. The spec's figure for its length counts
    each table's budget alone, at token granularity: not the tokens decoded since the press
    decided, nor the rest of each table's last page. With rates between the two prices,
    AUTO's choice follows the pages held."""
    engine = _engine(tiny, schedule, 8 * TIGHT[schedule], "auto")
    engine.add_request("r", PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    while len(engine.sequence("r#0").output_ids) < 2:
        engine.step()
    seq = engine.sequence("r#0")
    n = seq.num_computed
    num_tables = len(engine.kv_cache.allocator.block_tables(seq.seq_id))
    pages = _held_pages(engine, seq.seq_id)
    assert pages < num_tables * pages_for(n, P), "the press was meant to compact it"
    held = pages * engine.kv_spec.page_bytes
    spec = engine.kv_spec.bytes_held(n)
    assert engine.kv_cache.swap_out_bytes(seq.seq_id, n) == held != spec
    # Recomputing costs n seconds; swapping the held pages sqrt(held / spec) times that.
    preemption = engine.scheduler.preemption
    preemption.config = dataclasses.replace(
        preemption.config, recompute_tokens_per_s=1.0,
        swap_bandwidth_bytes_per_s=2 * (held * spec) ** 0.5 / n)
    rates = dict(bandwidth_bytes_per_s=preemption.config.swap_bandwidth_bytes_per_s,
                 recompute_tokens_per_s=1.0)
    by_pages = "swap" if held < spec else "recompute"
    assert decide_preemption(seq.seq_id, n, swap_bytes=int(spec), **rates).choice != by_pages
    assert preemption.mode(seq, Decisions()) == by_pages
    decision = engine.stats["preemption_decisions"][-1]
    assert decision["swap_bytes"] == held
    assert decision["recompute_cost_s"] == pytest.approx(n)


@pytest.mark.parametrize("schedule", ["pyramid", "adakv"])
def test_budget_tables_migrate_through_a_snapshot(tiny, schedule, tmp_path):
    """Saved mid-decode, once every table kept its own budget, and restored into a fresh
    engine, the requests continue with the tokens of an uninterrupted run and the restored
    tables' pages, with no prefill; an engine of the other schedule refuses the snapshot."""
    from kvjax.engine.request import SeqStatus
    from kvjax.engine.snapshot import restore_snapshot, save_snapshot

    num_pages = 4 * TIGHT[schedule]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    source = _engine(tiny, schedule, num_pages)
    for i, prompt in enumerate(PROMPTS):
        source.add_request(f"r{i}", prompt, params)
    while not all(s.status is SeqStatus.RUNNING and s.output_ids
                  for s in source.scheduler.sequences()):
        source.step()
    held = {s.seq_id: source.allocator.num_held_pages(s.seq_id)
            for s in source.scheduler.sequences()}
    shifts = [source.retention.group_shifts(s) for s in held]
    assert all(len(set(d)) > 1 for d in shifts), "every table must hold its own length"
    save_snapshot(source, tmp_path / "snap")
    other = "adakv" if schedule == "pyramid" else "pyramid"
    with pytest.raises(ValueError, match="snapshot"):
        restore_snapshot(_engine(tiny, other, 4 * TIGHT[other]), tmp_path / "snap")
    target = _engine(tiny, schedule, num_pages)
    assert sorted(restore_snapshot(target, tmp_path / "snap")) == ["r0", "r1", "r2"]
    assert {s: target.allocator.num_held_pages(s) for s in held} == held
    done = {}
    while target.has_unfinished():
        for out in target.step():
            done[out.request_id] = out.outputs[0].token_ids
    assert target.stats["prefill_tokens"] == 0, "the KV came from the snapshot"
    want = _engine(tiny, schedule, num_pages).generate(PROMPTS, params)
    assert [done[f"r{i}"] for i in range(3)] == [o.outputs[0].token_ids for o in want]
    assert target.allocator.num_free_pages() == num_pages
