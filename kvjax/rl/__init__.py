"""RL rollouts on the kvjax engine: grouped sampling, GRPO updates, programmatic rewards."""

from kvjax.rl.grpo import (
    GRPOConfig,
    GRPOTrainer,
    group_advantages,
    grpo_loss,
    grpo_update,
    token_logprobs,
)
from kvjax.rl.rewards import ArithmeticProblem, arithmetic_problems, arithmetic_reward
from kvjax.rl.rollout import Rollout, RolloutBatch, pad_batch, rollout

__all__ = [
    "ArithmeticProblem",
    "GRPOConfig",
    "GRPOTrainer",
    "Rollout",
    "RolloutBatch",
    "arithmetic_problems",
    "arithmetic_reward",
    "group_advantages",
    "grpo_loss",
    "grpo_update",
    "pad_batch",
    "rollout",
    "token_logprobs",
]
