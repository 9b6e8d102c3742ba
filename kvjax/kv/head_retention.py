"""Per-head retention budgets in the engine: AdaKV's head-wise allocation over a scoring press,
and kvpress's own granularity (every head the budget by its own scores).

`EngineConfig.retention_schedule='adakv'` keeps, in every layer, K * B (kv head, token) pairs
(B: the press's budget, K kv heads) chosen head-wise, and frees the pages the heads no longer
need:

  * the pool's pages are head-major (`kvjax.kv.spec`, "Per-head budgets"): a page holds P
    tokens of one kv head of one layer, and every (layer, kv head) has a block table and a
    cached length of its own (`head_layer_groups`: one group per layer, each head keeping B
    on average);
  * the step attends and scores keys per (layer, kv head) table (`StepOutput.key_scores`
    [R, L * K, W*P]: each head's attention over its query heads and weighted queries);
  * when the press decides (when the prefill completes), each layer pools its heads' ranked
    scores (`RetentionPolicy.ranked_scores`: SnapKV's pooled window scores, a press's scores
    after its sinks) and splits its K * (B - protected) unprotected pairs head-wise
    (`kvjax.kv.budgets.adakv_head_budgets`: every head first takes `head_floor` of its even
    share, the pairs of largest score the rest); each head then keeps the press's own choice
    at its count plus the protected tokens, is compacted by a COMPACT op of its own, and the
    pages beyond it go back to the pool (`GroupedBlockManager.retain_groups`): a sequence
    then holds sum over (layer, head) of ceil(B_lh / P) one-head pages;
  * decode appends to every head's table at its own cached length.

`retention_schedule='per_head'` is the same path with an even split: every (layer, kv head)
keeps exactly B tokens, the press's own choice over that head's scores alone (no pooling of
scores across heads), as kvpress's plain presses keep them (`HeadAllocation.PER_HEAD`); a
sequence then holds L * K * ceil(B / P) one-head pages.

`retention_schedule='global'` splits the model's L * K * (B - protected) unprotected pairs over
every (layer, kv head) table at once, AdaKV's split with all layers' heads pooled (KVzip's
default, kvpress's `KVzipPress(layerwise=False)`): the scores then also set how many tokens each
layer keeps, which only a press whose scores compare across layers ranks sensibly (KVzip's and
the attention presses' are attention weights; KNorm's key norms have a scale per layer). The
same head-major pages and tables; a sequence still holds about L * K * B tokens' pages.

`retention_schedule='pyramid_adakv'` splits each layer's PyramidKV budget B_l
(`kvjax.kv.budgets.pyramid_budgets`, L * B in all) instead, K * B_l pairs per layer, as kvpress
composes its PyramidKV and AdaKV presses; the pool's groups keep each layer's budget at the
longest context.

As with the pyramid schedule (`kvjax.kv.layer_retention`), only presses that compress once
have a head-wise split here, and `kvjax.engine.compat` refuses the features that address a
sequence's pages through one cached length.

Plain numpy, no jax: the KV cache manager and the scheduler import it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.kv.budgets import BudgetScheme, HeadAllocation
from kvjax.kv.layer_retention import GroupedRetention
from kvjax.kv.retention_host import RetentionPolicy
from kvjax.kv.spec import LayerGroup, TokenFormat, TokenKeep

ADAKV = "adakv"  # the `EngineConfig.retention_schedule` of AdaKV's head-wise split


def head_layer_groups(policy: RetentionPolicy, num_layers: int, token_format: TokenFormat,
                      max_len: int, scheme: BudgetScheme | None = None
                      ) -> tuple[LayerGroup, ...]:
    """The pool's layer groups under a head-wise split: one per layer, head-major pages, each
    head keeping its layer's budget on average (at most `max_len`): the press's, or under a
    per-layer schedule (`scheme`, 'pyramid_adakv') the layer's share at `max_len` tokens."""
    first, last = policy.protected_tokens()
    budgets = (scheme or BudgetScheme()).layer_budgets(num_layers, policy.budget, max_len,
                                                       window=first + last)
    return tuple(LayerGroup((layer,), token_format, TokenKeep.BUDGET, max(1, int(budget)),
                            head_major=True)
                 for layer, budget in enumerate(budgets))


class HeadRetention(GroupedRetention):
    """The retention record of a pool with one block table per (layer, kv head), whose press
    splits each layer's budget over its heads (AdaKV's split, or the same count for each).

    Each sequence has one `CacheView` per table, layer-major then head; key scores arrive per
    table ([L * K, >= S]).
    """

    def __init__(self, policy: RetentionPolicy, groups: tuple[LayerGroup, ...], *,
                 scheme: BudgetScheme | None = None, rope=None, max_len: int | None = None):
        """scheme: over layers ('pyramid_adakv': each layer's pyramid budget split over its
        heads) and heads ('per_head': an even split; 'global': every layer's heads split
        together; AdaKV's where it says none), with its `head_floor`; None: every layer the
        press's budget, split by AdaKV. max_len: the longest sequence (None: unbounded),
        the most one head keeps."""
        scheme = scheme or BudgetScheme()
        if scheme.head_allocation is HeadAllocation.UNIFORM:
            scheme = dataclasses.replace(scheme, head_allocation=HeadAllocation.ADAKV)
        super().__init__(policy, scheme, groups, rope=rope)
        self.num_heads = groups[0].format.num_kv_heads
        self.tables = [g.layers for g in groups for _ in range(self.num_heads)]
        self.num_tables = len(self.tables)
        first, last = policy.protected_tokens()
        # Under AdaKV one head keeps at most its layer's every unprotected pair beside the
        # protected ones, under the global split the model's; under an even split, its
        # layer's budget; and never more than the longest sequence.
        most = max(max(g.num_keep_tokens for g in groups), policy.budget)
        spread = {HeadAllocation.ADAKV: self.num_heads, HeadAllocation.PER_HEAD: 1,
                  HeadAllocation.GLOBAL: self.num_tables}[scheme.head_allocation]
        self._max_kept = first + last + spread * (most - first - last)
        if max_len is not None:
            self._max_kept = min(self._max_kept, max_len)

    def head_counts(self, seq_id: str, budget: int) -> np.ndarray:
        """[L * K] the unprotected tokens each (layer, head) table keeps: the scheme's split of
        each layer's K * (budget - protected) pairs (under 'global' of the model's L * K *
        (budget - protected) pairs at once) by the press's ranked scores
        (`BudgetScheme.head_counts`)."""
        views = self._group_views(seq_id)
        first, last = self.policy.protected_tokens()
        layers = self.scheme.layer_budgets(self.num_layers, budget, len(views[0].positions),
                                           window=first + last)  # [L]
        ranked = [self.policy.ranked_scores(v) for v in views]
        if self.scheme.model_wide:
            return self.scheme.head_counts(np.stack(ranked), int(layers[0]) - first - last)
        k = self.num_heads
        return np.concatenate([self.scheme.head_counts(np.stack(ranked[i:i + k]),
                                                       int(count) - first - last)
                               for i, count in zip(range(0, len(views), k), layers,
                                                   strict=True)])

    def select(self, seq_id: str, *, is_prefill_done: bool) -> list[np.ndarray] | None:
        """Cache indices each (layer, head) table keeps, or None when every table keeps all."""
        views = self._group_views(seq_id)
        budget = self._budgets.get(seq_id, self.default_budget)
        if budget is None or not is_prefill_done or views[0].is_prefill_done \
                or len(views[0].positions) <= budget \
                or (self.policy.probes_first and not views[0].probed):
            for view in views:
                view.is_prefill_done = view.is_prefill_done or is_prefill_done
            return None
        first, last = self.policy.protected_tokens()
        counts = self.head_counts(seq_id, budget)  # [L * K]
        keeps = []
        for view, count in zip(views, counts, strict=True):
            # A table keeps at least one token (as a pyramid table group does): a head whose
            # share rounds to nothing (no protected tokens, a small layer budget) keeps its
            # best one, a pair over its layer's budget.
            view.budget = max(1, first + last + int(count))
            keep = self.policy.select(view, is_prefill_done=True)
            keeps.append(np.arange(len(view.positions)) if keep is None else keep)
        return keeps
