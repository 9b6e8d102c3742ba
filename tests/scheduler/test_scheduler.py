"""The scheduler on fake runner outputs: no model, only the host-side decisions.

A step's "model" here is a function of the row (the next token is chosen by the test), so each
case checks what the scheduler decides: which rows, which tokens, which positions and pages,
which sequences are preempted, and what the finished outputs hold.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.config import ModelConfig
from kvjax.engine.swap import HostSwapSpace
from kvjax.kv.retention import RetentionManager, make_retention
from kvjax.kv.state import init_paged_kv
from kvjax.memory.block_manager import BlockManager
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.memory.ops import HostKV, KVOpKind
from kvjax.sampling import SamplingParams
from kvjax.scheduler.output import RunnerOutput
from kvjax.scheduler.policies import FairShare, make_policy
from kvjax.scheduler.preemption import PreemptionMode
from kvjax.scheduler.request import FinishReason, SeqStatus, Sequence, WeightUpdatePolicy
from kvjax.scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 99
P = 4
CONFIG = ModelConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=64,
                     name="fake")


def make_scheduler(num_pages: int = 32, *, max_num_seqs: int = 4, prefix_cache: bool = True,
                   preemption: PreemptionMode = PreemptionMode.RECOMPUTE,
                   max_num_batched_tokens: int = 64, max_prefill_chunk: int = 16,
                   max_prefill_seqs: int = 4, policy: str = "fcfs",
                   max_tenant_page_share: float | None = None,
                   contended_prefill_chunk: int | None = None, clock=lambda: 0.0):
    device = HostKV(init_paged_kv(CONFIG, num_pages, P))
    stats: dict = {}
    kv_cache = KVCacheManager(
        device, BlockManager(num_pages, P, enable_prefix_cache=prefix_cache), HostSwapSpace(),
        RetentionManager(make_retention("none", None, P)), page_size=P, watermark=0.0,
        scrub_freed_pages=False, stats=stats)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_prefill_chunk=max_prefill_chunk, max_prefill_seqs=max_prefill_seqs, page_size=P,
        max_model_len=64, is_paged=True, preemption_mode=preemption, kv_bytes_per_token=8.0,
        eos_token_ids=(EOS,), max_tenant_page_share=max_tenant_page_share,
        contended_prefill_chunk=contended_prefill_chunk, contention_window_s=5.0)
    scheduler = Scheduler(config, kv_cache, make_policy(policy),
                          cache_key=lambda tenant, version: f"{tenant}|{version}".encode(),
                          clock=clock, stats=stats, weights_version="v0")
    return scheduler, device


def add(scheduler: Scheduler, request_id: str, prompt: list[int], max_new_tokens: int = 8,
        n: int = 1, tenant: str | None = None) -> None:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, n=n)
    common = dict(request_id=request_id, num_prompt_tokens=len(prompt), sampling=sampling,
                  arrival_time=0.0, order=scheduler.next_order(), tenant=tenant)
    if n > 1:
        seqs = [Sequence(seq_id=f"{request_id}#prompt", tokens=prompt[:-1], seed=0,
                         is_group_prefill=True, **common)]
    else:
        seqs = [Sequence(seq_id=f"{request_id}#0", tokens=list(prompt), seed=0, **common)]
    scheduler.add_request(request_id, list(prompt), seqs, arrival=0.0, tenant=tenant, n=n)


def fake_step(scheduler: Scheduler, next_token=lambda row: 7):
    """Schedules one step and commits `next_token(row)` for every row, applying the KV plans
    of both to the pool as the runner does; returns (plan, done)."""
    so = scheduler.schedule()
    device = scheduler.kv_cache.device
    device.apply_ops(so.kv_plan)
    tokens = np.array([next_token(row) for row in so.rows], np.int32)
    device.apply_ops(scheduler.update_from_output(
        so, RunnerOutput(tokens=tokens, logprobs=np.zeros(len(tokens), np.float32))))
    return so, scheduler.take_finished()


def test_prefill_then_decode_then_eos():
    scheduler, _ = make_scheduler()
    add(scheduler, "a", [1, 2, 3, 4, 5])
    so, done = fake_step(scheduler, lambda row: 10)
    assert [r.seq_id for r in so.prefill] == ["a#0"] and not so.decode
    (row,) = so.prefill
    assert row.token_ids.tolist() == [1, 2, 3, 4, 5] and row.start == 0
    assert len(row.block_table) == 2  # 5 tokens on pages of 4
    so, done = fake_step(scheduler, lambda row: 11)
    (row,) = so.decode
    assert row.token_ids.tolist() == [10] and row.start == 5 and row.counter == 1
    so, done = fake_step(scheduler, lambda row: EOS)
    (out,) = done
    assert out.outputs[0].token_ids == [10, 11, EOS]
    assert out.outputs[0].finish_reason is FinishReason.STOP
    assert not scheduler.has_unfinished()
    assert scheduler.kv_cache.allocator.num_used_pages() == 0


def test_length_limit_finishes_without_scheduling_past_it():
    scheduler, _ = make_scheduler()
    add(scheduler, "a", [1, 2, 3], max_new_tokens=2)
    _, done = fake_step(scheduler)
    assert not done
    so, done = fake_step(scheduler)
    (out,) = done
    assert out.outputs[0].token_ids == [7, 7]
    assert out.outputs[0].finish_reason is FinishReason.LENGTH
    so, _ = fake_step(scheduler)
    assert so.is_empty


def test_chunked_prefill_under_the_token_budget():
    scheduler, _ = make_scheduler(max_prefill_chunk=4, max_num_batched_tokens=4)
    add(scheduler, "a", list(range(1, 11)))
    starts = []
    for _ in range(3):
        so, _ = fake_step(scheduler)
        (row,) = so.prefill
        starts.append((row.start, row.num_tokens))
    assert starts == [(0, 4), (4, 4), (8, 2)]
    so, _ = fake_step(scheduler)
    assert [r.start for r in so.decode] == [10]


def test_prefix_hit_skips_cached_tokens():
    scheduler, _ = make_scheduler()
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    add(scheduler, "a", shared + [9])
    fake_step(scheduler)
    add(scheduler, "b", shared + [20, 21])
    so, _ = fake_step(scheduler)
    (row,) = so.prefill
    assert row.seq_id == "b#0" and row.start == 8 and row.token_ids.tolist() == [20, 21]
    a_table = scheduler.kv_cache.block_table("a#0")
    assert row.block_table[:2].tolist() == a_table[:2]  # the shared full pages
    assert scheduler.sequence("b#0").num_cached_prompt_tokens == 8


@pytest.mark.parametrize("chunk", [16, 4])
def test_a_prompt_waits_for_the_shared_pages_another_is_computing(chunk):
    """Prompts sharing a prefix that arrive together: the later one waits while the first
    computes the shared pages, then hits them; one of another tenant (another cache key) and
    one sharing nothing start at once."""
    scheduler, _ = make_scheduler(max_prefill_chunk=chunk)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    add(scheduler, "a", shared + [9])
    add(scheduler, "b", shared + [20, 21])
    add(scheduler, "other-tenant", shared + [30], tenant="t2")
    add(scheduler, "c", [50, 51, 52])
    first, _ = fake_step(scheduler)
    assert {r.seq_id for r in first.prefill} == {"a#0", "other-tenant#0", "c#0"}
    row, so = None, first
    for _ in range(4):  # b is scheduled by then
        row = row or next((r for r in so.prefill if r.seq_id == "b#0"), None)
        so, _ = fake_step(scheduler)
    assert row.start == 8 and row.token_ids.tolist() == [20, 21]  # it computes its tail only
    assert row.block_table[:2].tolist() == scheduler.kv_cache.block_table("a#0")[:2]
    assert scheduler.sequence("b#0").num_cached_prompt_tokens == 8
    assert scheduler.stats["prefix_waits"] >= 1


def test_recompute_preemption_requeues_the_lowest_ranked_with_its_tokens():
    scheduler, _ = make_scheduler(num_pages=4)
    add(scheduler, "a", [1, 2, 3, 4, 5, 6, 7], max_new_tokens=6)  # 2 pages
    add(scheduler, "b", [8, 9, 10, 11, 12, 13, 14], max_new_tokens=6)  # 2 pages
    fake_step(scheduler)  # both prefill; the pool is full
    so, _ = fake_step(scheduler)  # each decodes into its second page's last slot
    assert {r.seq_id for r in so.decode} == {"a#0", "b#0"}
    so, _ = fake_step(scheduler)  # a needs a third page: b (later arrival) is preempted
    assert so.preempted == ("b#0",)
    assert [r.seq_id for r in so.decode] == ["a#0"]
    b = scheduler.sequence("b#0")
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and b.num_preemptions == 1
    assert b.tokens == [8, 9, 10, 11, 12, 13, 14, 7, 7]  # its generated tokens are kept
    refills, outputs = [], {}
    while scheduler.has_unfinished():
        so, done = fake_step(scheduler)
        refills += [r for r in so.prefill if r.seq_id == "b#0"]
        outputs.update({o.request_id: o for o in done})
    # Re-prefilled after its full pages' prefix-cache hit, generated tokens included.
    first = refills[0]
    assert first.start % P == 0
    recomputed = np.concatenate([r.token_ids for r in refills]).tolist()
    assert recomputed == [8, 9, 10, 11, 12, 13, 14, 7, 7][first.start:]
    assert outputs["b"].outputs[0].token_ids == [7] * 6
    assert outputs["b"].num_preemptions >= 1
    assert scheduler.kv_cache.allocator.num_used_pages() == 0


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_a_sequence_preempted_with_its_token_in_flight_recomputes_only_its_tail(overlapped):
    """Recompute preemption with step t+1 scheduled before step t commits or not: b is
    preempted right after the step that fills its second page (in flight under async), its
    pages stay cached while a finishes in the room left, and it comes back from the prefix
    cache's hit of both, recomputing one token in either pattern (the step in flight's pages
    are published before they are freed)."""
    scheduler, device = make_scheduler(num_pages=5)  # room for a, not for b too
    add(scheduler, "a", [1, 2, 3, 4, 5, 6, 7], max_new_tokens=6)
    add(scheduler, "b", [8, 9, 10, 11, 12, 13, 14], max_new_tokens=6)
    in_flight, refills, outputs = None, [], {}
    for _ in range(40):
        so = scheduler.schedule()
        device.apply_ops(so.kv_plan)
        refills += [r for r in so.rows if r.seq_id == "b#0" and scheduler.sequence(
            "b#0").num_preemptions]
        for done in ([in_flight] if overlapped else []) + ([] if overlapped else [so]):
            if done is not None:
                tokens = np.full(len(done.rows), 7, np.int32)
                device.apply_ops(scheduler.update_from_output(done, RunnerOutput(
                    tokens=tokens, logprobs=np.zeros(len(tokens), np.float32))))
        in_flight = None if so.is_empty else so
        outputs.update({o.request_id: o for o in scheduler.take_finished()})
        if not scheduler.has_unfinished():
            break
    assert outputs["b"].num_preemptions == 1 and outputs["b"].outputs[0].token_ids == [7] * 6
    assert refills[0].start == 2 * P  # both pages hit: one token recomputed
    assert scheduler.stats["prefill_tokens"] == 14  # the two prompts, nothing again


def test_swap_preemption_moves_pages_out_and_back_in_order():
    scheduler, device = make_scheduler(num_pages=4, preemption=PreemptionMode.SWAP)
    add(scheduler, "a", [1, 2, 3, 4, 5, 6, 7], max_new_tokens=6)
    add(scheduler, "b", [8, 9, 10, 11, 12, 13, 14], max_new_tokens=6)
    fake_step(scheduler)
    fake_step(scheduler)
    so, _ = fake_step(scheduler)
    assert so.preempted == ("b#0",)
    assert scheduler.sequence("b#0").status is SeqStatus.SWAPPED
    (swap_out,) = [op for op in so.kv_ops if op.kind is KVOpKind.SWAP_OUT]
    assert len(swap_out.pages) == 2  # b's two computed pages, listed in the step's plan
    outputs = {}
    while scheduler.has_unfinished():
        _, done = fake_step(scheduler)
        outputs.update({o.request_id: o for o in done})
    kinds = [op.kind for op in device.ops]
    assert KVOpKind.SWAP_OUT in kinds and KVOpKind.SWAP_IN in kinds
    assert kinds.index(KVOpKind.SWAP_OUT) < kinds.index(KVOpKind.SWAP_IN)
    assert scheduler.stats["swaps_in"] == 1
    assert outputs["b"].outputs[0].token_ids == [7] * 6  # nothing lost or duplicated


def test_group_prefill_forks_samples_that_share_prompt_pages():
    scheduler, _ = make_scheduler()
    add(scheduler, "g", [1, 2, 3, 4, 5, 6, 7, 8, 9], n=3)
    so, _ = fake_step(scheduler)
    (row,) = so.prefill
    assert row.seq_id == "g#prompt" and row.num_tokens == 8
    so, _ = fake_step(scheduler, lambda row: 30 + int(row.seq_id[-1]))
    # Each sample prefills the prompt's last token on its own, sharing the first 2 pages.
    assert sorted(r.seq_id for r in so.rows) == ["g#0", "g#1", "g#2"]
    tables = [scheduler.kv_cache.block_table(f"g#{i}") for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3  # the partial page is each sample's own
    outs = {}
    while scheduler.has_unfinished():
        _, done = fake_step(scheduler)
        outs.update({o.request_id: o for o in done})
    assert [o.token_ids[0] for o in outs["g"].outputs] == [30, 31, 32]


def test_abort_frees_pages_and_reports_abort():
    scheduler, _ = make_scheduler()
    add(scheduler, "a", [1, 2, 3, 4, 5])
    add(scheduler, "b", [6, 7, 8])
    fake_step(scheduler)
    scheduler.abort("a")
    (out,) = scheduler.take_finished()
    assert out.request_id == "a" and out.outputs[0].finish_reason is FinishReason.ABORT
    assert not scheduler.kv_cache.has_sequence("a#0")
    so, _ = fake_step(scheduler)
    assert [r.seq_id for r in so.rows] == ["b#0"]
    with pytest.raises(ValueError, match="unknown request_id 'zzz'"):
        scheduler.abort("zzz")


def test_weight_update_recompute_restarts_running_sequences_under_the_new_version():
    scheduler, _ = make_scheduler()
    add(scheduler, "a", [1, 2, 3, 4, 5])
    fake_step(scheduler)
    fake_step(scheduler)
    scheduler.on_weights_update("v1", WeightUpdatePolicy.RECOMPUTE)
    a = scheduler.sequence("a#0")
    assert a.status is SeqStatus.WAITING and a.num_computed == 0 and a.weights_version == "v1"
    so, _ = fake_step(scheduler)
    assert so.weights_version == "v1" and so.prefill[0].start == 0
    assert scheduler.versions == ["v1"]


def test_weight_update_finish_old_takes_turns_until_the_old_version_drains():
    scheduler, _ = make_scheduler()
    add(scheduler, "a", [1, 2, 3], max_new_tokens=3)
    fake_step(scheduler)
    scheduler.on_weights_update("v1", WeightUpdatePolicy.FINISH_OLD)
    add(scheduler, "b", [4, 5, 6], max_new_tokens=3)
    versions = []
    while scheduler.has_unfinished():
        so, _ = fake_step(scheduler)
        versions.append(so.weights_version)
    assert "v0" in versions and "v1" in versions
    assert scheduler.sequences() == [] and scheduler.versions == ["v1"]


@pytest.mark.parametrize("with_other", [False, True])
def test_overlapped_steps_feed_in_flight_tokens_and_never_stall(with_other):
    """The asynchronous pattern: step t+1 is scheduled before step t's results are committed.

    Alone, the shared prompt's last chunk leaves nothing to schedule while it is in flight;
    that must wait for the results, not preempt it.
    """
    scheduler, _ = make_scheduler(max_prefill_chunk=8)
    add(scheduler, "g", list(range(1, 20)), max_new_tokens=4, n=2)  # a shared prompt, forked
    if with_other:
        add(scheduler, "a", [5, 6, 7], max_new_tokens=4)
    in_flight, outputs, fed = None, {}, 0
    for _ in range(40):
        so = scheduler.schedule()
        fed += sum(row.feed_index >= 0 for row in so.rows)
        if in_flight is not None:
            tokens = np.full(len(in_flight.rows), 7, np.int32)
            scheduler.update_from_output(in_flight, RunnerOutput(
                tokens=tokens, logprobs=np.zeros(len(tokens), np.float32)))
        in_flight = None if so.is_empty else so
        outputs.update({o.request_id: o for o in scheduler.take_finished()})
        if not scheduler.has_unfinished():
            break
    assert sorted(outputs) == (["a", "g"] if with_other else ["g"])
    assert [o.token_ids for o in outputs["g"].outputs] == [[7] * 4] * 2  # none lost or doubled
    if with_other:
        assert outputs["a"].outputs[0].token_ids == [7] * 4
    assert fed > 0, "decode rows should take their token from the step in flight"
    assert scheduler.stats["preemptions"] == 0


def test_fair_share_lets_a_waiting_tenant_go_before_another_tenants_long_prefill():
    """Under `fair`, a tenant served less goes before another tenant's unfinished prefill
    (one prefill row a step); under `fcfs` the running prefill finishes first."""
    order = {}
    for policy in ("fcfs", "fair"):
        scheduler, _ = make_scheduler(policy=policy, max_prefill_seqs=1, max_prefill_chunk=4,
                                      max_num_batched_tokens=8)
        add(scheduler, "flood", list(range(1, 25)), tenant="a")  # 6 chunks of 4
        fake_step(scheduler)
        add(scheduler, "chat", [50, 51, 52], tenant="b")
        steps = 1
        while "chat#0" not in {r.seq_id for r in fake_step(scheduler)[0].prefill}:
            steps += 1
        order[policy] = steps
    assert order == {"fcfs": 6, "fair": 1}, order


@pytest.mark.parametrize("credit, chat_steps", [(0.0, [2, 4, 6]), (12.0, [1, 2, 3])])
def test_a_new_tenants_first_prompt_runs_its_credit_without_taking_turns(
        monkeypatch, credit, chat_steps):
    """A new tenant's first prompt is prefilled chunk after chunk, ahead of a backlogged
    tenant, for `new_tenant_credit` tokens; without credit the two take turns."""
    monkeypatch.setattr(FairShare, "new_tenant_credit", credit)
    scheduler, _ = make_scheduler(policy="fair", max_prefill_seqs=1, max_prefill_chunk=4,
                                  max_num_batched_tokens=8)
    add(scheduler, "flood", list(range(1, 41)), tenant="a")  # 10 chunks of 4
    fake_step(scheduler)
    add(scheduler, "chat", list(range(50, 62)), tenant="b")  # 3 chunks of 4
    steps = []
    for step in range(1, 10):
        if "chat#0" in {r.seq_id for r in fake_step(scheduler)[0].prefill}:
            steps.append(step)
    assert steps == chat_steps


def test_a_tenant_over_its_page_share_waits_while_another_tenant_waits():
    """With max_tenant_page_share, a tenant holding its share admits nothing new while
    another tenant's request waits; alone it may fill the pool."""
    scheduler, _ = make_scheduler(num_pages=16, policy="fcfs", max_prefill_chunk=16,
                                  max_num_batched_tokens=64, max_tenant_page_share=0.5)
    for i in range(3):  # 3 x 3 pages, then a 4th each to decode: a alone takes 12 of 16
        add(scheduler, f"a{i}", list(range(20 * i + 1, 20 * i + 13)), tenant="a")
    so, _ = fake_step(scheduler)
    assert sorted(r.seq_id for r in so.prefill) == ["a0#0", "a1#0", "a2#0"]
    add(scheduler, "a3", list(range(101, 109)), tenant="a")
    add(scheduler, "b0", list(range(201, 209)), tenant="b")
    so, _ = fake_step(scheduler)
    assert [r.seq_id for r in so.prefill] == ["b0#0"]  # a holds 12 >= 8 pages: a3 waits
    unlimited, _ = make_scheduler(num_pages=16, policy="fcfs", max_prefill_chunk=16,
                                  max_num_batched_tokens=64)
    for i in range(3):
        add(unlimited, f"a{i}", list(range(20 * i + 1, 20 * i + 13)), tenant="a")
    fake_step(unlimited)
    add(unlimited, "a3", list(range(101, 109)), tenant="a")
    add(unlimited, "b0", list(range(201, 209)), tenant="b")
    so, _ = fake_step(unlimited)
    assert [r.seq_id for r in so.prefill] == ["a3#0"]  # first come (then max_num_seqs is met)


def test_a_tenant_over_its_share_is_preempted_for_one_under_it():
    """A tenant that took the whole pool while alone gives back a sequence (recomputed
    later, its tokens unchanged) when another tenant under its share needs pages; without a
    share the newcomer waits for a sequence to finish."""
    def steps_until_b_runs(share):
        scheduler, _ = make_scheduler(num_pages=12, policy="fair", max_prefill_chunk=16,
                                      max_num_batched_tokens=64, max_tenant_page_share=share)
        for i in range(3):  # 3 x 4 pages (13 tokens: 3 more fit): the whole pool
            add(scheduler, f"a{i}", list(range(20 * i + 1, 20 * i + 14)), max_new_tokens=30,
                tenant="a")
        fake_step(scheduler)
        add(scheduler, "b0", list(range(101, 109)), tenant="b")
        preempted = []
        for step in range(1, 40):
            so, _ = fake_step(scheduler)
            preempted += so.preempted
            if "b0#0" in {r.seq_id for r in so.prefill}:
                return step, preempted
        return None, preempted

    # The lowest ranked of a's goes before the step is formed, and b0 runs in that step.
    assert steps_until_b_runs(0.5) == (1, ["a2#0"])
    step, preempted = steps_until_b_runs(None)
    assert step > 3  # waits until a's decode rows need pages and the lowest ranked goes


def test_a_tenant_served_more_gets_short_chunks_while_another_is_active():
    """contended_prefill_chunk: alone, a tenant's long prompt runs in full chunks; while
    another tenant has a request (or had one within the 5 s window) the tenant served more
    runs short chunks and the other full ones; once the window passes, full chunks again."""
    now = [0.0]
    scheduler, _ = make_scheduler(num_pages=32, max_prefill_chunk=16, max_prefill_seqs=2,
                                  policy="fcfs", contended_prefill_chunk=4,
                                  clock=lambda: now[0])

    def chunks():
        so, _ = fake_step(scheduler)
        now[0] += 1.0
        return {r.seq_id: r.num_tokens for r in so.prefill}

    add(scheduler, "a0", list(range(1, 61)), max_new_tokens=2, tenant="a")
    assert chunks() == {"a0#0": 16}  # alone: full chunks
    add(scheduler, "b0", list(range(101, 111)), max_new_tokens=1, tenant="b")
    assert chunks() == {"a0#0": 4, "b0#0": 10}  # a was served more: short; b: its prompt
    assert not scheduler.has_request("b0")
    assert chunks() == {"a0#0": 4}  # b finished 1 s ago: still active
    now[0] += 5.0
    assert chunks() == {"a0#0": 16}  # b idle past the window
