"""KV controllers' decisions on hand-built snapshots: who is degraded, how, and within what."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvjax.memory.prefix_cache import CachedPage
from kvjax.scheduler.controller import (
    CONTROLLERS,
    SLO,
    ControlState,
    Decisions,
    Demotion,
    HostRowRates,
    SeqState,
    degradation_key,
    make_controller,
)

P = 16
TABLE = {"64": 0.09, "128": 0.05, "192": 0.02}


def seq(seq_id, status="running", *, priority=0, slack=math.inf, tokens=320, pages=None,
        kl_budget=None, kl_spent=0.0, budget=None, demoted_bits=0, preemptions=0
        ) -> SeqState:
    computed = tokens if status != "waiting" else 0
    return SeqState(
        seq_id=seq_id, request_id=seq_id, tenant=None, priority=priority, status=status,
        age_s=1.0, num_tokens=tokens, num_computed=computed,
        cached_tokens=computed, pages_held=(-(-tokens // P) if pages is None else pages)
        if status == "running" else 0, slack_s=slack, retention_budget=budget,
        kl_spent=kl_spent, kl_budget=kl_budget, demoted_bits=demoted_bits,
        num_preemptions=preemptions)


def state(*seqs, free=0, retention=(5, 256), demote=True, **fields) -> ControlState:
    return ControlState(
        now=10.0, page_size=P, num_pages=64, free_pages=free, max_num_seqs=8,
        kv_bytes_per_token=46_080, swap_bytes_per_s=10e9, recompute_tokens_per_s=160.0,
        can_swap=True, demote_ratios={8: 3.8, 4: 7.1} if demote else {},
        retention_range=retention, seqs=tuple(seqs), **fields)


def joint(**options):
    return make_controller("joint", **{"retention_kl": TABLE, "demote_kl": 0.001, **options})


def test_fixed_controller_decides_nothing():
    s = state(seq("a"), seq("w", "waiting", priority=1, slack=5.0))
    assert make_controller("fixed").decide(s) == Decisions()


def test_degradation_order_is_lowest_priority_then_most_slack():
    seqs = [seq("hi", priority=2, slack=9.0), seq("lo-tight", slack=1.0),
            seq("lo-loose", slack=30.0), seq("lo-none")]
    ranked = [s.seq_id for s in sorted(seqs, key=degradation_key)]
    assert ranked == ["lo-none", "lo-loose", "lo-tight", "hi"]
    # The controller's reactive victims follow the same order.
    assert joint().decide(state(*seqs)).victims == tuple(ranked)


def test_room_is_made_only_from_lower_ranked_sequences():
    """A waiting request with a deadline gets pages from the lowest-ranked running one, never
    from one that outranks it."""
    s = state(seq("boss", priority=2, slack=1.0), seq("batch", kl_budget=0.0),
              seq("urgent", "waiting", priority=1, slack=3.0, tokens=200))
    d = make_controller("tiers").decide(s)
    assert d.offload == ("batch",) and d.swap["batch"] is True
    assert d.admit_order[0] == "urgent"  # it enters before the victim comes back
    # Nothing outranked: a waiting request of the lowest priority degrades no one.
    s = state(seq("boss", priority=2, slack=1.0),
              seq("late", "waiting", priority=0, slack=3.0, tokens=200))
    assert make_controller("tiers").decide(s).offload == ()


def test_no_degradation_for_requests_without_a_deadline_to_protect():
    for slack in (math.inf, -1.0):
        s = state(seq("batch"), seq("w", "waiting", priority=1, slack=slack))
        assert joint().decide(s).offload == () and joint().decide(s).retention == {}


def test_retention_respects_each_requests_kl_budget():
    """Only budgets whose measured KL fits what the victim has left are chosen; a victim
    with an exact-only SLO is never made lossy (retention or demoted copy)."""
    waiting = seq("w", "waiting", priority=1, slack=0.5, tokens=100)
    for kl_budget, allowed in ((0.0, set()), (0.03, {"192"}), (0.06, {"128", "192"}),
                               (None, set(TABLE))):
        d = make_controller("retention", retention_kl=TABLE).decide(
            state(seq("v", kl_budget=kl_budget), waiting))
        if not allowed:
            assert d.retention == {}
            continue
        (budget,) = d.retention.values()
        assert str(budget) in allowed
        assert d.kl["v"] == pytest.approx(TABLE[str(budget)])
    exact_only = joint().decide(state(seq("v", kl_budget=0.0), waiting))
    assert exact_only.retention == {} and "v" not in exact_only.demote


def test_retention_budget_counts_what_was_already_spent():
    d = make_controller("retention", retention_kl=TABLE).decide(state(
        seq("v", kl_budget=0.06, kl_spent=0.02, budget=192),
        seq("w", "waiting", priority=1, slack=0.5, tokens=100)))
    assert d.retention == {"v": 128}  # 0.05 - 0.02 more fits; 64 (0.07 more) does not
    assert d.kl["v"] == pytest.approx(0.02 + 0.05 - 0.02)


def test_a_peer_that_cannot_afford_the_stall_keeps_running():
    """A victim of the beneficiary's own priority (more slack than it, less than the stall)
    is not preempted; with a KL budget it is made smaller instead."""
    waiting = seq("w", "waiting", priority=1, slack=1.0, tokens=400)  # 2.5 s of prefill
    tight = seq("peer", priority=1, slack=2.0, kl_budget=0.0)
    assert make_controller("tiers").decide(state(tight, waiting)).offload == ()
    lossy = dataclasses.replace(tight, kl_budget=0.5)
    d = joint().decide(state(lossy, waiting))
    assert d.offload == () and d.retention


def test_joint_weighs_the_victims_stall_against_quality():
    """Preempting stalls the victim for about the beneficiary's prefill (300 tokens: ~1.9 s)
    and misses a tight deadline; a smaller budget costs KL at kl_cost_s seconds per nat."""
    waiting = seq("w", "waiting", priority=1, slack=3.0, tokens=300)
    victim = seq("v", slack=0.5, kl_budget=0.5)  # any stall misses its next token
    d = joint().decide(state(victim, waiting))
    assert "v" in d.retention and d.offload == ()
    relaxed = dataclasses.replace(victim, slack_s=math.inf)  # nothing to miss
    d = joint(kl_cost_s=1000.0).decide(state(relaxed, waiting))
    assert d.offload == ("v",) and d.swap["v"] and d.retention == {}
    d = joint().decide(state(relaxed, waiting))  # 0.02 nats = 0.2 s < a 1.9 s stall
    assert d.retention == {"v": 192} and d.offload == ()


def test_joint_makes_a_host_row_when_host_attention_is_cheap():
    """The device pool is full and a waiting request with a deadline needs pages: where the
    host's attention over the victim's 320 tokens fits beside the device's step, its full
    pages go to the host pool and it keeps decoding (no stall, no KL); where it would slow
    every step by far more than a swap costs, or the host pool has no room, it is swapped."""
    waiting = seq("w", "waiting", priority=1, slack=3.0, tokens=300)
    victim = seq("v", kl_budget=0.0)
    cheap = HostRowRates(free_host_pages=64, host_tokens_per_s=1e6, device_step_s=5e-3)
    d = joint().decide(state(victim, waiting, host_rows=cheap))
    assert d.to_host == ("v",) and d.offload == ()
    assert d.reserve == -(-(300 + 1) // P)  # the waiting one's pages: "v" stays out for them
    for rates in (dataclasses.replace(cheap, host_tokens_per_s=1e3),  # 0.3 s past each step
                  dataclasses.replace(cheap, free_host_pages=5),  # no room for 19 pages
                  None):  # no host rows
        d = joint().decide(state(victim, waiting, host_rows=rates))
        assert d.to_host == () and d.offload == ("v",) and d.swap["v"]
    # Controllers without the action never choose it.
    assert make_controller("tiers").decide(state(victim, waiting, host_rows=cheap)).to_host == ()


@pytest.mark.parametrize("split", ["when_full", "always", "random", "neo"])
def test_every_split_policys_configured_rates_price_the_host_action(split):
    """The rates a split policy is configured with (`EngineConfig.host_split_options`) are
    the ones the controller prices with (`HostPlacement.row_rates`): host attention made
    expensive swaps the victim, made cheap moves it to the host pool (same setup as above)."""
    from kvjax.scheduler.host_split import make_host_split

    waiting = seq("w", "waiting", priority=1, slack=3.0, tokens=300)
    victim = seq("v", kl_budget=0.0)
    for host_tokens_per_s, host in ((1e3, False), (1e6, True)):
        policy = make_host_split(split, host_tokens_per_s=host_tokens_per_s,
                                 device_step_s=5e-3)
        rates = HostRowRates(64, *policy.rates())
        d = joint().decide(state(victim, waiting, host_rows=rates))
        assert (d.to_host, d.offload) == ((("v",), ()) if host else ((), ("v",)))


def test_demotion_takes_the_fewest_bits_the_kl_budget_allows():
    """exact -> int8 -> int4: the codec baseline stores a swapped copy at the fewest bits whose
    KL fits what the sequence has left; a copy no finer than one it already went through
    adds no KL."""
    codec = make_controller("codec", demote_kl={8: 0.001, 4: 0.02})
    for kl_budget, expected in ((0.0, None), (0.01, Demotion(8, 0.001)),
                                (0.5, Demotion(4, 0.02))):
        d = codec.decide(state(seq("v", kl_budget=kl_budget)))
        assert d.demote.get("v") == expected
    # Already rounded to int8: int4 costs only the difference, int8 again nothing.
    d = codec.decide(state(seq("v", kl_budget=0.02, kl_spent=0.001, demoted_bits=8)))
    assert d.demote["v"] == Demotion(4, pytest.approx(0.019))
    d = codec.decide(state(seq("v", kl_budget=0.001, kl_spent=0.001, demoted_bits=8)))
    assert d.demote["v"] == Demotion(8, 0.0)
    # The engine cannot demote (a quantized pool, the tiers): no demotion decided.
    assert codec.decide(state(seq("v", kl_budget=None), demote=False)).demote == {}
    # The joint controller weighs bytes moved against KL: int8 at 10 s per nat, int4 when a
    # nat is worth 1 s (a 29 MB copy on a 100 MB/s link: 0.29 s exact, 0.08 int8, 0.04 int4).
    waiting = seq("w", "waiting", priority=1, slack=30.0, tokens=100)
    slow = dataclasses.replace(state(seq("v", kl_budget=None), waiting, retention=None),
                               swap_bytes_per_s=1e8)
    for kl_cost_s, bits in ((10.0, 8), (1.0, 4)):
        d = joint(demote_kl={8: 0.001, 4: 0.02}, kl_cost_s=kl_cost_s).decide(slow)
        assert d.offload == ("v",) and d.swap["v"] and d.demote["v"].bits == bits


def test_a_victim_is_not_offloaded_again_past_max_preemptions():
    waiting = seq("w", "waiting", priority=1, slack=30.0, tokens=100)
    d = make_controller("tiers", max_preemptions=2).decide(
        state(seq("v", preemptions=2), seq("u", preemptions=1), waiting))
    assert d.offload == ("u",)  # v was preempted twice already
    d = make_controller("tiers", max_preemptions=2).decide(
        state(seq("v", preemptions=2), waiting))
    assert d.offload == () and d.victims == ("v",)  # still the victim if pages run out
    with pytest.raises(ValueError, match="max_preemptions"):
        make_controller("joint", max_preemptions=0)


def test_keep_ranks_cached_pages_by_expected_reuse():
    """Pages never reused are left to LRU (evicted first); reused ones are kept, the least
    valuable first: fewer reuses, discounted by idle time; among equals the deeper page."""
    cached = (CachedPage(0, hits=0, released_at=9.0, depth=0),
              CachedPage(1, hits=3, released_at=5.0, depth=0),
              CachedPage(2, hits=3, released_at=5.0, depth=1),
              CachedPage(3, hits=1, released_at=9.5, depth=0),
              CachedPage(4, hits=6, released_at=-590.0, depth=0))  # idle 600 s: 6 / 11
    keep = make_controller("prefix").decide(state(cached=cached)).keep
    assert keep == (4, 3, 2, 1)
    assert make_controller("tiers").decide(state(cached=cached)).keep == ()
    assert set(joint().decide(state(cached=cached)).keep) == {1, 2, 3, 4}


def test_admission_puts_meetable_deadlines_first():
    s = state(seq("hopeless", "waiting", slack=0.1, tokens=400),
              seq("later", "waiting", slack=20.0, tokens=100),
              seq("soon", "waiting", slack=5.0, tokens=100),
              seq("none", "waiting"), seq("vip", "waiting", priority=1, slack=50.0))
    order = make_controller("admission").decide(s).admit_order
    assert order[:3] == ("vip", "soon", "later")
    assert set(order[3:]) == {"hopeless", "none"}


def test_registry_and_bad_options():
    assert {"fixed", "admission", "preemption", "tiers", "retention", "codec", "prefix",
            "joint"} <= set(CONTROLLERS)
    with pytest.raises(ValueError, match="unknown controller 'nope'"):
        make_controller("nope")
    with pytest.raises(ValueError, match="controller 'joint'"):
        make_controller("joint", bogus=1)
    with pytest.raises(ValueError, match="kl_budget"):
        SLO(kl_budget=-1.0)
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(ttft_s=True)


INPLACE = {0: 1.0, 8: 3.5, 4: 6.0}  # a page's bytes at the write class over at each class


def test_in_place_demotion_frees_cold_pages_within_each_kl_budget():
    """The in-place baseline re-encodes a lower-ranked running sequence's cold pages for a
    higher-ranked waiting one: it keeps running, pays KL from the measured int8 / int4 table,
    and never past its budget; pages already rounded free only the difference."""
    inplace = make_controller("inplace", demote_kl={8: 0.001, 4: 0.02})
    waiting = seq("w", "waiting", priority=1, slack=5.0, tokens=100)

    def victim(**fields):
        return dataclasses.replace(seq("v", kl_budget=0.5), **{"pages_at": {0: 20}, **fields})

    d = inplace.decide(state(victim(), waiting, inplace_ratios=INPLACE))
    assert d.demote_in_place == {"v": 8} and d.kl == {"v": 0.001} and d.offload == ()
    assert d.victims == () and d.admit_order == ()
    for kl_budget in (0.0, 0.0005):  # exact only, or less than int8 costs
        d = inplace.decide(state(victim(kl_budget=kl_budget), waiting,
                                 inplace_ratios=INPLACE))
        assert d.demote_in_place == {}
    # Already at int8: only int4 frees more, 20 * (1/3.5 - 1/6) = 2.4 pages, for 0.019 nats.
    d = inplace.decide(state(victim(pages_at={8: 20}, inplace_bits=8, kl_spent=0.001),
                             waiting, inplace_ratios=INPLACE))
    assert d.demote_in_place == {"v": 4} and d.kl["v"] == pytest.approx(0.02)
    # A pool of one precision offers none; a higher-ranked sequence is never the victim.
    assert inplace.decide(state(victim(), waiting)).demote_in_place == {}
    high = victim(priority=2)
    assert inplace.decide(state(high, waiting, inplace_ratios=INPLACE)).demote_in_place == {}


def test_joint_demotes_in_place_rather_than_stall_a_tight_victim():
    """A victim that would miss its next token if preempted keeps running with int8 cold
    pages (0.001 nats: 0.01 s at 10 s per nat) instead of being swapped out."""
    waiting = seq("w", "waiting", priority=1, slack=3.0, tokens=300)
    victim = dataclasses.replace(seq("v", slack=0.5, kl_budget=0.5), pages_at={0: 20})
    ctl = joint(demote_kl={8: 0.001, 4: 0.02})
    d = ctl.decide(state(victim, waiting, retention=None, inplace_ratios=INPLACE))
    assert d.demote_in_place == {"v": 8} and d.offload == ()
    d = ctl.decide(state(victim, waiting, retention=None))  # no mixed pool: today's choice
    assert d.demote_in_place == {} and d.offload == ("v",)


def test_in_place_demotion_makes_room_for_running_sequences_to_grow():
    """With no page free, a running sequence whose next token starts a page would be
    preempted mid-step: the in-place baseline demotes the lowest-ranked running sequence's cold
    pages instead, within its KL budget; with a page free, or no mixed pool, nothing."""
    inplace = make_controller("inplace", demote_kl={8: 0.001, 4: 0.02})
    growing = seq("g", priority=1, tokens=4 * P + 1, pages=4)  # its next token needs page 5
    low = dataclasses.replace(seq("v", kl_budget=0.5), pages_at={0: 20})
    d = inplace.decide(state(growing, low, inplace_ratios=INPLACE))
    assert d.demote_in_place == {"v": 8} and d.kl == {"v": 0.001} and d.offload == ()
    assert inplace.decide(state(growing, low, free=1, inplace_ratios=INPLACE)) \
        .demote_in_place == {}
    assert inplace.decide(state(growing, low)).demote_in_place == {}
    exact_only = dataclasses.replace(low, kl_budget=0.0)
    assert inplace.decide(state(growing, exact_only, inplace_ratios=INPLACE)) \
        .demote_in_place == {}


def test_reserve_growth_holds_back_admission_by_the_pages_demotion_cannot_make():
    """With `reserve_growth`, admissions leave a page free for each running sequence's next
    page, less what demoting their cold pages frees: a sequence whose pages are all kept
    exact (no `pages_at`) or whose budget allows no demotion frees none."""
    def running(seq_id, cold, kl_budget=0.5):
        return dataclasses.replace(seq(seq_id, tokens=4 * P + 5, pages=5, kl_budget=kl_budget),
                                   pages_at={0: cold} if cold else {})

    seqs = (running("kept", 0), running("two", 2), running("exact", 9, kl_budget=0.0))
    plain = make_controller("inplace", demote_kl={8: 0.001, 4: 0.02})
    ctl = make_controller("inplace", demote_kl={8: 0.001, 4: 0.02}, reserve_growth=True)
    assert plain.decide(state(*seqs, inplace_ratios=INPLACE)).admit_reserve == 0
    # "two" frees int(2 * (1 - 1/6)) = 1 page at int4 (int(2 * (1 - 1/3.5)) = 1 at int8).
    d = ctl.decide(state(*seqs, inplace_ratios=INPLACE))
    assert d.demote_in_place == {} and d.admit_reserve == 3 - 1
    many = running("two", 20)  # int(20 * (1 - 1/6)) = 16 pages cover everyone's next page
    assert ctl.decide(state(seqs[0], many, seqs[2], inplace_ratios=INPLACE)).admit_reserve == 0
    assert ctl.decide(state(*seqs)).admit_reserve == 0  # no mixed pool: no reserve
