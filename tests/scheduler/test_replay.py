"""Decision replay: a recorded engine run decides the same again on a fresh scheduler with no
model and no device, and a changed scheduler replays the same requests to the same tokens.

Oracles: the recorded SchedulerOutputs themselves (every field, KV operations included), and
the cache-free dense greedy reference for the tokens.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.runner import StepObserver
from kvjax.kv.retention_host import CompactionPlan
from kvjax.memory.ops import TIER_KINDS, KVOp, KVOpKind
from kvjax.memory.tiers import TierConfig
from kvjax.scheduler.replay import (
    DecisionRecorder,
    DecisionTrace,
    ReplayDevice,
    ReplayMismatch,
    build_scheduler,
    replay,
)
from kvjax.scheduler.request import Sequence
from kvjax.testing import greedy_reference, tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEW = 10
# A pool of 14 pages of 4 tokens cannot hold the six sequences at once: the run preempts. (The
# step programs are those of tests/engine/test_async_scheduling.py: compiled once per session.)
CONFIG = dict(page_size=4, max_num_batched_tokens=32, max_prefill_chunk=16, max_num_seqs=6,
              num_pages=14, scrub_freed_pages=True, async_scheduling=True)


# Under h2o with a budget of 10 tokens, longer sequences compact every page of tokens (the
# configuration of tests/engine/test_engine_retention.py's h2o case, whose programs it shares).
RETAINED = dict(page_size=4, max_num_batched_tokens=8, max_prefill_chunk=8, min_chunk_bucket=8,
                max_num_seqs=4, max_prefill_seqs=1, num_pages=64, max_model_len=64,
                retention="h2o", retention_budget=10, retention_options=dict(num_recent=3))


class _AppliedOps(StepObserver):
    def __init__(self):
        self.ops: list[KVOp] = []

    def on_kv_op(self, op: KVOp) -> None:
        self.ops.append(op)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(0, 120, size=12)]
    return [(shared if i % 2 else []) + [int(t) for t in rng.integers(0, 120, size=n)]
            for i, n in enumerate((5, 9, 3, 14, 7, 11))]


@pytest.fixture(scope="module")
def recorded(model, prompts):
    engine = Engine(model, EngineConfig(**CONFIG))
    recorder = engine.record_decisions()
    # The third request's two samples fork after its prompt (copy-on-write of its last page).
    sampling = [SamplingParams(max_new_tokens=NEW, n=2 if i == 2 else 1)
                for i in range(len(prompts))]
    outs = engine.generate(prompts, sampling)
    return engine, recorder.stop(), [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def swapped(model, prompts):
    """A recorded run under async scheduling that preempts by swapping: (engine, trace,
    tokens, compiles after warm-up and after the run, the KV ops the runner applied). Engines
    of one process share compiled programs, so both counts are taken here, before another
    engine compiles anything."""
    engine = Engine(model, EngineConfig(**CONFIG, preemption_mode="swap"))
    compiles = engine.warmup()
    applied = _AppliedOps()
    engine.add_step_observer(applied)
    recorder = engine.record_decisions()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    return (engine, recorder.stop(), [o.outputs[0].token_ids for o in outs],
            (compiles, engine.num_compiles), applied.ops)


@pytest.fixture(scope="module")
def retained(model):
    """A recorded run under h2o: (engine, trace, tokens, compiles after warm-up, the KV ops
    the runner applied)."""
    engine = Engine(model, EngineConfig(**RETAINED))
    compiles = engine.warmup()
    applied = _AppliedOps()
    engine.add_step_observer(applied)
    recorder = engine.record_decisions()
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 120, size=n)] for n in (21, 30, 9)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    return (engine, recorder.stop(), [o.outputs[0].token_ids for o in outs], compiles,
            applied.ops)


def test_recorded_run_preempts_and_hits_the_prefix_cache(model, prompts, recorded):
    engine, trace, tokens = recorded
    assert tokens == [greedy_reference(model, p, NEW) for p in prompts]
    assert engine.stats["preemptions"] > 0
    assert engine.prefix_cache_stats()["prefix_hit_tokens"] > 0
    planned = {op.kind for so in trace.outputs for op in so.kv_plan}
    committed = {op.kind for e in trace.events if e.name == "update_from_output"
                 for op in e.result}
    assert KVOpKind.SCRUB in planned and KVOpKind.COPY in planned | committed
    # Every step the engine ran was recorded, and what it committed.
    assert sum(e.name == "update_from_output" for e in trace.events) == engine.stats["steps"]


def test_replay_decides_every_step_again(model, prompts, recorded, tmp_path):
    engine, trace, tokens = recorded
    trace.save(tmp_path / "run.trace")
    result = replay(DecisionTrace.load(tmp_path / "run.trace"))
    assert len(result.outputs) == len(trace.outputs)
    assert result.scheduler.stats["preemptions"] == engine.stats["preemptions"]
    replayed = {o.request_id: o.outputs[0].token_ids for o in result.finished}
    assert [replayed[f"gen-0-{i}"] for i in range(len(prompts))] == tokens
    assert result.scheduler.kv_cache.allocator.num_used_pages() == 0


def test_replay_reports_the_first_decision_that_differs(recorded):
    _, trace, _ = recorded
    fewer_rows = dataclasses.replace(trace.recipe.config, max_num_seqs=2)
    changed = dataclasses.replace(trace, recipe=dataclasses.replace(trace.recipe,
                                                                   config=fewer_rows))
    with pytest.raises(ReplayMismatch, match=r"step \d+ \(event \d+\): replayed != recorded"):
        replay(changed)


def test_replay_runs_in_a_process_without_jax(recorded, swapped, retained, tmp_path):
    """A plain run, one under retention (its compactions are data) and one that swaps (its
    swaps are data) replay without jax. (`swapped` is built before `retained`: engines of one
    process share compiled programs, and retained's count after warm-up is checked later.)"""
    traces = [recorded[1], retained[1], swapped[1]]
    paths = [tmp_path / f"run{i}.trace" for i in range(len(traces))]
    for trace, path in zip(traces, paths, strict=True):
        trace.save(path)
    script = ("import sys\n"
              "from kvjax.scheduler.replay import DecisionTrace, replay\n"
              f"results = [replay(DecisionTrace.load(p)) for p in {[str(p) for p in paths]!r}]\n"
              "print(*[len(r.outputs) for r in results], sorted(m for m in "
              "('jax', 'jaxlib', 'flax') if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True, cwd=REPO).stdout.split()
    assert out == [*(str(len(t.outputs)) for t in traces), "[]"]


def test_swaps_are_data_the_runner_applies_in_the_steps_dispatch(model, prompts, swapped):
    """Swap preemption under async scheduling: every swap-out and swap-in is an op of a step's
    plan (host slots and padded page indices), the runner applies exactly those ops before
    the step's model, a sequence's copy comes back into the slot it went to, the tokens are
    the dense greedy reference's, and nothing compiles after warm-up."""
    engine, trace, tokens, compiles, applied = swapped
    assert tokens == [greedy_reference(model, p, NEW) for p in prompts]
    swap_kinds = (KVOpKind.SWAP_OUT, KVOpKind.SWAP_IN, KVOpKind.SWAP_DROP)
    planned = [op for so in trace.outputs for op in so.kv_plan if op.kind in swap_kinds]
    committed = [op for e in trace.events if e.name == "update_from_output"
                 for op in e.result if op.kind in swap_kinds]
    outs = [op for op in planned if op.kind is KVOpKind.SWAP_OUT]
    ins = [op for op in planned if op.kind is KVOpKind.SWAP_IN]
    assert len(outs) == engine.stats["swaps_out"] > 0 and len(ins) == engine.stats["swaps_in"]
    assert not committed
    assert [op for op in applied if op.kind in swap_kinds] == planned
    held = {}
    for op in planned:  # each copy is read back from its host slot once, after it was written
        if op.kind is KVOpKind.SWAP_OUT:
            assert op.host_slot not in held and op.src[:len(op.pages)] == op.pages
            held[op.host_slot] = len(op.pages)
        else:
            assert len(op.src) == len(op.dst) and max(op.src, default=0) < held.pop(op.host_slot)
    assert not held
    assert compiles[1] == compiles[0]
    result = replay(trace)
    assert result.scheduler.stats["swaps_out"] == engine.stats["swaps_out"]
    replayed = {o.request_id: o.outputs[0].token_ids for o in result.finished}
    assert [replayed[f"gen-0-{i}"] for i in range(len(prompts))] == tokens


@pytest.fixture(scope="module")
def tiered(model, prompts):
    """A recorded run under async scheduling with a host tier, swapping through it, then the
    same prompts again (their evicted prefix pages come back from the host tier): (engine,
    trace, tokens of both rounds, compiles after warm-up and after the run, applied ops)."""
    page_bytes = model.config.kv_bytes_per_token(model.dtype) * CONFIG["page_size"]
    engine = Engine(model, EngineConfig(**CONFIG, preemption_mode="swap",
                                        tiers=TierConfig(host_bytes=64 * page_bytes)))
    compiles = engine.warmup()
    applied = _AppliedOps()
    engine.add_step_observer(applied)
    recorder = engine.record_decisions()
    tokens = []
    for batch in (prompts, prompts[1::2]):
        outs = engine.generate(batch, SamplingParams(max_new_tokens=NEW))
        tokens.append([o.outputs[0].token_ids for o in outs])
    return (engine, recorder.stop(), tokens, (compiles, engine.num_compiles), applied.ops)


def test_tier_transfers_are_data_and_a_tiered_run_replays(model, prompts, tiered):
    """With a host tier, spills, tier loads and their scatters are ops of the steps' plans
    (transfer ids, pages, the staged chunk's checksums), the runner applies exactly those, a
    load is scattered only after it was sent, what landed reaches the ledger through the
    runner's outputs (or, for a step dispatched with none in flight, the engine core's report
    right after its dispatch), the tokens are the dense greedy reference's, nothing compiles after
    warm-up, and the recorded decisions replay to the same tokens without a runner."""
    engine, trace, tokens, compiles, applied = tiered
    assert tokens == [[greedy_reference(model, p, NEW) for p in batch]
                      for batch in (prompts, prompts[1::2])]
    assert engine.stats["swaps_out"] > 0 and engine.stats["tier_hit_tokens"] > 0
    planned = [op for so in trace.outputs for op in so.kv_plan if op.kind in TIER_KINDS]
    planned += [op for e in trace.events if e.name == "update_from_output"
                for op in e.result if op.kind in TIER_KINDS]
    assert sorted(map(repr, (op for op in applied if op.kind in TIER_KINDS))) == \
        sorted(map(repr, planned))
    sent = set()
    for op in [op for op in applied if op.kind in TIER_KINDS]:
        if op.kind is KVOpKind.TIER_LOAD:
            sent.add(op.transfer)
            assert len(op.plan.expected) == len(op.pages) == op.plan.staged[0].shape[1]
        elif op.kind is KVOpKind.TIER_SCATTER:
            assert op.transfer in sent
    landed = {r.transfer for e in trace.events if e.name == "update_from_output"
              for r in e.args[1].tier_landed}
    landed |= {r.transfer for e in trace.events if e.name == "receive_tier_landed"
               for r in e.args[0]}
    spills = {op.transfer for op in planned if op.kind is KVOpKind.SPILL}
    assert spills and spills <= landed
    assert engine.tiers.num_inflight == 0 and compiles[1] == compiles[0]
    result = replay(trace)
    for key in ("swaps_out", "tier_hit_tokens", "bytes_device_to_host", "bytes_host_to_device"):
        assert result.scheduler.stats[key] == engine.stats[key], key
    replayed = {o.request_id: o.outputs[0].token_ids for o in result.finished}
    arrivals = [e.args[0] for e in trace.events if e.name == "add_request"]
    assert [replayed[r] for r in arrivals] == tokens[0] + tokens[1]


KIVI = dict(kv_codec="kivi4", kv_codec_options={"group": 4})  # a window of < 4 exact tokens


@pytest.fixture(scope="module")
def kivi_reference(model, prompts):
    """Greedy tokens of the KIVI codec with room for every sequence (no preemption)."""
    engine = Engine(model, EngineConfig(**{**CONFIG, "num_pages": 64}, **KIVI))
    return [o.outputs[0].token_ids
            for o in engine.generate(prompts, SamplingParams(max_new_tokens=NEW))]


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
def test_a_kivi_window_swaps_through_the_tiers_as_data_and_the_run_replays(
        model, prompts, kivi_reference, is_async):
    """KIVI over a host tier, preempting by swap: each window goes out to a host slot and back
    as a SWAP_OUT / SWAP_IN of no pages in the steps' plans (its pages as tier transfers), the
    greedy tokens are those of the same codec with room for every sequence (under sync and
    async scheduling alike), nothing compiles after warm-up, and the recorded run replays to
    the same tokens."""
    page_bytes = model.config.kv_bytes_per_token(model.dtype) * CONFIG["page_size"]
    engine = Engine(model, EngineConfig(**{**CONFIG, "async_scheduling": is_async}, **KIVI,
                                        preemption_mode="swap",
                                        tiers=TierConfig(host_bytes=64 * page_bytes)))
    compiles = engine.warmup()
    recorder = engine.record_decisions()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    trace = recorder.stop()
    engine.tiers.close()
    assert [o.outputs[0].token_ids for o in outs] == kivi_reference
    assert engine.stats["swaps_in"] > 0 and engine.num_compiles == compiles
    windows = [op for so in trace.outputs for op in so.kv_plan
               if op.kind in (KVOpKind.SWAP_OUT, KVOpKind.SWAP_IN)]
    assert all(op.seq_slots and not op.pages and not op.dst for op in windows)
    assert sum(op.kind is KVOpKind.SWAP_OUT for op in windows) == engine.stats["swaps_out"]
    result = replay(trace)
    replayed = {o.request_id: o.outputs[0].token_ids for o in result.finished}
    assert [replayed[o.request_id] for o in outs] == kivi_reference


def test_compactions_come_back_as_data_and_compile_nothing_new(retained):
    """Each retention compaction is a COMPACT op carrying its plan's index arrays, returned by
    the commit that decided it; the runner applies exactly those ops, in order, and runs no
    program it had not compiled in warm-up."""
    engine, trace, _, compiles, applied = retained
    committed = [op for e in trace.events if e.name == "update_from_output" for op in e.result]
    compactions = [op for op in committed if op.kind is KVOpKind.COMPACT]
    assert len(compactions) == engine.retention.stats["evictions"] > 0
    budget = RETAINED["retention_budget"]
    for op in compactions:
        plan = op.plan
        assert isinstance(plan, CompactionPlan)
        kept = plan.keep[:plan.new_len]
        assert plan.new_len == budget and list(kept) == sorted(set(kept))
        assert all(k == -1 for k in plan.keep[plan.new_len:])
        # The kept tokens land in the new table's first slots, in order.
        table = np.asarray(op.pages)
        slots = table[np.arange(budget) // 4] * 4 + np.arange(budget) % 4
        assert list(plan.kept_dst[:budget]) == slots.tolist()
    assert [op for op in applied if op.kind is KVOpKind.COMPACT] == compactions
    assert engine.num_compiles == compiles


def test_a_run_under_retention_replays_to_the_same_decisions_and_tokens(retained):
    engine, trace, tokens, _, _ = retained
    result = replay(trace)
    assert len(result.outputs) == len(trace.outputs)
    stats = result.scheduler.kv_cache.retention.stats
    assert stats == engine.retention.stats and stats["evictions"] > 0
    replayed = {o.request_id: o.outputs[0].token_ids for o in result.finished}
    assert [replayed[f"gen-0-{i}"] for i in range(len(tokens))] == tokens


def test_counterfactual_replay_serves_the_same_tokens_under_another_schedule(
        model, prompts, recorded):
    engine, trace, _ = recorded
    # Room for every sequence at once: the changed scheduler never preempts.
    roomy = build_scheduler(dataclasses.replace(
        trace.recipe, allocator=type(trace.recipe.allocator)(64, 4)))
    result = replay(trace, scheduler=roomy, counterfactual=True)
    assert result.scheduler.stats["preemptions"] == 0 < engine.stats["preemptions"]
    replayed = {o.request_id: o.outputs[0].token_ids for o in result.finished}
    assert [replayed[f"gen-0-{i}"] for i in range(len(prompts))] == \
        [greedy_reference(model, p, NEW) for p in prompts]


@pytest.mark.parametrize("kind", [KVOpKind.SWAP_OUT, KVOpKind.SCATTER])
def test_an_op_that_runs_a_device_program_does_not_replay(kind):
    device = ReplayDevice()
    device.apply_ops([KVOp(KVOpKind.COPY, (3,), src=(1,), dst=(3,))])  # data: accepted
    with pytest.raises(ValueError, match=f"{kind.value!r} still runs a device program"):
        device.apply(KVOp(kind, (3,)), lambda kv: kv)


def test_replay_of_arrivals_aborts_tenants_and_a_weights_update(prompts):
    engine = Engine(tiny_model(), EngineConfig(**{**CONFIG, "async_scheduling": False}))
    recorder = engine.record_decisions()
    finished = {}
    for i, prompt in enumerate(prompts):  # a request arrives every other step
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=NEW),
                           tenant="a" if i % 3 else "b")
        for _ in range(2):
            finished.update((o.request_id, o) for o in engine.step())
        if i == 2:
            engine.abort("r1")
        if i == 3:
            engine.update_weights(tiny_model(seed=1).params, "1")
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step())
    finished.update((o.request_id, o) for o in engine.step())  # the abort's output, if late
    trace = recorder.stop()
    names = {e.name for e in trace.events}
    assert {"add_request", "abort", "on_weights_update"} <= names
    assert {v for _, v in trace.recipe.cache_keys} == {"0", "1"}
    result = replay(trace)
    assert len(result.outputs) == len(trace.outputs)
    replayed = {o.request_id: o for o in result.finished}
    assert sorted(replayed) == sorted(finished) == [f"r{i}" for i in range(len(prompts))]
    assert {r: o.outputs[0].token_ids for r, o in replayed.items()} == \
        {r: o.outputs[0].token_ids for r, o in finished.items()}
    assert replayed["r1"].outputs[0].finish_reason.value == "abort"


def test_a_request_under_a_grammar_is_refused_by_name(recorded):
    _, trace, _ = recorded
    scheduler = build_scheduler(trace.recipe)
    DecisionRecorder(scheduler, trace.recipe, lambda tenant, version: b"key")
    seq = Sequence(seq_id="g#0", request_id="g", tokens=[1, 2, 3], num_prompt_tokens=3,
                   sampling=SamplingParams(), seed=0, arrival_time=0.0, order=0,
                   grammar=object())
    with pytest.raises(ValueError, match="request 'g': a request under a grammar"):
        scheduler.add_request("g", [1, 2, 3], [seq], arrival=0.0, tenant=None, n=1)
    assert not scheduler.has_unfinished()
