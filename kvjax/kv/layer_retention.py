"""Per-layer retention budgets in the engine: PyramidKV's schedule over a scoring press.

`EngineConfig.retention_schedule='pyramid'` shares the press's budget B over the layers
(`kvjax.kv.budgets.pyramid_budgets`: more tokens in lower layers, fewer in upper ones, L * B in
all) and frees the pages each layer no longer needs:

  * the pool's layers are split into table groups of equal budget
    (`kvjax.kv.budgets.budget_layer_groups`, budgets at the longest context), each with a
    block table of its own and its own cached length per sequence (`StepInput.group_kv_lens`);
  * the step scores keys per table group (`StepOutput.key_scores` [R, G, W*P]: each group's
    attention summed over its layers, query heads and weighted queries);
  * when the press decides (when the prefill completes), each table group keeps its own top
    tokens: the press's own choice (SnapKV's window and pooling, as on the uniform path)
    over the group's scores, with the group's budget for a prompt of S tokens (the largest of
    its layers' `pyramid_budgets(L, B, S, window)`, at least one token); each group is
    compacted by a COMPACT op of its own and the pages beyond its budget go back to the pool
    (`GroupedBlockManager.retain_groups`), so a sequence then holds sum over groups of
    ceil(B_g / P) pages;
  * decode appends to every group at its own cached length.

Every layer keeps the press's protected tokens (SnapKV's observation window,
ExpectedAttention's sinks: `RetentionPolicy.protected_tokens`) inside its budget, as
PyramidKV keeps its window. Only presses that compress the prompt once, from the step's key
scores, when its prefill completes (snapkv, knorm, expected_attention, observed_attention:
`compresses_once`) have a per-layer schedule here; `kvjax.engine.compat` refuses the others
and the features that address a sequence's pages through one cached length.

Plain numpy, no jax: the KV cache manager and the scheduler import it.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kvjax.kv.budgets import BudgetSchedule, BudgetScheme, HeadAllocation, budget_layer_groups
from kvjax.kv.retention_host import (
    CacheView,
    CompactionPlan,
    Probe,
    RetentionManager,
    RetentionPolicy,
    SeqLayout,
    _merge_probe,
    view_of,
    view_record,
)
from kvjax.kv.spec import LayerGroup, TokenFormat, table_groups
from kvjax.registry import Registry

# `EngineConfig.retention_schedule` -> its `BudgetScheme`: the per-layer schedules, the
# head-wise splits (`kvjax.kv.head_retention`: AdaKV's, per_head, every head the budget by
# its own scores, and global, AdaKV's split over every layer's heads at once), and both (each
# layer's pyramid budget split over its heads, as kvpress composes its PyramidKV and AdaKV
# presses).
SCHEDULES = Registry("retention schedule", {
    **{s.value: functools.partial(BudgetScheme, s) for s in BudgetSchedule},
    **{h.value: functools.partial(BudgetScheme, head_allocation=h)
       for h in (HeadAllocation.ADAKV, HeadAllocation.PER_HEAD, HeadAllocation.GLOBAL)},
    "pyramid_adakv": functools.partial(BudgetScheme, BudgetSchedule.PYRAMID,
                                       HeadAllocation.ADAKV),
})


def check_schedule(schedule: str, policy: RetentionPolicy, head_floor: float | None = None
                   ) -> BudgetScheme:
    """The `BudgetScheme` of `EngineConfig.retention_schedule` for `policy`, with
    `EngineConfig.retention_head_floor` (None: the scheme's default) (ValueError: an unknown
    schedule, a floor outside [0, 1] or for a schedule that splits no budget by scores, or a
    per-layer or per-head schedule over a policy that does not compress once)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"EngineConfig.retention_schedule must be one of {list(SCHEDULES)}, "
                         f"got {schedule!r}")
    scheme = SCHEDULES.make(schedule)
    if head_floor is not None:
        if not scheme.splits_by_score:
            raise ValueError(f"EngineConfig.retention_head_floor={head_floor!r} is the share "
                             f"every head keeps of a split by scores, and "
                             f"retention_schedule={schedule!r} splits none: use 'adakv', "
                             f"'pyramid_adakv' or 'global'")
        try:  # BudgetScheme checks the value
            scheme = dataclasses.replace(scheme, head_floor=head_floor)
        except ValueError as e:
            raise ValueError(f"EngineConfig.retention_head_floor: {e}") from None
    if scheme.name != BudgetSchedule.UNIFORM.value and not policy.compresses_once:
        raise ValueError(f"EngineConfig.retention_schedule={schedule!r} shares the budget of "
                         f"a press that compresses the prompt once, from its scores; "
                         f"retention={policy.name!r} is none")
    return scheme


def schedule_layer_groups(policy: RetentionPolicy, scheme: BudgetScheme, num_layers: int,
                          token_format: TokenFormat, max_len: int) -> tuple[LayerGroup, ...]:
    """The pool's layer groups: one per run of layers with equal budgets at `max_len` tokens,
    each keeping its budget (`budget_layer_groups`)."""
    first, last = policy.protected_tokens()
    budgets = scheme.layer_budgets(num_layers, policy.budget, max_len, window=first + last)
    return budget_layer_groups(np.maximum(budgets, 1), token_format)


class GroupedRetention(RetentionManager):
    """The retention record of a pool whose table groups keep budgets of their own.

    Each sequence has one `CacheView` per table group (group 0's is the one the base class
    reads: `num_evicted`, `score_weights`, ...). Key scores arrive per group ([G, >= S]).
    """

    def __init__(self, policy: RetentionPolicy, scheme: BudgetScheme,
                 groups: tuple[LayerGroup, ...], *, rope=None):
        super().__init__(policy, rope=rope)
        self.scheme = scheme
        self.num_layers = sum(len(g.layers) for g in groups)
        self.tables = [t.layers for t in table_groups([(g.layers, 0) for g in groups])]
        self.num_tables = len(self.tables)
        self._max_kept = max(g.num_keep_tokens for g in groups)
        self._others: dict[str, list[CacheView]] = {}  # table groups 1..G-1

    @property
    def max_kept_tokens(self) -> int:
        return self._max_kept

    def _group_views(self, seq_id: str) -> list[CacheView]:
        return [self._views[seq_id], *self._others[seq_id]]

    def group_evicted(self, seq_id: str) -> tuple[int, ...]:
        return tuple(v.num_evicted for v in self._others.get(seq_id, ()))

    def table_budgets(self, budget: int, num_tokens: int) -> list[int]:
        """Tokens each table group keeps of a prompt of `num_tokens` tokens: the most any of
        its layers keeps (`BudgetScheme.layer_budgets`), at least one (a layer whose share
        rounds to nothing, B - protected < beta, would leave its table empty)."""
        first, last = self.policy.protected_tokens()
        layers = self.scheme.layer_budgets(self.num_layers, budget, num_tokens,
                                           window=first + last)
        return [max(1, int(max(layers[i] for i in t))) for t in self.tables]

    def observe(self, seq_id: str, start: int, num_new: int,
                key_scores: np.ndarray | None) -> None:
        """key_scores: [G, >= S] the row's per-group scores, or None."""
        views = self._others.get(seq_id, [None] * (self.num_tables - 1))
        views = [self._views.get(seq_id), *views]
        new = (np.arange(start, start + num_new, dtype=np.int32), np.zeros(num_new, np.float32))
        for g, view in enumerate(views):
            views[g] = self._extended(view, start, num_new,
                                      None if key_scores is None else key_scores[g], new)
        self._views[seq_id], self._others[seq_id] = views[0], views[1:]

    def _least_kept(self, budget: int, num_tokens: int) -> int:
        return min(self.table_budgets(budget, num_tokens))

    def observe_probe(self, seq_id: str, probe: Probe, key_scores: np.ndarray) -> None:
        """key_scores: [G, >= S] the probe row's per-group scores."""
        for view, scores in zip(self._group_views(seq_id), key_scores, strict=True):
            _merge_probe(view, probe, scores)

    def finish_probes(self, seq_id: str) -> None:
        for view in self._group_views(seq_id):
            view.probed, view.is_prefill_done = True, False

    def observe_each(self, seq_id: str, start: int, query_scores: np.ndarray | None) -> None:
        raise ValueError("per-layer budgets score keys per table group, not per verified "
                         "query (kvjax.engine.compat refuses speculative decoding)")

    def select(self, seq_id: str, *, is_prefill_done: bool) -> list[np.ndarray] | None:
        """Cache indices each table group keeps, or None when every group keeps all."""
        views = self._group_views(seq_id)
        budget = self._budgets.get(seq_id, self.default_budget)
        if budget is None:
            return None
        budgets = self.table_budgets(budget, len(views[0].positions))
        keeps = []
        for view, group_budget in zip(views, budgets, strict=True):
            view.budget = group_budget
            keeps.append(self.policy.select(view, is_prefill_done=is_prefill_done))
        if all(keep is None for keep in keeps):
            for view in views:
                view.is_prefill_done = view.is_prefill_done or is_prefill_done
            return None
        return [np.arange(len(v.positions)) if keep is None else keep
                for v, keep in zip(views, keeps, strict=True)]

    def evict_groups(self, seq_id: str, keeps: list[np.ndarray],
                     moves: list[tuple[np.ndarray, np.ndarray]], num_freed: int, *,
                     is_prefill_done: bool, layouts: list[SeqLayout]) -> list[CompactionPlan]:
        """Keeps keeps[g] in table group g (moved by `GroupedBlockManager.retain_groups`'
        moves[g] from layouts[g].old_table to its new_table); one plan per group."""
        self.stats["evictions"] += 1
        self.stats["freed_pages"] += num_freed
        return [self._compact_view(view, keep, src, dst, is_prefill_done=is_prefill_done,
                                   layout=layout)
                for view, keep, (src, dst), layout in zip(
                    self._group_views(seq_id), keeps, moves, layouts, strict=True)]

    def evict(self, *args, **kwargs):
        raise ValueError("per-layer budgets compact each table group (evict_groups)")

    def record(self, seq_id: str) -> dict | None:
        """The base record of table group 0, with `groups`: the other groups' views."""
        record = super().record(seq_id)
        if record is not None and seq_id in self._others:
            record["groups"] = [view_record(v) for v in self._others[seq_id]]
        return record

    def restore(self, seq_id: str, record: dict | None) -> None:
        """ValueError when `record` holds views of another number of table groups (saved by
        an engine of another schedule or model)."""
        groups = [] if record is None else record.get("groups", [])
        if record is not None and len(groups) != self.num_tables - 1:
            raise ValueError(f"sequence {seq_id!r}: its retention record holds "
                             f"{len(groups) + 1} block tables' views, the engine keeps "
                             f"{self.num_tables}")
        super().restore(seq_id, record)
        if groups:
            self._others[seq_id] = [view_of(g) for g in groups]

    def fork(self, parent_id: str, child_id: str) -> None:
        super().fork(parent_id, child_id)
        if parent_id in self._others:
            self._others[child_id] = [dataclasses.replace(
                v, positions=v.positions.copy(), scores=v.scores.copy())
                for v in self._others[parent_id]]

    def drop(self, seq_id: str) -> None:
        super().drop(seq_id)
        self._others.pop(seq_id, None)
