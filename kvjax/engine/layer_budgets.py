"""An engine's layer groups and retention record under a per-layer retention schedule or a
per-head split (`EngineConfig.retention_schedule`, `kvjax.kv.layer_retention`,
`kvjax.kv.head_retention`)."""

from __future__ import annotations

from typing import Any

from kvjax.config import ModelConfig
from kvjax.engine.config import EngineConfig
from kvjax.kv.budgets import BudgetSchedule, BudgetScheme, HeadAllocation
from kvjax.kv.head_retention import HeadRetention, head_layer_groups
from kvjax.kv.layer_retention import GroupedRetention, check_schedule, schedule_layer_groups
from kvjax.kv.retention_host import RetentionManager, RetentionPolicy, make_retention
from kvjax.kv.spec import LayerGroup, table_groups


def _policy_and_scheme(config: EngineConfig) -> tuple[RetentionPolicy, BudgetScheme]:
    """The engine's retention policy and its checked budget scheme."""
    policy = make_retention(config.retention, config.retention_budget, config.page_size,
                            **config.retention_options)
    return policy, check_schedule(config.retention_schedule, policy,
                                  config.retention_head_floor)


def pool_layer_groups(mc: ModelConfig, config: EngineConfig, max_model_len: int
                      ) -> tuple[LayerGroup, ...]:
    """The layer groups the pool keeps: the model's (`ModelConfig.kv_layer_groups`), or under
    a per-layer schedule one group per run of layers with equal budgets."""
    policy, scheme = _policy_and_scheme(config)
    if scheme.head_allocation is not HeadAllocation.UNIFORM:
        return head_layer_groups(policy, mc.num_layers, mc.kv_layer_groups()[0].format,
                                 max_model_len, scheme)
    if scheme.schedule is BudgetSchedule.UNIFORM:
        return mc.kv_layer_groups()
    return schedule_layer_groups(policy, scheme, mc.num_layers,
                                 mc.kv_layer_groups()[0].format, max_model_len)


def retention_manager(mc: ModelConfig, config: EngineConfig, groups: tuple[LayerGroup, ...],
                      tokenizer: Any = None, max_model_len: int | None = None
                      ) -> RetentionManager:
    """The engine's retention record: one view per sequence, or one per table group when the
    pool's groups keep budgets of their own in several block tables (per (layer, kv head)
    under a head-wise split: adakv, per_head, global). tokenizer: the model's, which encodes
    the probes of a policy that needs it (kvzip); max_model_len: the longest sequence, which
    bounds what one head's table keeps under a head-wise split."""
    policy, scheme = _policy_and_scheme(config)
    if policy.needs_tokenizer:
        policy = policy.bind_tokenizer(tokenizer)
    if scheme.head_allocation is not HeadAllocation.UNIFORM:
        return HeadRetention(policy, groups, scheme=scheme, rope=mc.rope,
                             max_len=max_model_len)
    if len(table_groups([(g.layers, 0) for g in groups])) == 1 or \
            config.retention_schedule == BudgetSchedule.UNIFORM.value:
        return RetentionManager(policy, rope=mc.rope)
    return GroupedRetention(policy, scheme, groups, rope=mc.rope)
