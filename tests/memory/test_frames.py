"""The shared frame pool: block managers of several models drawing frames from one ledger.

A hypothesis state machine drives two models' block managers (prefix caches on, prompts from a
small alphabet so pages are shared and cached) and one static-partition pool, and checks the
ledger against a brute-force recount after every operation: each frame belongs to at most one
model, a model's block tables and cached pages hold only frames the ledger gave it, the ledger's
counts equal the recount, and frames in use plus resident weights never exceed the budget.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax.memory.block_manager import AllocStatus, BlockManager
from kvjax.memory.frames import FramePool, make_pool_policy

FRAME = 64
P = 2


def _pool(policy: str, weights=(3 * FRAME, 2 * FRAME), budget=16 * FRAME):
    pool = FramePool(budget, FRAME, make_pool_policy(policy))
    managers = {}
    for name, weight in zip("ab", weights, strict=True):
        owner = pool.add_owner(name, weight)
        pool.set_weights_resident(name, True)
        manager = managers[name] = BlockManager(pool.num_frames, P, pages=pool.pages(name))
        owner.evictable, owner.give_back = manager.num_givable_pages, manager.give_back_cached
        owner.is_idle = lambda: False  # weights stay: only cached pages give way here
    pool.reclaim = lambda requester, n: pool.give_way_cached(requester, n)
    return pool, managers


def _holdings(manager: BlockManager, seqs) -> set[int]:
    """Brute force: every frame a model holds, from its block tables and its prefix cache."""
    held = {p for s in seqs for p in manager.block_table(s)}
    cache = manager.prefix_cache
    return held | {p for p in range(manager.num_pages) if cache.is_indexed(p)}


class SharedPoolMachine(RuleBasedStateMachine):
    policy = "elastic"

    def __init__(self):
        super().__init__()
        self.pool, self.managers = _pool(self.policy)
        self.seqs = {"a": set(), "b": set()}
        self.next_id = 0

    @rule(model=st.sampled_from("ab"),
          tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def add(self, model, tokens):
        manager, seq = self.managers[model], f"s{self.next_id}"
        self.next_id += 1
        manager.add_sequence(seq, tokens)
        start = manager.num_tokens_cached(seq)
        status, _ = manager.ensure_writable(seq, start, len(tokens))
        if status is AllocStatus.NO_PAGES:
            manager.free(seq)  # the scheduler would preempt; nothing may have changed
            return
        manager.commit(seq, tokens)
        self.seqs[model].add(seq)

    @precondition(lambda self: any(self.seqs.values()))
    @rule(data=st.data())
    def free(self, data):
        model = data.draw(st.sampled_from([m for m in "ab" if self.seqs[m]]))
        seq = data.draw(st.sampled_from(sorted(self.seqs[model])))
        self.managers[model].free(seq)
        self.seqs[model].discard(seq)

    @invariant()
    def ledger_matches_a_recount(self):
        held = {m: _holdings(self.managers[m], self.seqs[m]) for m in "ab"}
        assert not held["a"] & held["b"], "a frame belongs to two models"
        for m in "ab":
            assert self.pool.owners[m].frames == len(held[m])
        assert self.pool.frames_in_use == len(held["a"] | held["b"])
        assert self.pool.used_bytes <= self.pool.budget_bytes
        quota = self.pool.policy.quota(self.pool, self.pool.owners["a"])
        if quota is not None:
            assert all(self.pool.owners[m].frames <= quota for m in "ab")


class StaticPoolMachine(SharedPoolMachine):
    policy = "static"


TestElasticPool = SharedPoolMachine.TestCase
TestElasticPool.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestStaticPool = StaticPoolMachine.TestCase
TestStaticPool.settings = settings(max_examples=20, stateful_step_count=30, deadline=None)


def test_elastic_pool_hands_one_models_cold_pages_to_another():
    pool, managers = _pool("elastic")
    a, b = managers["a"], managers["b"]
    usable = pool.num_frames - (3 + 2)
    a.add_sequence("x", list(range(usable * P)))
    assert a.ensure_writable("x", 0, usable * P)[0] is AllocStatus.OK
    a.commit("x", list(range(usable * P)))
    a.free("x")  # every frame stays cached by model a
    assert pool.frames_in_use == usable and b.num_free_pages() == usable
    b.add_sequence("y", [5] * (usable * P))
    assert b.ensure_writable("y", 0, usable * P)[0] is AllocStatus.OK
    assert pool.owners["a"].frames == 0 and a.stats.evictions == usable


def test_static_pool_keeps_each_model_to_its_share():
    pool, managers = _pool("static")
    share = (pool.budget_bytes - 5 * FRAME) // 2 // FRAME
    managers["a"].add_sequence("x", list(range(share * P + 1)))
    assert managers["a"].ensure_writable("x", 0, share * P + 1)[0] is AllocStatus.NO_PAGES
    assert managers["a"].ensure_writable("x", 0, share * P)[0] is AllocStatus.OK
    assert managers["b"].num_free_pages() == share


def test_weights_that_do_not_fit_are_refused():
    pool, _ = _pool("elastic")
    pool.add_owner("big", pool.free_bytes + FRAME)
    with pytest.raises(ValueError, match="do not fit"):
        pool.set_weights_resident("big", True)
    assert not pool.owners["big"].weights_resident
