"""Rollouts over several workers: the same samples as one engine, tokens tagged with the weights
that sampled them across a broadcast update, and Ray actors giving the in-process pool's batch.

Oracles: one engine's `Rollout` over all prompts (sharding must not change a sample), and
`forward_dense` scoring each token under the version the batch says sampled it. Ray is an
optional extra: the case that starts Ray is in tests/slow_cases.txt.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.request import WeightUpdatePolicy
from kvjax.rl import Rollout, RolloutBatch, token_logprobs
from kvjax.rl.workers import LocalRolloutPool, SamplePlacement, place_samples, shard_bounds
from kvjax.testing import random_prompts, tiny_model

CONFIG = EngineConfig(page_size=4, num_pages=128, max_num_batched_tokens=64,
                      max_prefill_chunk=32, max_num_seqs=16, debug_provenance=True)
# Stop tokens end samples at different times, so an update lands mid-group.
SAMPLING = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True,
                          stop_token_ids=tuple(range(0, 128, 6)))
GROUP = 3
UPDATE_AT = 4  # Pool steps before the update lands.


@pytest.fixture(scope="module")
def prompts():
    return random_prompts((5, 11, 8, 6, 9), seed=2)


def run_pool(pool, prompts, new_params) -> tuple[RolloutBatch, dict]:
    """A rollout with `new_params` landing (as 'v1') after `UPDATE_AT` steps, then the rest."""
    pool.start(prompts, SAMPLING, group_size=GROUP, seed=7)
    for _ in range(UPDATE_AT):
        pool.step()
    in_flight = pool.num_in_flight()
    pool.update_weights(new_params, "v1", in_flight=WeightUpdatePolicy.RECOMPUTE)
    while not pool.step():
        pass
    return pool.result(), dict(pool.stats(), in_flight=in_flight)


def test_shard_bounds_cover_prompts_in_order():
    assert shard_bounds(5, 2) == [(0, 2), (2, 5)]
    assert shard_bounds(2, 3) == [(0, 1), (1, 2)]
    for n, w in ((7, 3), (16, 4), (1, 1)):
        bounds = shard_bounds(n, w)
        assert [i for a, b in bounds for i in range(a, b)] == list(range(n))
        assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


@pytest.mark.parametrize("placement", list(SamplePlacement), ids=lambda p: p.value)
def test_placement_puts_every_sample_on_one_worker(placement):
    placed = place_samples(5, 3, 2, placement)
    samples = sorted((p, first + i) for part in placed for p, first, n in part for i in range(n))
    assert samples == [(p, i) for p in range(5) for i in range(3)]
    prompts_per_worker = [{p for p, _, _ in part} for part in placed]
    if placement is SamplePlacement.GROUP:
        assert not prompts_per_worker[0] & prompts_per_worker[1]
    else:
        assert prompts_per_worker[0] == prompts_per_worker[1] == set(range(5))


@pytest.mark.parametrize("placement", list(SamplePlacement), ids=lambda p: p.value)
def test_two_workers_sample_what_one_engine_samples(policy_models, prompts, placement):
    model = policy_models[0]
    run = Rollout(Engine(model, CONFIG), prompts, SAMPLING, group_size=GROUP, seed=7)
    run.run()
    expected = run.result()
    pool = LocalRolloutPool(2, lambda: model, CONFIG, placement=placement)
    pool.start(prompts, SAMPLING, group_size=GROUP, seed=7)
    while not pool.step():
        pass
    got = pool.result()
    assert got.completion_ids == expected.completion_ids
    assert got.finish_reasons == expected.finish_reasons
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_array_equal(got.loss_mask, expected.loss_mask)
    # Other batch compositions sum float32 in another order: ~1e-5 on a logprob.
    np.testing.assert_allclose(got.old_logprobs, expected.old_logprobs, atol=1e-4)
    stats = pool.stats()
    # A group request prefills its prompt but the last token once, then each sample's last
    # token; single-sample requests prefill their whole prompt or hit the prefix cache.
    once = sum(len(p) - 1 + GROUP for p in prompts)
    if placement is SamplePlacement.GROUP:
        assert stats["prefill_tokens"] == once
    else:
        assert stats["prefill_tokens"] + stats["prefix_hit_tokens"] == GROUP * sum(
            map(len, prompts))
        assert stats["prefill_tokens"] > once


def test_broadcast_update_tags_each_token_with_the_weights_that_sampled_it(policy_models, prompts):
    old, new = policy_models
    batch, stats = run_pool(LocalRolloutPool(2, lambda: old, CONFIG), prompts, new.params)
    assert stats["weight_updates"] == 2 and stats["stale_kv_reads"] == 0
    assert stats["in_flight"] > 0, "the update should land while samples are in flight"
    versions = {v for vs in batch.token_versions for v in vs}
    assert versions == {old.weights_version, "v1"}
    score = jax.jit(lambda params, tokens: token_logprobs(params, old.config, tokens))
    scored = {old.weights_version: np.asarray(score(old.params, batch.tokens)),
              "v1": np.asarray(score(new.params, batch.tokens))}
    for b, token_versions in enumerate(batch.token_versions):
        start = len(batch.prompt_ids[b // GROUP])
        assert token_versions == sorted(token_versions, key=lambda v: v == "v1"), \
            "old-weights tokens come first"
        for i, version in enumerate(token_versions):
            assert batch.old_logprobs[b, start + i] == pytest.approx(
                scored[version][b, start + i], abs=1e-4)


def test_ray_actors_give_the_in_process_pool_batch(policy_models, prompts):
    from kvjax.parallel.ray_local import init_local_ray
    from kvjax.rl.workers import RayRolloutPool

    old, new = policy_models
    expected, expected_stats = run_pool(LocalRolloutPool(2, lambda: old, CONFIG), prompts,
                                        new.params)
    init_local_ray(2)
    try:
        pool = RayRolloutPool(2, functools.partial(tiny_model, seed=0), CONFIG)
        got, stats = run_pool(pool, prompts, new.params)
        pool.shutdown()
    finally:
        import ray

        ray.shutdown()
    assert got.completion_ids == expected.completion_ids
    assert got.token_versions == expected.token_versions
    assert got.finish_reasons == expected.finish_reasons
    np.testing.assert_array_equal(got.old_logprobs, expected.old_logprobs)
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    assert stats == expected_stats
