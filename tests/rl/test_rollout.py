"""Rollouts: the padded batch a trainer consumes, reproducible seeds, per-token weights versions.

Oracle: `forward_dense` (cache-free recomputation) scoring the sampled tokens under the weights
the rollout says produced them.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason, WeightUpdatePolicy
from kvjax.rl import Rollout, pad_batch, rollout, token_logprobs
from kvjax.testing import random_prompts

CONFIG = dict(page_size=4, num_pages=128, max_num_batched_tokens=64, max_prefill_chunk=32,
              max_num_seqs=16, debug_provenance=True)
SAMPLING = SamplingParams(max_new_tokens=8, temperature=1.0)
GROUP = 3


@pytest.fixture(scope="module")
def prompts():
    return random_prompts((5, 11, 8), seed=2)


@pytest.fixture(scope="module")
def dense_logprobs(policy_models):
    config = policy_models[0].config
    return jax.jit(lambda params, tokens: token_logprobs(params, config, tokens))


def test_batch_layout_and_logprobs_match_dense_recomputation(policy_models, prompts,
                                                             dense_logprobs):
    model = policy_models[0]
    batch = rollout(Engine(model, EngineConfig(**CONFIG)), prompts, SAMPLING, group_size=GROUP,
                    seed=3)
    assert batch.num_samples == len(prompts) * GROUP
    assert batch.group_index.tolist() == [b // GROUP for b in range(batch.num_samples)]
    assert batch.tokens.shape == batch.loss_mask.shape == batch.old_logprobs.shape
    assert batch.tokens.shape[1] % 16 == 0
    eos = model.config.eos_token_ids[0]
    for b, completion in enumerate(batch.completion_ids):
        prompt = prompts[b // GROUP]
        start, end = len(prompt), len(prompt) + len(completion)
        assert batch.tokens[b, :end].tolist() == prompt + completion
        assert not batch.tokens[b, end:].any()
        assert batch.loss_mask[b].tolist() == [float(start <= t < end)
                                               for t in range(batch.tokens.shape[1])]
        np.testing.assert_array_equal(batch.old_logprobs[b, start:end], batch.logprobs[b])
        expected = FinishReason.STOP if completion[-1] == eos else FinishReason.LENGTH
        assert batch.finish_reasons[b] is expected
        assert len(completion) == SAMPLING.max_new_tokens or expected is FinishReason.STOP
        assert batch.token_versions[b] == [model.weights_version] * len(completion)
    dense = np.asarray(dense_logprobs(model.params, batch.tokens))
    np.testing.assert_allclose(dense * batch.loss_mask, batch.old_logprobs, atol=2e-5)


def test_seeds_reproduce_a_rerun_and_differ_between_prompts(policy_models, prompts):
    engine = Engine(policy_models[0], EngineConfig(**CONFIG))
    same = [prompts[0], prompts[0]]
    first = rollout(engine, same, SAMPLING, group_size=GROUP, seed=11, name="a")
    again = rollout(engine, same, SAMPLING, group_size=GROUP, seed=11, name="b")
    other = rollout(engine, same, SAMPLING, group_size=GROUP, seed=12, name="c")
    assert first.completion_ids == again.completion_ids
    np.testing.assert_array_equal(first.tokens, again.tokens)
    groups = [first.completion_ids[g * GROUP:(g + 1) * GROUP] for g in range(2)]
    assert groups[0] != groups[1], "equal prompts at different indices get different seeds"
    assert len({tuple(c) for c in groups[0]}) > 1, "samples of a group differ"
    assert other.completion_ids != first.completion_ids


@pytest.mark.parametrize("policy", list(WeightUpdatePolicy), ids=lambda p: p.value)
def test_update_in_flight_tags_each_token_with_the_weights_that_sampled_it(
        policy_models, prompts, dense_logprobs, policy):
    old, new = policy_models
    engine = Engine(old, EngineConfig(**CONFIG))
    # Stop tokens end samples at different times, so some finish before the update.
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True,
                              stop_token_ids=tuple(range(0, 128, 6)))
    run = Rollout(engine, prompts, sampling, group_size=GROUP, seed=5)
    for _ in range(5):
        run.step()
    before = {(o.request_id, s.index): (len(s.token_ids), s.finish_reason)
              for o in engine.snapshot_outputs() for s in o.outputs}
    assert any(r is not None for _, r in before.values()) and any(
        r is None and n > 0 for n, r in before.values()), "the update should land mid-group"
    engine.update_weights(new.params, "v1", in_flight=policy)
    run.run()
    batch = run.result()
    assert engine.stats["stale_kv_reads"] == 0
    params = {old.weights_version: old.params, "v1": new.params}
    scored = {v: np.asarray(dense_logprobs(p, batch.tokens)) for v, p in params.items()}
    for b, versions in enumerate(batch.token_versions):
        # A request absent from the streaming outputs had finished before the update.
        num_before, reason_before = before.get((run.request_ids[b // GROUP], b % GROUP),
                                               (len(versions), "finished"))
        olds = [old.weights_version] * num_before
        if policy is WeightUpdatePolicy.RECOMPUTE or reason_before is not None:
            assert versions == olds + ["v1"] * (len(versions) - num_before)
        elif policy is WeightUpdatePolicy.FINISH_OLD:
            assert versions == [old.weights_version] * len(versions)
        else:
            assert batch.finish_reasons[b] is FinishReason.ABORT
            assert versions == olds
            assert not batch.loss_mask[b].any(), "aborted samples carry no loss"
        start = len(prompts[b // GROUP])
        # Float32 sums in another order (the decode step's matmuls and attention kernels) move
        # a logprob by ~1e-5; the other weights version's is orders of magnitude further.
        for i, version in enumerate(versions):
            assert batch.old_logprobs[b, start + i] == pytest.approx(
                scored[version][b, start + i], abs=1e-4)


def test_invalid_requests_queue_nothing(policy_models, prompts):
    engine = Engine(policy_models[0], EngineConfig(**CONFIG))
    with pytest.raises(ValueError, match="conflicts with group_size=3"):
        Rollout(engine, prompts, SamplingParams(n=2), group_size=GROUP)
    with pytest.raises(ValueError, match="token id 500"):
        Rollout(engine, [prompts[0], [500]], SAMPLING, group_size=GROUP)
    assert not engine.has_unfinished()
    run = Rollout(engine, prompts[:1], SAMPLING, group_size=GROUP)
    with pytest.raises(ValueError, match="unfinished"):
        run.result()
    with pytest.raises(ValueError, match="pad_to=4"):
        pad_batch([[1, 2, 3]], [[4, 5]], [np.zeros(2)], [FinishReason.LENGTH], pad_to=4)


def test_batch_invariant_rollout_logprobs_equal_the_trainers_bit_for_bit(policy_models, prompts):
    """Sampled rollouts of a batch-invariant engine, scored again by the trainer's forward
    (`token_logprobs(..., page_size=)`): every completion token's logprob is bitwise the one
    the engine recorded, so GRPO's on-policy ratio is exactly 1 and its gradient flows."""
    from kvjax.models import invariant
    from kvjax.rl import GRPOConfig, GRPOTrainer

    if invariant.unavailable_reason() is not None:
        pytest.skip(invariant.unavailable_reason())
    model = policy_models[0]
    engine = Engine(model, EngineConfig(**CONFIG, batch_invariant=True))
    batch = rollout(engine, prompts, SAMPLING, group_size=GROUP, seed=3)
    score = jax.jit(lambda params, tokens: token_logprobs(params, model.config, tokens,
                                                         page_size=CONFIG["page_size"]))
    trainer_side = np.asarray(score(model.params, batch.tokens))
    mask = batch.loss_mask.astype(bool)
    np.testing.assert_array_equal(trainer_side[mask], batch.old_logprobs[mask])
    trainer = GRPOTrainer(model.config, model.params, GRPOConfig(
        learning_rate=1e-3, invariant_page_size=CONFIG["page_size"]))
    metrics = trainer.update(batch, [1.0, 0.0, 0.5] * len(prompts))
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    assert metrics["grad_norm"] > 0
