"""GRPO: group-relative advantages and a clipped policy-gradient update with optax.

For each prompt, a group of samples is scored; a sample's advantage is its reward relative to
its group, `(r - mean(group)) / (std(group) + eps)` (population std), which needs no value
network. The loss is PPO's clipped surrogate over the generated tokens,

    ratio = exp(logp_new - logp_old)
    loss  = -sum(mask * min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)) / sum(mask)

with `logp_old` the logprobs the engine recorded while sampling (the behaviour policy, which
may be older weights when updates land while rollouts are in flight) and `logp_new` recomputed
by `forward_dense` under the current params. There is no KL penalty to a reference model.
With rollouts from an engine with `EngineConfig.batch_invariant`, set
`GRPOConfig.invariant_page_size` to its page size: `logp_new` is then computed by
`kvjax.models.invariant.forward_invariant`, bitwise the engine's logprobs under the same
weights, so the ratio of on-policy tokens is exactly 1 (no numerical off-policy drift).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.config import ModelConfig
from kvjax.models import invariant, llama
from kvjax.rl.rollout import RolloutBatch

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Hyper-parameters of the update.

    Attributes:
      learning_rate: Adam's step size.
      clip_eps: the ratio is clipped to [1 - clip_eps, 1 + clip_eps].
      advantage_eps: added to the group std (groups with equal rewards get advantage 0).
      max_grad_norm: gradients are clipped to this global norm.
      trainable: param paths trained, e.g. ('layers',), ('layers/w_down', 'final_norm');
        a path names a subtree of the params pytree. (): every param.
      invariant_page_size: the page size of a batch-invariant rollout engine: logprobs are
        recomputed as it computes them (see the module docstring); None: `forward_dense`.
    """

    learning_rate: float = 3e-5
    clip_eps: float = 0.2
    advantage_eps: float = 1e-6
    max_grad_norm: float = 1.0
    trainable: tuple[str, ...] = ()
    invariant_page_size: int | None = None

    def __post_init__(self):
        for name in ("learning_rate", "clip_eps", "advantage_eps", "max_grad_norm"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"GRPOConfig.{name} must be > 0, got {value!r}")
        object.__setattr__(self, "trainable", tuple(self.trainable))
        if self.invariant_page_size is not None and not (
                isinstance(self.invariant_page_size, int) and self.invariant_page_size > 0):
            raise ValueError(f"GRPOConfig.invariant_page_size must be None or a positive int, "
                             f"got {self.invariant_page_size!r}")


def group_advantages(rewards: Sequence[float] | np.ndarray, group_size: int, *,
                     eps: float = 1e-6) -> np.ndarray:
    """Group-normalised advantages.

    Args:
      rewards: [B] with B = num_groups * group_size, prompt-major (as in `RolloutBatch`).
    Returns:
      [B] float32, `(r - group mean) / (group std + eps)`.
    """
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or not isinstance(group_size, int) or group_size < 1 or \
            r.shape[0] % group_size:
        raise ValueError(f"rewards of shape {r.shape} do not split into groups of "
                         f"group_size={group_size!r}")
    groups = r.reshape(-1, group_size)  # [num_groups, group_size]
    adv = (groups - groups.mean(axis=1, keepdims=True)) / (groups.std(axis=1, keepdims=True)
                                                           + eps)
    return adv.reshape(-1).astype(np.float32)


def token_logprobs(params: Params, config: ModelConfig, tokens: jax.Array, *,
                   page_size: int | None = None) -> jax.Array:
    """Log-likelihood of each token given the ones before it.

    Args:
      tokens: [B, T] int32 (right padding does not change earlier positions: attention is causal).
      page_size: None: `llama.forward_dense`; else the page size of a batch-invariant engine,
        whose logprobs `kvjax.models.invariant.forward_invariant` reproduces bit for bit.
    Returns:
      [B, T] float32; entry t is log p(tokens[t] | tokens[:t]), entry 0 is 0.
    """
    if page_size is None:
        logits = jax.vmap(lambda row: llama.forward_dense(params, config, row))(tokens)
        logits = logits[:, :-1]  # [B, T-1, V], position t predicts token t+1
        picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
        lp = picked - jax.nn.logsumexp(logits, axis=-1)  # [B, T-1]
    else:
        def row(ids):  # one sequence at a time: the native kernels take no batch axis
            logprobs = invariant.log_softmax(
                invariant.forward_invariant(params, config, ids, page_size))[:-1]  # [T-1, V]
            return jnp.take_along_axis(logprobs, ids[1:, None], axis=-1)[:, 0]  # [T-1]

        lp = jax.lax.map(row, tokens)  # [B, T-1]
    return jnp.pad(lp, ((0, 0), (1, 0)))  # [B, T]


def grpo_loss(params: Params, config: ModelConfig, tokens: jax.Array, loss_mask: jax.Array,
              old_logprobs: jax.Array, advantages: jax.Array, *, clip_eps: float,
              page_size: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped surrogate loss (see module docstring) and diagnostics.

    Args:
      tokens: [B, T] int32; loss_mask, old_logprobs: [B, T] float32; advantages: [B] float32.
      page_size: as in `token_logprobs`.
    Returns:
      (loss scalar, {'ratio_mean', 'clip_fraction', 'logprob_mean'} over masked tokens).
    """
    new = token_logprobs(params, config, tokens, page_size=page_size)  # [B, T]
    ratio = jnp.exp(new - old_logprobs)  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    objective = jnp.minimum(ratio * adv, clipped * adv)  # [B, T]
    count = jnp.maximum(jnp.sum(loss_mask), 1.0)
    loss = -jnp.sum(objective * loss_mask) / count
    aux = dict(ratio_mean=jnp.sum(ratio * loss_mask) / count,
               clip_fraction=jnp.sum((jnp.abs(ratio - 1.0) > clip_eps) * loss_mask) / count,
               logprob_mean=jnp.sum(new * loss_mask) / count)
    return loss, aux


def split_params(params: Params, trainable: Sequence[str]) -> tuple[Params, Params]:
    """(trainable, frozen): two nested dicts that together hold every leaf of `params` once.

    Raises ValueError naming a path of `trainable` that is not in `params`.
    """
    if not trainable:
        return params, {}
    for path in trainable:
        node = params
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                raise ValueError(f"trainable path {path!r} is not in the params "
                                 f"(top level: {sorted(params)})")
            node = node[part]

    def split(node: Params, prefix: str) -> tuple[Params, Params]:
        train, frozen = {}, {}
        for key, value in node.items():
            path = f"{prefix}{key}"
            if any(path == p or path.startswith(p + "/") for p in trainable):
                train[key] = value
            elif isinstance(value, dict) and any(p.startswith(path + "/") for p in trainable):
                train[key], frozen[key] = split(value, path + "/")
            else:
                frozen[key] = value
        return train, frozen

    return split(params, "")


def merge_params(trainable: Params, frozen: Params) -> Params:
    """The inverse of `split_params`."""
    merged = dict(frozen)
    for key, value in trainable.items():
        merged[key] = merge_params(value, frozen[key]) if key in frozen else value
    return merged


def make_optimizer(grpo: GRPOConfig) -> optax.GradientTransformation:
    """Adam after global-norm gradient clipping."""
    return optax.chain(optax.clip_by_global_norm(grpo.max_grad_norm),
                       optax.adam(grpo.learning_rate))


@functools.partial(jax.jit, static_argnames=("config", "grpo"), donate_argnames=("opt_state",))
def grpo_update(trainable: Params, frozen: Params, opt_state: optax.OptState, tokens: jax.Array,
                loss_mask: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, *,
                config: ModelConfig, grpo: GRPOConfig
                ) -> tuple[Params, optax.OptState, dict[str, jax.Array]]:
    """One optimizer step on the trainable params; returns them, the new opt state, metrics."""

    def loss_fn(train):
        return grpo_loss(merge_params(train, frozen), config, tokens, loss_mask, old_logprobs,
                         advantages, clip_eps=grpo.clip_eps, page_size=grpo.invariant_page_size)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    updates, opt_state = make_optimizer(grpo).update(grads, opt_state, trainable)
    metrics = dict(aux, loss=loss, grad_norm=optax.global_norm(grads))
    return optax.apply_updates(trainable, updates), opt_state, metrics


class GRPOTrainer:
    """Holds the params being trained and their optimizer state.

    Attributes:
      config: the model architecture.
      grpo: the update's hyper-parameters.
      num_updates: optimizer steps taken.
    """

    def __init__(self, config: ModelConfig, params: Params, grpo: GRPOConfig | None = None):
        self.config = config
        self.grpo = grpo = grpo or GRPOConfig()
        self._trainable, self._frozen = split_params(params, grpo.trainable)
        self._opt_state = make_optimizer(grpo).init(self._trainable)
        self.num_updates = 0

    @property
    def params(self) -> Params:
        """The full params pytree (trained and frozen parts)."""
        return merge_params(self._trainable, self._frozen)

    def update(self, batch: RolloutBatch, rewards: Sequence[float]) -> dict[str, float]:
        """One GRPO step on a rollout batch with one reward per sample; returns metrics."""
        if len(rewards) != batch.num_samples:
            raise ValueError(f"got {len(rewards)} rewards for {batch.num_samples} samples")
        advantages = group_advantages(rewards, batch.group_size, eps=self.grpo.advantage_eps)
        self._trainable, self._opt_state, metrics = grpo_update(
            self._trainable, self._frozen, self._opt_state, jnp.asarray(batch.tokens),
            jnp.asarray(batch.loss_mask), jnp.asarray(batch.old_logprobs),
            jnp.asarray(advantages), config=self.config, grpo=self.grpo)
        self.num_updates += 1
        return {k: float(v) for k, v in metrics.items()}
