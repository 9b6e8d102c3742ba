"""Retention's host side: the policies' choices of which tokens to keep, and the host record.

Plain Python and numpy, no jax: the KV cache manager, the scheduler and a replay of recorded
decisions import it without a device. Policies are described in `kvjax.kv.retention`, which
holds the device side (key scores, slot moves, the compaction program, Quest's page
selection) and re-exports every name defined here; the policies' device hooks import it when
called.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from kvjax.kv.spec import KVCacheSpec
from kvjax.shapes import bucket, next_power_of_2, pad_repeat_last, powers_of_2_up_to

if TYPE_CHECKING:
    import jax

    from kvjax.models.rope import RoPE


class Pooling(enum.Enum):
    """How SnapKV smooths the window's attention over neighbouring tokens."""

    MAX = "max"
    AVG = "avg"  # the kernel's sum over in-range neighbours divided by the kernel size


@dataclasses.dataclass
class CacheView:
    """Host record of one sequence's cached tokens, in cache order.

    Attributes:
      positions: [S] int32, the logical position of each cached token (increasing); S is the
        cached length.
      scores: [S] float32, the attention each cached token has accumulated (zeros for policies
        that do not score keys).
      num_evicted: tokens this sequence dropped (logical length = S + num_evicted).
      is_prefill_done: the prefill of the sequence's tokens completed (SnapKV compressed then).
      budget: the tokens this sequence keeps, set by a KV controller
        (`RetentionManager.set_budget`; at most the policy's budget); None: the policy's.
      probed: the policy's probe rows (`RetentionPolicy.probes`) have all been scored.
    """

    positions: np.ndarray
    scores: np.ndarray
    num_evicted: int = 0
    is_prefill_done: bool = False
    budget: int | None = None
    probed: bool = False


# A row's score span (`Probe.span`) when its softmax runs over every key it sees.
EVERY_KEY = (0, 2**31 - 1)


@dataclasses.dataclass(frozen=True)
class Probe:
    """Tokens a policy runs after a sequence's prefill to score its cached keys (KVzip's
    context reconstruction): `token_ids` follow the sequence's tokens at the next positions,
    attend to its cache, and their own K/V go on pages given back once they are scored; their
    scores of cache indices [start, end) are kept. A probe runs as one row.

    span: the cache indices [lo, hi) whose keys, with the policy's sinks and the probe's own
    tokens, the scores' softmax runs over (KVzip's: the chunk); None: every key a query sees.
    """

    token_ids: tuple[int, ...]
    start: int
    end: int
    span: tuple[int, int] | None = None


class RetentionPolicy(Protocol):
    """What the engine asks of a retention policy.

    Host side: which queries score keys, and which cached tokens to keep. Device side (inside
    the jitted step; the object is static there): the KV state it needs, the pages each decode
    row reads, and the keys' attention scores.
    """

    name: ClassVar[str]
    budget: int | None
    evicts: bool  # frees pages (streaming, h2o, snapkv)
    scores_keys: bool  # needs StepOutput.key_scores
    narrows_reads: bool  # changes which pages attention reads (quest)
    rotates_keys: bool  # rotary_shifts may shift kept keys (streaming, cache_positions)
    # Host-authoritative pages (ECHO, `kvjax.engine.echo`): the pages a decode row keeps on the
    # device beyond the ones its previous selection ranked first; None: every page stays there.
    echo_prefetch: int | None
    # ECHO: each step keeps the pages it read from the host pool in frames for the next.
    echo_keep_misses: bool
    records_reads: bool  # each decode step's selection goes back to the host (page_reads)
    # The last page leaves of `wrap_state`'s state that index pages (Quest's key summaries):
    # under ECHO the host pool keeps them in device memory, where the selection reads them.
    num_index_leaves: int
    accumulates_scores: bool  # a step's key scores add to the earlier ones (else replace them)
    needs_rope: bool  # its device side reads the model's RoPE (`bind_rope`)
    compresses_once: bool  # decides once, from scores, when the prefill completes
    needs_tokenizer: bool  # its probes' text becomes token ids through the model's tokenizer
    probes_first: bool  # decides only once its probe rows are scored (`probes`)
    # At most this many of a prefill row's queries have a nonzero `score_weights`, all among
    # the row's last queries (SnapKV: its window; TOVA: 1): the step scores only those.
    # None: any query may.
    scored_queries: int | None

    def fingerprint(self) -> str: ...

    def ranked_scores(self, view: CacheView) -> np.ndarray:
        """A policy that compresses once: the scores of its unprotected tokens, of which
        `select` keeps the best `budget - first - last` (`protected_tokens`)."""
        ...

    def protected_tokens(self) -> tuple[int, int]: ...

    def score_weights(self, view: CacheView | None, positions: np.ndarray, num_tokens: int
                      ) -> np.ndarray: ...

    def select(self, view: CacheView, *, is_prefill_done: bool) -> np.ndarray | None: ...

    def max_undecided_tokens(self, view: CacheView) -> int | None: ...

    def rotary_shifts(self, view: CacheView, keep: np.ndarray) -> np.ndarray | None: ...

    def bind_rope(self, rope: RoPE) -> RetentionPolicy: ...

    def bind_tokenizer(self, tokenizer: Any) -> RetentionPolicy: ...

    def probes(self, tokens: list[int], room: int) -> list[Probe]:
        """The probe rows a sequence of `tokens` runs once its prefill completes, before it
        decodes, none longer than `room` tokens; [] for policies that score without them."""
        ...

    def wrap_state(self, kv: Any) -> Any: ...

    def wrap_spec(self, spec: KVCacheSpec) -> KVCacheSpec: ...

    def select_reads(self, kv: Any, layer: jax.Array, q: jax.Array, inp: Any, shape: Any
                     ) -> tuple[jax.Array, jax.Array] | None: ...

    def key_scores(self, kv: Any, layer: jax.Array, q: jax.Array, inp: Any, shape: Any, *,
                   pages_per_block: int, soft_cap: float | None = None) -> jax.Array: ...


_REGISTRY: dict[str, type] = {}


def register_retention(cls: type) -> type:
    """Class decorator: makes a policy constructible by its `name`."""
    _REGISTRY[cls.name] = cls
    return cls


def _register_device_policies() -> None:
    """Registers the policies defined beside device code (quest, the scoring presses)."""
    importlib.import_module("kvjax.kv.retention")


def retention_names() -> list[str]:
    _register_device_policies()
    return sorted(_REGISTRY)


def make_retention(name: str, budget: int | None, page_size: int, **options: Any
                   ) -> RetentionPolicy:
    """The registered policy `name` with a budget of `budget` tokens per sequence."""
    if name not in _REGISTRY:
        _register_device_policies()
    if name not in _REGISTRY:
        raise ValueError(f"unknown retention policy {name!r}; registered: {retention_names()}")
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    cls = _REGISTRY[name]
    unknown = sorted(set(options) - set(cls.option_names))
    if unknown:
        raise ValueError(f"retention policy {name!r} has no option(s) {unknown}; it takes "
                         f"{list(cls.option_names)}")
    return cls(budget, page_size, **options)


def _check_budget(name: str, budget: Any, minimum: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < minimum:
        raise ValueError(f"retention {name!r} needs retention_budget an int >= {minimum}, "
                         f"got {budget!r}")
    return budget


def _top(scores: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` largest scores (earlier index first among ties), increasing."""
    order = np.argsort(-scores, kind="stable")
    return np.sort(order[:count])


class _Policy:
    """Defaults: exact attention, no eviction, no scores."""

    name: ClassVar[str]
    option_names: ClassVar[tuple[str, ...]] = ()
    evicts: ClassVar[bool] = False
    scores_keys: ClassVar[bool] = False
    narrows_reads: ClassVar[bool] = False
    accumulates_scores: ClassVar[bool] = True
    needs_rope: ClassVar[bool] = False
    needs_tokenizer: ClassVar[bool] = False
    probes_first: ClassVar[bool] = False
    rotates_keys: bool = False
    echo_prefetch: int | None = None
    echo_keep_misses: bool = False
    records_reads: bool = False
    num_index_leaves: ClassVar[int] = 0
    # Decides once, from scores, when the prefill completes (a per-layer schedule can share
    # its budget: `kvjax.kv.layer_retention`).
    compresses_once: ClassVar[bool] = False
    scored_queries: int | None = None

    def __init__(self, budget: int | None, page_size: int):
        self.budget = budget
        self.page_size = page_size

    def protected_tokens(self) -> tuple[int, int]:
        """(first, last): the tokens of a prompt it always keeps inside its budget (sinks, an
        observation window)."""
        return 0, 0

    def ranked_scores(self, view: CacheView) -> np.ndarray:
        raise ValueError(f"retention={self.name!r} does not rank a prompt's tokens once "
                         f"(only presses that compress once do)")

    def options(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.option_names}

    def budget_of(self, view: CacheView) -> int | None:
        """The tokens this sequence keeps: its own budget, else the policy's."""
        return self.budget if view.budget is None else view.budget

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fingerprint()})"

    def fingerprint(self) -> str:
        """What the policy does to KV, for the provenance fingerprint."""
        opts = ",".join(f"{k}={v.value if isinstance(v, enum.Enum) else v}"
                        for k, v in self.options().items())
        return f"{self.name}:B{self.budget}:{opts}"

    def score_weights(self, view: CacheView | None, positions: np.ndarray, num_tokens: int
                      ) -> np.ndarray:
        """[n] float32 weight of each query at logical `positions` in the keys' scores."""
        return np.zeros(len(positions), np.float32)

    def select(self, view: CacheView, *, is_prefill_done: bool) -> np.ndarray | None:
        """Cache indices to keep (increasing), or None to keep everything."""
        return None

    def max_undecided_tokens(self, view: CacheView) -> int | None:
        """The most decode tokens n the sequence may add such that `select` keeps everything
        after each of the first n - 1 (the n-th may evict); None: no limit. A verify step of
        at most n tokens then reads exactly what n plain decode steps would."""
        return None

    def rotary_shifts(self, view: CacheView, keep: np.ndarray) -> np.ndarray | None:
        """[S'] rotary positions to add to each kept key once `keep` is compacted, or None."""
        return None

    def bind_rope(self, rope: RoPE) -> Any:
        """The policy for a model of this RoPE (policies that read none: itself)."""
        return self

    def bind_tokenizer(self, tokenizer: Any) -> Any:
        """The policy for a model of this tokenizer (policies that need none: itself)."""
        return self

    def probes(self, tokens: list[int], room: int) -> list[Probe]:
        return []

    def wrap_state(self, kv: Any) -> Any:
        return kv

    def wrap_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """The spec of `wrap_state`'s state over a state of `spec`."""
        return spec

    def select_reads(self, kv: Any, layer: jax.Array, q: jax.Array, inp: Any, shape: Any
                     ) -> tuple[jax.Array, jax.Array] | None:
        """Which block-table entries the decode rows read (`quest.select_decode_pages`), or
        None: every page."""
        return None

    def key_scores(self, kv: Any, layer: jax.Array, q: jax.Array, inp: Any, shape: Any, *,
                   pages_per_block: int, soft_cap: float | None = None) -> jax.Array:
        from kvjax.kv import retention  # Imported lazily: the device side.

        return retention.step_key_scores(kv, layer, q, inp, shape,
                                         pages_per_block=pages_per_block, soft_cap=soft_cap,
                                         scored_queries=self.scored_queries)


@register_retention
class NoRetention(_Policy):
    """Exact KV: every token kept, every page read."""

    name = "none"

    def __init__(self, budget: int | None, page_size: int):
        if budget is not None:
            raise ValueError(f"retention 'none' takes no retention_budget, got {budget!r}")
        super().__init__(None, page_size)

    def fingerprint(self) -> str:
        return "none"


class _Evicting(_Policy):
    """Shared trigger of streaming and h2o: evict at B + P cached tokens, down to B."""

    evicts = True

    def _is_over(self, view: CacheView) -> bool:
        return len(view.positions) >= self.budget_of(view) + self.page_size

    def max_undecided_tokens(self, view: CacheView) -> int | None:
        # The token that brings the cache to B + P evicts; every one before it keeps all.
        budget = self.budget_of(view)
        if budget is None:
            return None
        return max(1, budget + self.page_size - len(view.positions))


@register_retention
class StreamingLLM(_Evicting):
    """Attention sinks (the first tokens) plus a window of the most recent tokens."""

    name = "streaming"
    option_names = ("num_sinks", "cache_positions")

    def __init__(self, budget: int | None, page_size: int, num_sinks: int = 4,
                 cache_positions: bool = False):
        if isinstance(num_sinks, bool) or not isinstance(num_sinks, int) or num_sinks < 0:
            raise ValueError(f"streaming num_sinks must be an int >= 0, got {num_sinks!r}")
        if not isinstance(cache_positions, bool):
            raise ValueError(f"streaming cache_positions must be a bool, got "
                             f"{cache_positions!r}")
        if cache_positions and num_sinks >= page_size:
            raise ValueError(f"streaming cache_positions needs num_sinks < page_size="
                             f"{page_size} (the sinks' page is rotated), got {num_sinks}")
        super().__init__(_check_budget(self.name, budget, num_sinks + 1), page_size)
        self.num_sinks, self.cache_positions = num_sinks, cache_positions
        self.min_budget = num_sinks + 1
        self.rotates_keys = cache_positions and num_sinks > 0

    def select(self, view: CacheView, *, is_prefill_done: bool) -> np.ndarray | None:
        if not self._is_over(view):
            return None
        size = len(view.positions)
        recent = np.arange(size - (self.budget_of(view) - self.num_sinks), size)
        return np.concatenate([np.arange(self.num_sinks), recent])

    def rotary_shifts(self, view: CacheView, keep: np.ndarray) -> np.ndarray | None:
        if not self.rotates_keys:
            return None
        shifts = np.zeros(len(keep), np.int32)
        shifts[:self.num_sinks] = len(view.positions) - len(keep)  # the tokens dropped
        return shifts


@register_retention
class H2O(_Evicting):
    """Heavy hitters (largest accumulated attention) plus the most recent tokens."""

    name = "h2o"
    option_names = ("num_recent",)
    scores_keys = True

    def __init__(self, budget: int | None, page_size: int, num_recent: int | None = None):
        budget = _check_budget(self.name, budget, 1)
        num_recent = budget // 2 if num_recent is None else num_recent
        if (isinstance(num_recent, bool) or not isinstance(num_recent, int)
                or not 1 <= num_recent <= budget):
            raise ValueError(f"h2o num_recent must be an int in [1, budget={budget}], got "
                             f"{num_recent!r}")
        super().__init__(budget, page_size)
        self.num_recent = self.min_budget = num_recent

    def score_weights(self, view: CacheView | None, positions: np.ndarray, num_tokens: int
                      ) -> np.ndarray:
        return np.ones(len(positions), np.float32)

    def select(self, view: CacheView, *, is_prefill_done: bool) -> np.ndarray | None:
        if not self._is_over(view):
            return None
        older = len(view.positions) - self.num_recent
        heavy = _top(view.scores[:older], self.budget_of(view) - self.num_recent)
        return np.concatenate([heavy, np.arange(older, len(view.positions))])


def compresses_once_undecided(view: CacheView) -> int | None:
    """`max_undecided_tokens` of a policy that compresses once, when the prefill completes:
    one token while that decision is still to be made (a compaction that found no page is
    retried after the next step), else no limit."""
    return None if view.is_prefill_done else 1


def pool_scores(scores: np.ndarray, kernel: int, pooling: Pooling) -> np.ndarray:
    """Each score replaced by the max (or kernel-normalized sum) of its `kernel` neighbours.

    The window is centred (kernel // 2 on each side) and clipped at the ends. [S] -> [S].
    """
    half = kernel // 2
    size = len(scores)
    if size == 0:
        return scores.astype(np.float32)
    fill = -np.inf if pooling is Pooling.MAX else 0.0
    padded = np.concatenate([np.full(half, fill), scores, np.full(half, fill)])  # [S + 2h]
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel)  # [S, kernel]
    if pooling is Pooling.MAX:
        return windows.max(axis=-1).astype(np.float32)
    return (windows.sum(axis=-1) / kernel).astype(np.float32)


@register_retention
class SnapKV(_Policy):
    """At the end of prefill: the observation window plus the tokens it attends to most."""

    name = "snapkv"
    option_names = ("window", "kernel", "pooling")
    evicts = True
    scores_keys = True
    compresses_once = True

    def __init__(self, budget: int | None, page_size: int, window: int = 64, kernel: int = 5,
                 pooling: str | Pooling = Pooling.MAX):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"snapkv window must be a positive int, got {window!r}")
        if (isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1
                or kernel % 2 == 0):
            raise ValueError(f"snapkv kernel must be a positive odd int, got {kernel!r}")
        try:
            pooling = Pooling(pooling)
        except ValueError:
            raise ValueError(f"snapkv pooling must be one of {[p.value for p in Pooling]}, got "
                             f"{pooling!r}") from None
        super().__init__(_check_budget(self.name, budget, window + 1), page_size)
        self.window, self.kernel, self.pooling = window, kernel, pooling
        self.min_budget = window + 1
        self.scored_queries = window  # `score_weights`: a prefill's last `window` queries

    def score_weights(self, view: CacheView | None, positions: np.ndarray, num_tokens: int
                      ) -> np.ndarray:
        if view is not None and view.is_prefill_done:
            return np.zeros(len(positions), np.float32)
        return (positions >= num_tokens - self.window).astype(np.float32)

    def protected_tokens(self) -> tuple[int, int]:
        return 0, self.window

    def select(self, view: CacheView, *, is_prefill_done: bool) -> np.ndarray | None:
        size = len(view.positions)
        budget = self.budget_of(view)
        if view.is_prefill_done or not is_prefill_done or size <= budget:
            return None
        chosen = _top(self.ranked_scores(view), budget - self.window)
        return np.concatenate([chosen, np.arange(size - self.window, size)])

    def ranked_scores(self, view: CacheView) -> np.ndarray:
        """[S - window] the pooled scores of the tokens before the window, which `select`
        keeps the best of (a head-wise split ranks heads by them, `kvjax.kv.head_retention`)."""
        return pool_scores(view.scores[:len(view.positions) - self.window], self.kernel,
                           self.pooling)

    def max_undecided_tokens(self, view: CacheView) -> int | None:
        return compresses_once_undecided(view)


@dataclasses.dataclass(frozen=True)
class SeqLayout:
    """Where a sequence's KV sat before a compaction, and its pages after (host data).

    Attributes:
      old_table, new_table: its block table before and after `BlockManager.retain`.
      kv_floor: its `WindowFloors.floor` before.
      seq_slot: its slot in the sequence-slot leaves (`KVCacheManager.seq_slot`).
    """

    old_table: list[int]
    new_table: list[int]
    kv_floor: int = 0
    seq_slot: int = 0


@dataclasses.dataclass(frozen=True)
class CompactionPlan:
    """One sequence's retention compaction as host data: the fields of the device's
    `kvjax.kv.state.Compaction` (read there for their meaning), each array an int32 tuple
    padded to a bucketed size, each scalar an int.

    `plan_compaction` builds it from the block manager's new layout.
    """

    src: tuple[int, ...]
    dst: tuple[int, ...]
    rot_slots: tuple[int, ...]
    rot_shifts: tuple[int, ...]
    keep: tuple[int, ...]
    kept_src: tuple[int, ...]
    kept_dst: tuple[int, ...]
    shifts: tuple[int, ...]
    old_len: int
    new_len: int
    old_floor: int
    seq_slot: int

    def arrays(self) -> dict[str, np.ndarray]:
        """Every field as an int32 numpy array (scalars as 0-d arrays)."""
        return {f.name: np.asarray(getattr(self, f.name), np.int32)
                for f in dataclasses.fields(self)}


def plan_compaction(keep: np.ndarray, src: np.ndarray, dst: np.ndarray, layout: SeqLayout,
                    page_size: int, *, old_len: int, shifts: np.ndarray | None,
                    kept_size: int, moves_size: int, rotations_size: int = 1
                    ) -> CompactionPlan:
    """The `CompactionPlan` of one sequence keeping cache indices `keep` [S'].

    Args:
      keep: [S'] increasing old cache indices.
      src, dst: the block manager's slot moves (`BlockManager.retain`).
      layout: the sequence's tables, floor and slot.
      page_size: P.
      old_len: S, its cached tokens before.
      shifts: [S'] rotary positions to add to each kept key, or None.
      kept_size, moves_size, rotations_size: the padded sizes N >= S', M >= len(src) and
        M2 >= the number of rotated keys (static: one program per size).
    """
    keep = np.asarray(keep, np.int64)
    new_index = np.arange(len(keep))
    kept_src = np.asarray(layout.old_table, np.int64)[keep // page_size] * page_size
    kept_src += keep % page_size
    kept_dst = np.asarray(layout.new_table, np.int64)[new_index // page_size] * page_size
    kept_dst += new_index % page_size
    shifts = np.zeros(len(keep), np.int32) if shifts is None else np.asarray(shifts, np.int32)
    rotated = np.flatnonzero(shifts)

    def padded(x, size, fill):
        out = np.full(size, fill, np.int32)
        out[:len(x)] = x
        return tuple(out.tolist())

    def moves(x, size):  # pad_repeat_last, or slot 0 onto itself when there is nothing
        out = pad_repeat_last(x, size) if len(x) else np.zeros(size, np.int32)
        return tuple(np.asarray(out).tolist())

    return CompactionPlan(
        src=moves(src, moves_size), dst=moves(dst, moves_size),
        rot_slots=moves(kept_dst[rotated], rotations_size),
        rot_shifts=moves(shifts[rotated], rotations_size),
        keep=padded(keep, kept_size, -1), kept_src=padded(kept_src, kept_size, -1),
        kept_dst=padded(kept_dst, kept_size, -1), shifts=padded(shifts, kept_size, 0),
        old_len=int(old_len), new_len=len(keep), old_floor=int(layout.kv_floor),
        seq_slot=int(layout.seq_slot))


def _merge_probe(view: CacheView, probe: Probe, key_scores: np.ndarray) -> None:
    span = slice(probe.start, min(probe.end, len(view.scores)))
    view.scores[span] = np.maximum(view.scores[span], key_scores[span])


def view_record(view: CacheView) -> dict:
    """A `CacheView` as plain data (JSON-serializable)."""
    return dict(positions=view.positions.tolist(), scores=view.scores.tolist(),
                num_evicted=view.num_evicted, is_prefill_done=view.is_prefill_done,
                probed=view.probed)


def view_of(record: dict) -> CacheView:
    """The `CacheView` of a `view_record`."""
    return CacheView(np.asarray(record["positions"], np.int32),
                     np.asarray(record["scores"], np.float32), record["num_evicted"],
                     record["is_prefill_done"], probed=record.get("probed", False))


class RetentionManager:
    """The engine's host-side record of what each sequence keeps, and the device moves.

    Attributes:
      policy: the `RetentionPolicy`.
      stats: evictions, evicted_tokens, moved_slots, freed_pages, rotated_slots.
    """

    def __init__(self, policy: RetentionPolicy, *, rope: RoPE | None = None):
        """rope: the model's RoPE, needed by policies that rotate kept keys or read it."""
        if (policy.rotates_keys or policy.needs_rope) and rope is None:
            raise ValueError(f"{policy!r} rotates kept keys or reads RoPE: RetentionManager "
                             f"needs rope")
        self.policy = policy.bind_rope(rope) if policy.needs_rope else policy
        self._views: dict[str, CacheView] = {}
        self._budgets: dict[str, int | None] = {}  # a controller's per-sequence budgets
        # The budget of a sequence no controller named: the policy's (None: keep all).
        self.default_budget = policy.budget
        self.stats = dict(evictions=0, evicted_tokens=0, moved_slots=0, freed_pages=0,
                          rotated_slots=0)

    num_tables = 1  # block tables a sequence keeps its own tokens in (`GroupedRetention`)

    @property
    def max_kept_tokens(self) -> int:
        """The most tokens one compaction keeps in a block table."""
        return self.policy.budget

    def group_evicted(self, seq_id: str) -> tuple[int, ...]:
        """Tokens each block table after the first dropped (`num_evicted` is the first's);
        () when every table keeps the same tokens."""
        return ()

    def group_shifts(self, seq_id: str) -> tuple[int, ...]:
        """Each block table's cached length less the first's (its offset from the cache
        positions callers address the sequence by); () when every table keeps the same
        tokens."""
        others = self.group_evicted(seq_id)
        if not others:
            return ()
        first = self.num_evicted(seq_id)
        return (0, *(first - n for n in others))

    @property
    def is_exact(self) -> bool:
        return not (self.policy.evicts or self.policy.scores_keys or self.policy.narrows_reads)

    @property
    def step_hooks(self) -> RetentionPolicy | None:
        """What the jitted step calls; None keeps the exact step program."""
        return None if self.is_exact else self.policy

    @property
    def fingerprint(self) -> str:
        return self.policy.fingerprint()

    def _sizes(self) -> tuple[int, list[int], int]:
        """(N, the sizes M, M2) of a compaction's arrays (`plan_compaction`): a compaction
        keeps `budget` tokens, moves at most that many (padded from P up) and rotates at most
        the sinks."""
        page_size = self.policy.page_size
        kept = -(-next_power_of_2(self.max_kept_tokens) // page_size) * page_size
        moves = [n for n in powers_of_2_up_to(kept) if n >= min(page_size, kept)]
        rotations = next_power_of_2(self.policy.num_sinks) if self.policy.rotates_keys else 1
        return kept, moves, rotations

    def warmup_plans(self) -> list[CompactionPlan]:
        """A plan of every size a compaction can take (one compiled program each), keeping
        nothing and moving slot 0 onto itself, which changes nothing; [] when the policy
        never compacts."""
        if not self.policy.evicts:
            return []
        kept, moves, rotations = self._sizes()
        layout = SeqLayout(old_table=[0], new_table=[0])
        return [plan_compaction(np.zeros(0, np.int64), [], [], layout, self.policy.page_size,
                                old_len=0, shifts=None, kept_size=kept, moves_size=n,
                                rotations_size=rotations) for n in moves]

    def num_evicted(self, seq_id: str) -> int:
        view = self._views.get(seq_id)
        return 0 if view is None else view.num_evicted

    def cached_positions(self, seq_id: str) -> np.ndarray:
        """[S] logical positions of the tokens `seq_id` caches (empty when it holds none)."""
        view = self._views.get(seq_id)
        return np.zeros(0, np.int32) if view is None else view.positions.copy()

    def score_weights(self, seq_id: str, positions: np.ndarray, num_tokens: int) -> np.ndarray:
        """[n] weights of the queries at logical `positions` of a sequence of num_tokens.

        Checks the policy's `scored_queries` promise: the step scores only a row's last
        `scored_queries` queries, so a weight before them would be dropped silently."""
        view = self._budgeted_view(seq_id)
        weights = self.policy.score_weights(view, positions, num_tokens)
        last = self.policy.scored_queries
        if last is not None and np.any(weights[:-last]):
            raise RuntimeError(
                f"{type(self.policy).__name__}.score_weights weights a query before the row's "
                f"last {last} (scored_queries) for {seq_id!r}")
        return weights

    def observe(self, seq_id: str, start: int, num_new: int,
                key_scores: np.ndarray | None) -> None:
        """Records `num_new` tokens computed at logical positions start.. and their step's scores.

        key_scores: [>= S] the row's StepOutput.key_scores (cache order), or None.
        """
        self._views[seq_id] = self._extended(self._views.get(seq_id), start, num_new,
                                             key_scores)

    def _extended(self, view: CacheView | None, start: int, num_new: int,
                  key_scores: np.ndarray | None,
                  new: tuple[np.ndarray, np.ndarray] | None = None) -> CacheView:
        """`view` (None: a new one) with `num_new` tokens at logical positions start.. and
        their step's scores [>= S] added (or in place of the earlier ones). new: the new
        tokens' (positions, zero scores), when the caller extends many views alike."""
        if view is None:  # Nothing evicted yet: the cache holds positions 0 .. start - 1.
            view = CacheView(np.arange(start, dtype=np.int32), np.zeros(start, np.float32))
        positions, zeros = new or (np.arange(start, start + num_new, dtype=np.int32),
                                   np.zeros(num_new, np.float32))
        view.positions = np.concatenate([view.positions, positions])
        view.scores = np.concatenate([view.scores, zeros])
        if key_scores is not None and self.policy.accumulates_scores:
            view.scores += key_scores[:len(view.scores)]
        elif key_scores is not None:
            view.scores = np.asarray(key_scores[:len(view.scores)], np.float32).copy()
        return view

    def observe_each(self, seq_id: str, start: int, query_scores: np.ndarray | None) -> None:
        """Records the tokens of a verify row's accepted queries one at a time, each with its
        own query's scores, as the decode steps that plain decoding runs for them would.

        query_scores: [n, >= S + n], the row's first n queries' own key scores
        (`StepOutput.query_key_scores`), S the cached length before the row.
        """
        for j, scores in enumerate(query_scores):
            self.observe(seq_id, start + j, 1, scores)

    def probes(self, seq_id: str, tokens: list[int], room: int) -> list[Probe]:
        """The probe rows `seq_id` runs before it decodes, its prefill of `tokens` done (or
        dispatched): the policy's (`RetentionPolicy.probes`), none longer than `room`, unless
        it has run them or keeps every token anyway."""
        view = self._views.get(seq_id)
        if view is not None and view.probed:
            return []
        budget = self._budgets.get(seq_id, self.default_budget)
        cached = len(tokens) - (0 if view is None else view.num_evicted)
        if budget is None or cached <= self._least_kept(budget, cached):
            return []
        return self.policy.probes(tokens, room)

    def _least_kept(self, budget: int, num_tokens: int) -> int:
        """The fewest tokens any block table of a sequence keeps under `budget`."""
        return budget

    def observe_probe(self, seq_id: str, probe: Probe, key_scores: np.ndarray) -> None:
        """`probe`'s row was scored: key_scores [>= S] (cache order); its scores of the
        probe's span are kept (the max with an earlier run's, when a preemption restarted the
        probes: the same scores)."""
        _merge_probe(self._views[seq_id], probe, key_scores)

    def finish_probes(self, seq_id: str) -> None:
        """Every probe row of `seq_id` was scored: the policy decides now (`select`)."""
        view = self._views[seq_id]
        view.probed, view.is_prefill_done = True, False

    def _budgeted_view(self, seq_id: str) -> CacheView | None:
        """The sequence's view with the budget `select` will apply after the coming step (a
        controller may have changed it since the last), for the policy's score weights."""
        view = self._views.get(seq_id)
        if view is not None:
            view.budget = self._budgets.get(seq_id, self.default_budget)
        return view

    def verify_score_weights(self, seq_id: str, positions: np.ndarray) -> np.ndarray:
        """[n] weights of a verify row's queries at logical `positions`: each weighted as the
        one query of the decode step that plain decoding would run for it."""
        view = self._budgeted_view(seq_id)
        return np.concatenate([self.policy.score_weights(view, positions[j:j + 1],
                                                         int(positions[j]) + 1)
                               for j in range(len(positions))]).astype(np.float32)

    def max_verify_tokens(self, seq_id: str) -> int | None:
        """The most tokens a verify row of `seq_id` may compute so that the policy decides
        nothing before its last one (`RetentionPolicy.max_undecided_tokens`); None: any."""
        view = self._budgeted_view(seq_id)
        if view is None or self.is_exact:
            return None
        return self.policy.max_undecided_tokens(view)

    def set_budget(self, seq_id: str, budget: int | None) -> None:
        """The tokens `seq_id` keeps from its next step on (a KV controller's decision): an
        int in [the policy's minimum, its budget], or None to keep every token."""
        if not self.policy.evicts:
            raise ValueError(f"retention {self.policy.name!r} evicts nothing: no per-sequence "
                             f"budget to set")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or not self.policy.min_budget <= budget <= self.policy.budget):
            raise ValueError(f"sequence {seq_id!r}: retention budget must be None or an int in "
                             f"[{self.policy.min_budget}, {self.policy.budget}], got {budget!r}")
        self._budgets[seq_id] = budget

    def budget(self, seq_id: str) -> int | None:
        """The tokens `seq_id` keeps (None: all of them; exact policies keep all)."""
        if not self.policy.evicts:
            return None
        return self._budgets.get(seq_id, self.default_budget)

    def forget(self, seq_id: str) -> None:
        """The sequence finished: its budget goes too."""
        self._budgets.pop(seq_id, None)
        self.drop(seq_id)

    def select(self, seq_id: str, *, is_prefill_done: bool) -> np.ndarray | None:
        """The policy's choice of cache indices to keep after the sequence's latest step."""
        view = self._views[seq_id]
        view.budget = self._budgets.get(seq_id, self.default_budget)
        keep = None if view.budget is None else self.policy.select(
            view, is_prefill_done=is_prefill_done)
        if keep is None:  # Else `evict` records it, once the eviction happened.
            view.is_prefill_done = view.is_prefill_done or is_prefill_done
        return keep

    def evict(self, seq_id: str, keep: np.ndarray, src: np.ndarray, dst: np.ndarray,
              num_freed: int, *, is_prefill_done: bool, layout: SeqLayout) -> CompactionPlan:
        """Keeps cache indices `keep` of `seq_id`: the block manager moved it from
        layout.old_table to layout.new_table with slot moves src -> dst. Updates the record
        and returns the plan the device follows (`KVState.compact`)."""
        self.stats["evictions"] += 1
        self.stats["freed_pages"] += num_freed
        return self._compact_view(self._views[seq_id], keep, src, dst,
                                  is_prefill_done=is_prefill_done, layout=layout)

    def _compact_view(self, view: CacheView, keep: np.ndarray, src: np.ndarray,
                      dst: np.ndarray, *, is_prefill_done: bool, layout: SeqLayout
                      ) -> CompactionPlan:
        """Keeps cache indices `keep` of one block table's `view`: its record and plan."""
        shifts = self.policy.rotary_shifts(view, keep)
        kept, moves, rotations = self._sizes()
        plan = plan_compaction(keep, src, dst, layout, self.policy.page_size,
                               old_len=len(view.positions), shifts=shifts, kept_size=kept,
                               moves_size=bucket(len(src), moves[0]),
                               rotations_size=rotations)
        view.is_prefill_done = view.is_prefill_done or is_prefill_done
        self.stats["evicted_tokens"] += len(view.positions) - len(keep)
        self.stats["moved_slots"] += len(src)
        self.stats["rotated_slots"] += 0 if shifts is None else int(np.count_nonzero(shifts))
        view.num_evicted += len(view.positions) - len(keep)
        view.positions = view.positions[keep]
        view.scores = view.scores[keep]
        return plan

    def record(self, seq_id: str) -> dict | None:
        """The sequence's record as plain data (for a snapshot), None when it has none."""
        view = self._views.get(seq_id)
        if view is None:
            return None
        budget = dict(budget=self._budgets[seq_id]) if seq_id in self._budgets else {}
        return dict(view_record(view), **budget)

    def restore(self, seq_id: str, record: dict | None) -> None:
        """Gives a sequence the `record` another engine's manager saved (None: none)."""
        if record is not None:
            self._views[seq_id] = view_of(record)
            if "budget" in record:  # a controller's budget for it
                self._budgets[seq_id] = record["budget"]

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares the parent's cache: it starts from a copy of its record."""
        view = self._views.get(parent_id)
        if view is not None:
            self._views[child_id] = dataclasses.replace(
                view, positions=view.positions.copy(), scores=view.scores.copy())

    def drop(self, seq_id: str) -> None:
        """The sequence released its pages (finished, preempted or restarted)."""
        self._views.pop(seq_id, None)

