"""RL rollouts on the kvjax engine: grouped sampling, GRPO updates, programmatic rewards, and
rollout workers over several engines (in this process or as Ray actors), and multi-turn
(agentic) trajectories placed on the worker holding their pages, moved with them when loads
drift apart."""

from kvjax.rl.agentic import Migration, TrajectoryRun, TurnPlacement, run_trajectories
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
from kvjax.rl.workers import (
    LocalRolloutPool,
    RayRolloutPool,
    RolloutPool,
    RolloutWorker,
    SamplePlacement,
)

__all__ = [
    "ArithmeticProblem",
    "GRPOConfig",
    "GRPOTrainer",
    "LocalRolloutPool",
    "Migration",
    "RayRolloutPool",
    "Rollout",
    "RolloutBatch",
    "RolloutPool",
    "RolloutWorker",
    "SamplePlacement",
    "TrajectoryRun",
    "TurnPlacement",
    "arithmetic_problems",
    "arithmetic_reward",
    "group_advantages",
    "grpo_loss",
    "grpo_update",
    "pad_batch",
    "rollout",
    "run_trajectories",
    "token_logprobs",
]
