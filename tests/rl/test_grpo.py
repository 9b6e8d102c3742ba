"""GRPO: advantages, token logprobs and the clipped loss against numpy; one update moves the
policy toward positively-advantaged completions; the arithmetic reward scores what it says.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine.request import FinishReason
from kvjax.models import llama
from kvjax.rl import (
    GRPOConfig,
    GRPOTrainer,
    RolloutBatch,
    arithmetic_problems,
    arithmetic_reward,
    group_advantages,
    grpo_loss,
    pad_batch,
    token_logprobs,
)
from kvjax.rl.grpo import merge_params, split_params
from kvjax.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def _log_softmax_np(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def test_group_advantages_match_a_per_group_loop():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=12)
    rewards[8:] = 0.5  # a group whose samples all scored the same
    adv = group_advantages(rewards, 4, eps=1e-6)
    for g in range(3):
        r = rewards[4 * g:4 * g + 4]
        expected = [(x - sum(r) / 4) / (np.sqrt(sum((y - sum(r) / 4) ** 2 for y in r) / 4)
                                        + 1e-6) for x in r]
        np.testing.assert_allclose(adv[4 * g:4 * g + 4], expected, rtol=1e-5, atol=1e-6)
    assert not adv[8:].any()
    with pytest.raises(ValueError, match="group_size=5"):
        group_advantages(rewards, 5)


def test_token_logprobs_match_per_sequence_numpy_and_ignore_right_padding(model):
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 128, size=n).astype(np.int32) for n in (7, 12)]
    tokens = np.zeros((2, 16), np.int32)
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = row
    lp = np.asarray(token_logprobs(model.params, model.config, jnp.asarray(tokens)))
    assert lp.shape == (2, 16) and not lp[:, 0].any()
    for b, row in enumerate(rows):
        logits = np.asarray(llama.forward_dense(model.params, model.config, jnp.asarray(row)))
        expected = _log_softmax_np(logits[:-1])[np.arange(len(row) - 1), row[1:]]
        np.testing.assert_allclose(lp[b, 1:len(row)], expected, atol=1e-5)


def _batch(model, seed=2, group=4):
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, 120, size=6)] for _ in range(2)]
    completions = [[int(t) for t in rng.integers(0, 120, size=rng.integers(3, 8))]
                   for _ in range(2 * group)]
    padded_prompts = [prompts[b // group] for b in range(2 * group)]
    reasons = [FinishReason.LENGTH] * (2 * group)
    tokens, mask, _ = pad_batch(padded_prompts, completions, [np.zeros(len(c)) for c in
                                                                completions], reasons)
    # On-policy: the behaviour logprobs are the current model's.
    old = np.asarray(token_logprobs(model.params, model.config, jnp.asarray(tokens))) * mask
    logprobs = [old[b, 6:6 + len(c)] for b, c in enumerate(completions)]
    return RolloutBatch(prompt_ids=prompts, group_size=group, completion_ids=completions,
                        logprobs=logprobs, token_versions=[["0"] * len(c) for c in completions],
                        finish_reasons=reasons, texts=[None] * (2 * group), tokens=tokens,
                        loss_mask=mask, old_logprobs=old)


def test_loss_matches_numpy_clipped_surrogate(model):
    batch = _batch(model)
    rng = np.random.default_rng(3)
    old = batch.old_logprobs + rng.normal(scale=0.3, size=batch.tokens.shape) * batch.loss_mask
    adv = rng.normal(size=batch.num_samples).astype(np.float32)
    loss, aux = grpo_loss(model.params, model.config, jnp.asarray(batch.tokens),
                          jnp.asarray(batch.loss_mask), jnp.asarray(old, jnp.float32),
                          jnp.asarray(adv), clip_eps=0.2)
    ratio = np.exp(batch.old_logprobs - old)  # the current logprobs are batch.old_logprobs
    terms = np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.2) * adv[:, None])
    mask = batch.loss_mask
    np.testing.assert_allclose(float(loss), -(terms * mask).sum() / mask.sum(), rtol=1e-4)
    clipped = ((np.abs(ratio - 1) > 0.2) * mask).sum() / mask.sum()
    assert 0 < clipped < 1
    np.testing.assert_allclose(float(aux["clip_fraction"]), clipped, rtol=1e-5)


def test_one_update_raises_likelihood_of_positive_advantage_completions(model):
    batch = _batch(model)
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    trainer = GRPOTrainer(model.config, model.params, GRPOConfig(learning_rate=1e-3))
    metrics = trainer.update(batch, rewards)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    before = (batch.old_logprobs * batch.loss_mask).sum(axis=1)  # [B] sequence log-likelihood
    new = np.asarray(token_logprobs(trainer.params, model.config, jnp.asarray(batch.tokens)))
    after = (new * batch.loss_mask).sum(axis=1)
    positive = np.asarray(rewards) > 0.5
    assert np.all(after[positive] > before[positive])
    assert np.all(after[~positive] < before[~positive])


def test_only_trainable_params_change(model):
    batch = _batch(model)
    grpo = GRPOConfig(learning_rate=1e-3, trainable=("final_norm", "layers/w_down"))
    trainer = GRPOTrainer(model.config, model.params, grpo)
    trainer.update(batch, [1.0, 0.0] * 4)
    changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                           model.params, trainer.params)
    assert changed["final_norm"] and changed["layers"]["w_down"]
    assert not changed["embed"] and not changed["layers"]["wq"]
    assert not changed["layers"]["attn_norm"]
    train, frozen = split_params(model.params, grpo.trainable)
    assert jax.tree.structure(merge_params(train, frozen)) == jax.tree.structure(model.params)
    with pytest.raises(ValueError, match="'layers/nope'"):
        GRPOTrainer(model.config, model.params, GRPOConfig(trainable=("layers/nope",)))


def test_arithmetic_problems_and_reward_tiers():
    problems = arithmetic_problems(20, seed=4)
    assert problems == arithmetic_problems(20, seed=4)
    for p in problems:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\? Answer with a number\.",
                                     p.question).groups())
        assert 1 <= a <= 9 and 1 <= b <= 9 and p.answer == a + b
    assert arithmetic_reward("12", 12) == 1.0
    assert arithmetic_reward("The answer is 12.", 12) == 1.0
    assert arithmetic_reward("7 + 5 = 12", 12) == 0.5
    assert arithmetic_reward("It is 13, not 121", 12) == 0.1
    assert arithmetic_reward("twelve", 12) == 0.0
