"""Router: policy choices on hand-made instance states, and greedy tokens whatever the policy.

Oracles: the policies' definitions evaluated by hand below, and a single engine's tokens.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.router import (
    POLICIES,
    Arrival,
    InstanceState,
    Router,
    RouteRequest,
    SimClock,
    make_policy,
    replay,
)
from kvjax.testing import tiny_model

MAX_NEW = 6
PAGE = 4
# Prompts of at most 32 tokens prefill in one step: few step shapes, few compiles.
CONFIG = EngineConfig(page_size=PAGE, num_pages=128, max_num_batched_tokens=256,
                      max_prefill_chunk=32, min_chunk_bucket=32, max_num_seqs=8,
                      max_prefill_seqs=8)


def S(num_seqs: int, num_tokens: int, prefix_tokens: int = 0) -> InstanceState:
    return InstanceState(num_seqs=num_seqs, num_tokens=num_tokens, prefix_tokens=prefix_tokens)


# ----------------------------------------------------------------------------- policies


def test_round_robin_cycles_whatever_the_load():
    policy = make_policy("round_robin")
    states = [S(9, 900), S(0, 0), S(0, 0)]
    assert [policy.choose(RouteRequest(10), states) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_loaded_picks_fewest_queued_tokens_then_lowest_index():
    policy = make_policy("least_loaded")
    assert policy.choose(RouteRequest(10), [S(1, 300), S(5, 120), S(0, 200)]) == 1
    assert policy.choose(RouteRequest(10), [S(2, 50), S(1, 50)]) == 0


def test_prefix_affinity_picks_longest_prefix_and_breaks_ties_by_load():
    policy = make_policy("prefix_affinity")
    request = RouteRequest(100)
    assert policy.choose(request, [S(0, 0, 16), S(30, 3000, 64), S(0, 0, 32)]) == 1
    assert policy.choose(request, [S(3, 300, 0), S(1, 100, 0), S(2, 200, 0)]) == 1


@pytest.mark.parametrize("states", [
    [S(10, 2000, 96), S(0, 0, 0)],
    [S(40, 8000, 96), S(0, 0, 0)],
    [S(3, 600, 64), S(1, 100, 32), S(0, 0, 0)],
    [S(0, 0, 0), S(0, 0, 0)],
])
def test_load_aware_minimizes_new_prefill_times_batch(states):
    request = RouteRequest(100)
    scores = [(request.prompt_len - s.prefix_tokens) * (s.num_seqs + 1) for s in states]
    best = min(range(len(states)), key=lambda i: (scores[i], states[i].num_tokens, i))
    assert make_policy("load_aware").choose(request, states) == best


def test_load_aware_leaves_a_cache_hit_when_its_instance_is_crowded():
    policy = make_policy("load_aware")
    request = RouteRequest(100)
    # 4 new tokens x 11 = 44 beats 100 x 1; 4 x 31 = 124 does not.
    assert policy.choose(request, [S(10, 2000, 96), S(0, 0, 0)]) == 0
    assert policy.choose(request, [S(30, 6000, 96), S(0, 0, 0)]) == 1


def test_unknown_policy_name_raises():
    with pytest.raises(ValueError, match="'nope'"):
        make_policy("nope")
    assert sorted(POLICIES) == ["least_loaded", "load_aware", "prefix_affinity", "round_robin"]


def test_sim_clock_advances_by_busy_time_and_waits():
    clock = SimClock()
    clock.advance_to(2.0)
    with clock.busy():
        time.sleep(0.02)
    assert 2.02 <= clock() < 3.0
    clock.advance_to(1.0)  # never backwards
    assert clock() >= 2.02


# ----------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def engines(model):
    """Three instances, reused across tests so each compiles its step shapes once.

    Their clocks are simulated so `replay` can drive them; outside it they stand still.
    """
    return [Engine(model, CONFIG, clock=SimClock()) for _ in range(3)]


@pytest.fixture(scope="module")
def workload(model):
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(0, 120, size=14)]
    prompts = [(shared if i % 3 else []) + [int(t) for t in rng.integers(
        0, 120, size=int(rng.integers(2, 16)))] for i in range(7)]
    reference = Engine(model, CONFIG).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    return prompts, [o.outputs[0].token_ids for o in reference]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_tokens_match_a_single_engine_whatever_the_policy(engines, workload, policy):
    prompts, reference = workload
    router = Router(engines, policy)
    outputs = router.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert not router.has_unfinished()
    assert all(e.allocator.num_used_pages() == 0 for e in engines)
    if policy == "round_robin":
        assert [router.routed_to[o.request_id] for o in outputs] == [0, 1, 2, 0, 1, 2, 0]


def test_prefix_tokens_see_cached_and_in_flight_prompts(model):
    engines = [Engine(model, CONFIG) for _ in range(2)]
    router = Router(engines, "prefix_affinity")
    prefix = list(range(10, 23))  # 13 tokens: 3 full pages
    router.add_request("a", prefix + [1, 2], SamplingParams(max_new_tokens=2))
    # In flight on instance 0 (not yet computed): its full pages count, tenant-salted.
    assert [s.prefix_tokens for s in router.instance_states(prefix + [7])] == [12, 0]
    assert [s.prefix_tokens for s in router.instance_states(prefix + [7], "other")] == [0, 0]
    assert router.instance_states(prefix + [7])[0].num_seqs == 1
    assert router.instance_states(prefix + [7])[0].num_tokens == 15 + 2
    while router.has_unfinished():
        router.step()
    # Finished: the prefix cache now holds the pages.
    states = router.instance_states(prefix + [7])
    assert [s.prefix_tokens for s in states] == [12, 0]
    assert states[0].num_seqs == 0
    assert router.add_request("b", prefix + [9], SamplingParams(max_new_tokens=2)) == 0


def test_prefix_affinity_keeps_a_shared_prefix_on_one_instance(model):
    router = Router([Engine(model, CONFIG) for _ in range(2)], "prefix_affinity")
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(0, 120, size=16)]
    first = router.add_request("p0", shared + [1, 2, 3], SamplingParams(max_new_tokens=2))
    other = router.add_request("q0", [int(t) for t in rng.integers(0, 120, size=18)],
                               SamplingParams(max_new_tokens=2))
    chosen = [router.add_request(f"p{i}", shared + [i, i + 1], SamplingParams(max_new_tokens=2))
              for i in range(1, 5)]
    assert other != first  # an unrelated prompt goes to the idle instance
    assert chosen == [first] * 4


def test_router_rejects_duplicates_and_reports_invalid_prompts(engines):
    router = Router(engines, "least_loaded")
    router.add_request("dup", [1, 2, 3], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="duplicate request_id 'dup'"):
        router.add_request("dup", [4, 5], SamplingParams(max_new_tokens=1))
    outputs = router.generate([[1, 2, 3], [999]], SamplingParams(max_new_tokens=2))
    assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == 2
    assert "999" in outputs[1].error
    while router.has_unfinished():
        router.step()


def test_replay_gives_the_same_tokens_on_simulated_clocks(engines, workload):
    prompts, reference = workload
    start = max(e.clock() for e in engines)  # the shared engines' clocks may have moved
    arrivals = [Arrival(f"r{i}", start + 0.05 * i, tuple(p),
                        SamplingParams(max_new_tokens=MAX_NEW)) for i, p in enumerate(prompts)]
    outputs = {o.request_id: o for o in replay(Router(engines[:2], "load_aware"), arrivals)}
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == reference
    for a in arrivals:
        out = outputs[a.request_id]
        assert out.arrival_time == a.arrival_time
        assert a.arrival_time < out.first_token_time <= out.token_times[-1] <= out.finish_time
