"""Budget schemes: how a retention budget is shared out over layers (PyramidKV) and over the kv
heads of a layer (AdaKV), and which tokens each (layer, kv head) then keeps.

A scoring press gives every cached token a score per layer and kv head, `scores` [L, K, S]
(larger: kept first). A uniform scheme ranks tokens by their score summed over layers and
heads and keeps the same B tokens everywhere: what the engine's retention does today, since a
page holds every layer and head of its tokens (`kvjax.kv.retention`, "Scores"). The schemes
here keep different tokens in different layers and heads:

  ================  ==========================================================================
  schedule          tokens per layer (budget B, L layers, S cached tokens)
  ================  ==========================================================================
  uniform           B in every layer
  pyramid           PyramidKV: `pyramid_budgets`, B_l falling linearly from the first layer to
                    the last, summing to L * B, every layer keeping at least the press's
                    protected tokens (PyramidKV's window is SnapKV's); each layer ranks by its
                    score summed over heads
  ================  ==========================================================================

  ================  ==========================================================================
  head_allocation   tokens per kv head of a layer keeping B_l
  ================  ==========================================================================
  uniform           the layer's B_l tokens, the same for every head
  adakv             AdaKV: the K * B_l (head, token) pairs of largest score over the layer's
                    heads, every head keeping at least `head_floor` of its even share first (a
                    head whose scores are spread keeps more tokens, a peaked one fewer)
  per_head          B_l tokens in every head, each head ranking by its own score (kvpress's
                    plain presses: AdaKV with an even split, `head_floor` 1)
  global            the model's L * K * B (layer, kv head, token) pairs of largest score,
                    every layer's heads ranked together (KVzip's default, kvpress's
                    `layerwise=False`): AdaKV's split over all L * K heads at once, so the
                    scores also decide how many tokens each layer keeps; every head keeps at
                    least `head_floor` of its even share B first. Only with the uniform
                    schedule (it sets the layers' shares itself)
  ================  ==========================================================================

A press's protected tokens (`first` sinks, the `last` tokens: SnapKV's window, TOVA's newest) are
kept by every layer and head inside its budget; the schemes share out the rest. Scores are
summed over what a scheme ranks together before the press's transform (`rank`: SnapKV's pooling,
observed attention's division by the queries that saw each token), so a uniform scheme ranks
exactly what the engine's policies rank.

Memory. Pages hold every kv head of P tokens of one layer group's layers
(`kvjax.kv.spec.KVCacheSpec.table_groups`), so layers with different budgets need block tables
of their own: `budget_layer_groups` declares one group per run of layers with equal budgets,
each keeping its budget (`TokenKeep.BUDGET`), and a sequence then holds
sum over table groups of ceil(B_g / P) pages (`pages_held`). Per head, each head's kept tokens
of a simulated cache sharing its layer's pages are compacted into the same slots (slot i holds
head h's i-th kept token, read through a per-head gather), so a layer holds
ceil(max_h B_lh / P) pages: AdaKV frees no more than its largest head allows, and at the same
token budget holds at least the pages of the uniform allocation (`pages_held` counts it so).
The engine instead keeps one block table per (layer, kv head) with pages of one head's P
tokens (head-major pages, `kvjax.kv.spec`), which hold sum over heads of ceil(B_lh / P)
pages of a K-th of the size, about the budget itself, at K times the tables and one attention
call per head; `kvjax.bench.budgets` reports both.

What is served. The engine serves the uniform scheme (every press's own selection) and, for
the presses that compress the prompt once (snapkv, knorm, expected_attention,
observed_attention, kvzip), the pyramid schedule (`EngineConfig.retention_schedule='pyramid'`,
`kvjax.kv.layer_retention`): one table group per run of equal budgets, a cached length per table
group in the step input, key scores per table group and a compaction per group, whose freed
pages go back to the pool; and the head allocations (`retention_schedule='adakv'`,
'pyramid_adakv', 'per_head', 'global'; `kvjax.kv.head_retention`): a table per (layer, kv head)
in head-major pages (`EngineConfig.retention_head_floor` sets `head_floor` for adakv,
pyramid_adakv and global). The simulated cache (`kvjax.bench.budgets`) keeps what the engine
keeps under each of them (`tests/engine/test_engine_pyramid.py`,
`tests/engine/test_engine_adakv.py`, `tests/engine/test_engine_per_head.py`).

Plain numpy, no jax: the host side of retention and the KV cache manager import it freely.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from kvjax.kv.spec import LayerGroup, TokenFormat, TokenKeep


class BudgetSchedule(enum.Enum):
    """How a budget is shared over layers."""

    UNIFORM = "uniform"
    PYRAMID = "pyramid"  # PyramidKV


class HeadAllocation(enum.Enum):
    """How a layer's budget is shared over its kv heads."""

    UNIFORM = "uniform"
    ADAKV = "adakv"  # AdaKV's head-wise allocation
    PER_HEAD = "per_head"  # every head the layer's budget, by its own scores (kvpress's default)
    GLOBAL = "global"  # AdaKV's split over every layer's heads at once (KVzip's default)


def _check_int(name: str, option: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} {option} must be an int >= {minimum}, got {value!r}")
    return value


def pyramid_budgets(num_layers: int, budget: int, num_tokens: int, *, window: int = 64,
                    beta: float = 20.0) -> np.ndarray:
    """PyramidKV's per-layer token budgets: more tokens in lower layers, fewer in upper ones.

    Each layer keeps the `window` most recent tokens plus a share of the B - window others
    that falls linearly from the first layer to the last, the last layer's being 1 / beta of
    the mean share (B = budget). Shares are rounded so the layers keep L * B tokens in all,
    exactly as uniform budgets would; no layer keeps more than num_tokens (the rest goes to
    the layers above, in order). A budget of at least num_tokens, or one whose window leaves
    no share, is uniform.

    Returns:
      [L] int64 budgets, non-increasing, summing to L * min(budget, num_tokens).
    """
    for option, value, minimum in (("num_layers", num_layers, 1), ("budget", budget, 1),
                                   ("num_tokens", num_tokens, 1), ("window", window, 0)):
        _check_int("pyramid_budgets", option, value, minimum)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta < 1:
        raise ValueError(f"pyramid_budgets beta must be a number >= 1, got {beta!r}")
    budget = min(budget, num_tokens)
    share = budget - window
    if share <= 0 or budget == num_tokens or num_layers == 1:
        return np.full(num_layers, budget, np.int64)
    low = share / beta
    high = 2 * share - low
    shares = high - np.arange(num_layers) * (high - low) / (num_layers - 1)  # [L], mean share
    floors = np.floor(shares).astype(np.int64)
    # Largest remainders take the tokens rounding left over, so the total is exact.
    extra = num_layers * share - int(floors.sum())
    floors[np.argsort(-(shares - floors), kind="stable")[:extra]] += 1
    budgets = np.sort(floors)[::-1] + window
    overflow = 0
    for i in range(num_layers):  # A layer cannot keep more tokens than there are.
        budgets[i] += overflow
        overflow = max(int(budgets[i]) - num_tokens, 0)
        budgets[i] -= overflow
    return budgets


def adakv_head_budgets(scores: np.ndarray, count: int, head_floor: float) -> np.ndarray:
    """AdaKV's split of K * count kept tokens over K heads. scores: [K, S] -> [K] int64.

    Each head first takes its floor(head_floor * count) best tokens; the remaining pairs go to
    the (head, token) pairs of largest score left (earlier head, then earlier token, among
    ties). Every head keeps at most S tokens.
    """
    k_heads, size = scores.shape
    count = min(count, size)
    floor = min(int(np.floor(head_floor * count)), count)
    ranked = np.argsort(-scores, axis=1, kind="stable")  # [K, S] each head's order
    taken = np.zeros((k_heads, size), bool)
    np.put_along_axis(taken, ranked[:, :floor], True, axis=1)
    rest = np.where(taken, -np.inf, scores).reshape(-1)  # [K*S], head-major
    extra = k_heads * count - k_heads * floor
    order = np.argsort(-rest, kind="stable")[:extra]
    taken.reshape(-1)[order] = True
    return taken.sum(axis=1).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class BudgetScheme:
    """A per-layer schedule and a per-head allocation of a retention budget.

    Attributes:
      schedule: over layers.
      head_allocation: over a layer's kv heads.
      beta: PyramidKV's ratio of the mean share to the last layer's.
      head_floor: AdaKV's guaranteed fraction of a head's even share, in [0, 1].
    """

    schedule: BudgetSchedule = BudgetSchedule.UNIFORM
    head_allocation: HeadAllocation = HeadAllocation.UNIFORM
    beta: float = 20.0
    head_floor: float = 0.2

    def __post_init__(self):
        try:
            object.__setattr__(self, "schedule", BudgetSchedule(self.schedule))
        except ValueError:
            raise ValueError(f"budget_schedule must be one of "
                             f"{[s.value for s in BudgetSchedule]}, got {self.schedule!r}"
                             ) from None
        try:
            object.__setattr__(self, "head_allocation", HeadAllocation(self.head_allocation))
        except ValueError:
            raise ValueError(f"head_allocation must be one of "
                             f"{[h.value for h in HeadAllocation]}, got "
                             f"{self.head_allocation!r}") from None
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) \
                or self.beta < 1:
            raise ValueError(f"budget scheme beta must be a number >= 1, got {self.beta!r}")
        if isinstance(self.head_floor, bool) or not isinstance(self.head_floor, (int, float)) \
                or not 0 <= self.head_floor <= 1:
            raise ValueError(f"budget scheme head_floor must be a number in [0, 1], got "
                             f"{self.head_floor!r}")
        if self.model_wide and self.schedule is not BudgetSchedule.UNIFORM:
            raise ValueError(f"the global head allocation ranks every layer's pairs together, "
                             f"which sets the layers' shares: it takes no {self.schedule.value} "
                             f"schedule")

    @property
    def splits_by_score(self) -> bool:
        """Whether heads' counts come from their scores (adakv, global): `head_floor` applies."""
        return self.head_allocation in (HeadAllocation.ADAKV, HeadAllocation.GLOBAL)

    @property
    def model_wide(self) -> bool:
        """Whether the heads of every layer share one budget (global), not each layer's."""
        return self.head_allocation is HeadAllocation.GLOBAL

    @property
    def name(self) -> str:
        """'uniform', 'pyramid', 'adakv', 'per_head' or 'pyramid+adakv' (and the like)."""
        parts = [p.value for p in (self.schedule, self.head_allocation)
                 if p.value != "uniform"]
        return "+".join(parts) or "uniform"

    @classmethod
    def named(cls, name: str, **options: Any) -> BudgetScheme:
        """The scheme `name`: 'uniform', or a schedule over layers ('pyramid'), a split over
        heads ('adakv', 'per_head', 'global'), or both joined by '+' ('pyramid+adakv')."""
        parts = name.split("+")
        schedules = [p for p in parts if p in {s.value for s in BudgetSchedule} - {"uniform"}]
        heads = [p for p in parts if p in {h.value for h in HeadAllocation} - {"uniform"}]
        if name != "uniform" and (len(schedules) + len(heads) != len(parts)
                                  or len(schedules) > 1 or len(heads) > 1):
            raise ValueError(f"unknown budget scheme {name!r}: expected 'uniform', 'pyramid', "
                             f"'adakv', 'per_head', 'global' or 'pyramid+adakv'")
        return cls(BudgetSchedule(schedules[0]) if schedules else BudgetSchedule.UNIFORM,
                   HeadAllocation(heads[0]) if heads else HeadAllocation.UNIFORM, **options)

    def layer_budgets(self, num_layers: int, budget: int, num_tokens: int, *,
                      window: int = 0) -> np.ndarray:
        """[L] int64 tokens each layer keeps (at most num_tokens); `window`: tokens every layer
        keeps besides its share (`pyramid_budgets`)."""
        if self.schedule is BudgetSchedule.PYRAMID:
            return pyramid_budgets(num_layers, budget, num_tokens, window=window,
                                   beta=self.beta)
        return np.full(num_layers, min(budget, num_tokens), np.int64)

    def head_counts(self, ranked: np.ndarray, count: int) -> np.ndarray:
        """[H] int64 tokens each of H kv heads keeps of the H * count they share, by their
        ranked scores `ranked` [H, S] (at most S each): AdaKV's split, or `count` each
        (per_head). The heads are a layer's, or under the global allocation the model's
        (layer-major)."""
        if self.splits_by_score:
            return adakv_head_budgets(ranked, count, self.head_floor)
        return np.full(len(ranked), min(count, ranked.shape[1]), np.int64)

    def select(self, scores: np.ndarray, budget: int, *, first: int = 0, last: int = 0,
               rank: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """Which tokens each layer and kv head keeps.

        Args:
          scores: [L, K, S] a press's per-layer, per-kv-head token scores.
          budget: B, tokens per layer and head under a uniform scheme (the mean otherwise).
          first, last: tokens every layer and head keeps (sinks, a recent window); they count
            in the budget, which must leave room for them.
          rank: the press's transform of a summed score row of the unprotected tokens
            [S - first - last] before ranking (pooling); None: the scores as they are.
        Returns:
          [L, K, S] bool, True where a layer's head keeps the token.
        """
        num_layers, k_heads, size = scores.shape
        if first + last > min(budget, size):
            raise ValueError(f"a budget of {budget} tokens cannot keep the {first} first and "
                             f"{last} last ones")
        rank = (lambda x: x) if rank is None else rank
        kept = np.zeros(scores.shape, bool)
        kept[:, :, :first] = True
        kept[:, :, size - last:] = True
        middle = slice(first, size - last)
        if self.schedule is BudgetSchedule.UNIFORM and \
                self.head_allocation is HeadAllocation.UNIFORM:
            chosen = _top(rank(scores.sum(axis=(0, 1))[middle]), min(budget, size) - first
                          - last) + first
            kept[:, :, chosen] = True
            return kept
        budgets = self.layer_budgets(num_layers, budget, size, window=first + last)
        if self.model_wide:  # every (layer, head) ranked together: one split of L * K heads
            ranked = np.stack([rank(s[middle]) for s in scores.reshape(-1, size)])
            counts = self.head_counts(ranked, int(budgets[0]) - first - last)
            for table, (row, n) in enumerate(zip(ranked, counts, strict=True)):
                kept[table // k_heads, table % k_heads, _top(row, int(n)) + first] = True
            return kept
        for layer, layer_budget in enumerate(budgets):
            count = int(layer_budget) - first - last
            if self.head_allocation is HeadAllocation.UNIFORM:
                chosen = _top(rank(scores[layer].sum(axis=0)[middle]), count) + first
                kept[layer, :, chosen] = True
                continue
            ranked = np.stack([rank(s[middle]) for s in scores[layer]])  # [K, S - first - last]
            counts = self.head_counts(ranked, count)
            for head in range(k_heads):
                kept[layer, head, _top(ranked[head], int(counts[head])) + first] = True
        return kept


def _top(scores: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` largest scores (earlier index first among ties), increasing."""
    return np.sort(np.argsort(-scores, kind="stable")[:count])


def layer_slots(kept: np.ndarray) -> np.ndarray:
    """[L] the token slots each layer's pages hold: its longest head's kept tokens (heads
    compact their own tokens into the same slots). kept: [L, K, S] bool."""
    return kept.sum(axis=2).max(axis=1)


def budget_layer_groups(slots: np.ndarray, token_format: TokenFormat) -> tuple[LayerGroup, ...]:
    """The layer groups of a pool whose layers keep `slots` [L] tokens: one group per run of
    consecutive layers with equal slots, each keeping its budget (`TokenKeep.BUDGET`)."""
    groups, start = [], 0
    slots = [int(s) for s in slots]
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            groups.append(LayerGroup(tuple(range(start, i)), format=token_format,
                                     keep=TokenKeep.BUDGET, num_keep_tokens=slots[start]))
            start = i
    return tuple(groups)


def pages_held(kept: np.ndarray, page_size: int) -> int:
    """Pages of one layer each a sequence keeping `kept` [L, K, S] holds: sum over layers of
    ceil(its longest head's tokens / P)."""
    return int(sum(-(-int(s) // page_size) for s in layer_slots(kept)))
