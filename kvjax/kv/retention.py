"""Retention policies: which tokens' K/V a sequence keeps, and which pages attention reads.

A policy is a small class behind `RetentionPolicy`, registered by name; `EngineConfig.retention`
picks one, `retention_budget` sizes it and `retention_options` tunes it:

  ==========  ==================================================  ===========================
  name        keeps (budget B tokens per sequence)                options (defaults)
  ==========  ==================================================  ===========================
  none        everything (exact)                                  -
  streaming   the first num_sinks tokens + the most recent        num_sinks=4,
              B - num_sinks (StreamingLLM)                        cache_positions=False
  h2o         the num_recent most recent tokens + the B -         num_recent=B // 2
              num_recent others with the largest accumulated
              attention (heavy hitters, H2O)
  snapkv      at the end of prefill: the last `window` prompt     window=64, kernel=5,
              tokens + the B - window others that the window's    pooling='max'
              queries attend to most, scores pooled over
              `kernel` neighbouring tokens (SnapKV); generated
              tokens are all kept
  quest       everything in memory; each decode query reads only  dense_layers=2,
              its B // P pages of highest key bound (the max or   heads='max'
              sum over query heads), the newest page always
              among them, except in the first dense_layers
              layers, which read every page (Quest,
              kvjax.kv.quest)
  ==========  ==================================================  ===========================

The scoring presses tova, knorm, expected_attention and observed_attention (kvjax.kv.presses)
register here too.

Eviction (streaming, h2o, snapkv) frees whole pages. streaming and h2o evict once a sequence
caches B + P tokens, back down to B (so a page's worth of tokens is dropped at a time and the
compaction cost is paid once per P tokens); snapkv compresses once, when the prefill of the
sequence's tokens completes. The kept tokens are compacted, in order, into the front of the
sequence's pages (`BlockManager.retain` plans it, `move_slots` copies on the device) and the
pages past them go back to the pool.

Lengths. A sequence's logical length (tokens seen: `Sequence.num_computed`) and its cached
length (tokens kept, the length attention masks by) differ by the tokens it evicted; the
`RetentionManager` records, per sequence, the logical position of every cached token.

Positions. Keys keep the rotary position they were written with and queries use the logical
position, for every policy: what H2O and SnapKV do, and `streaming` by default ("sinks +
window" at true positions). StreamingLLM instead re-assigns positions within the cache (token
i of the cache sits at position i, to run past the trained context): `streaming` with
cache_positions=True. RoPE logits depend only on the query-key offset, and the window is
contiguous, so its offsets within the cache equal its offsets in the text; only the sinks'
differ, by the tokens evicted so far. So each eviction rotates the sinks' keys forward by the
tokens it dropped (`rotate_slots`; RoPE is a rotation, R(a) R(b) = R(a + b)) and every logit
is StreamingLLM's, while the window's keys and the queries keep their logical positions. The
sinks sit in the first page, which compaction always rewrites into a private page (the tokens
after the sinks are the ones dropped), so no shared page is rotated; hence num_sinks < P.
Limits: absolute angles still grow with the logical position (float32 angles lose about 1e-3
rad by position 16k), and each eviction's rotation rounds the sinks' keys once more.

Scores. h2o and snapkv need the attention each cached token receives. The step computes it as
an extra output (`StepOutput.key_scores`, [R, W*P]): per row and cached token, the softmax
probability summed over layers, query heads and the row's queries, each query weighted by
`StepInput.score_weights` (h2o: every query; snapkv: the last `window` queries of the prefill).
The host accumulates it per sequence and token (`CacheView.scores`), so pages shared between
sequences never mix their scores. Eviction is per token for all layers and heads at once, since
pages are shared by every layer and head; H2O and SnapKV choose per layer and head, which
paged memory cannot free. SnapKV pools the layer-and-head sum, not each head's scores.

Prefix cache. A page indexed before a sequence's first eviction holds exact K/V (nothing was
evicted when it was computed) and stays indexed: compaction copies it on write rather than
change it. From the first eviction on, a sequence indexes nothing more (`BlockManager.retain`),
and the policy and budget are part of the provenance fingerprint, so no page is ever served
to a request that expects another retention.

Codecs. The device side of a compaction is `KVState.compact` with a `kv_state.Compaction`
(`plan_compaction` builds it from the block manager's new layout). A state that stores each
token alone moves every page leaf's token rows, so exact K/V and a per-token codec's codes
and scales move alike (int8, int4, int2, fp8: each token is encoded alone; calibrated fp8's
static scales live in the codec) and a moved token decodes to exactly what it did;
re-rotating keys (cache_positions=True) decodes its keys, rotates them and encodes them again
(`KVState.map_keys`). KIVI's keys share scales over groups of tokens, so KIVI lays the kept
tokens out again: the window takes the new exact tail, and each key group below it whose
tokens changed (moved, rotated, or exact before) is encoded again from the values attention
read, one more rounding of its moved keys; groups left in place keep their codes. Quest moves
nothing and runs over any codec, KIVI included (it selects entries of the state's own tables).

Limits (checked by EngineConfig, `kvjax.engine.compat`): every policy but none needs the
paged layout. Policies run on
a mesh (the kv-head axis is sharded; token selection is per sequence), compacted sequences
swap, through the host tier too (they come back with the pages they held and this record; a
tier copy that comes back short restarts them), and snapshots carry the record.
A request of streaming, h2o or tova may be longer than the pool (it never holds more than its
budget plus a prefill chunk); others must fit the pool whole.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import jit as kvjax_jit
from kvjax.kv import layout, quest
from kvjax.kv import state as kv_state
from kvjax.kv.attention import PageLoader
from kvjax.kv.spec import KVCacheSpec
from kvjax.models.rope import RoPE
from kvjax.shapes import bucket, next_power_of_2, pad_repeat_last, powers_of_2_up_to


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
    """

    positions: np.ndarray
    scores: np.ndarray
    num_evicted: int = 0
    is_prefill_done: bool = False
    budget: int | None = None


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
    accumulates_scores: bool  # a step's key scores add to the earlier ones (else replace them)
    needs_rope: bool  # its device side reads the model's RoPE (`bind_rope`)

    def fingerprint(self) -> str: ...

    def score_weights(self, view: CacheView | None, positions: np.ndarray, num_tokens: int
                      ) -> np.ndarray: ...

    def select(self, view: CacheView, *, is_prefill_done: bool) -> np.ndarray | None: ...

    def rotary_shifts(self, view: CacheView, keep: np.ndarray) -> np.ndarray | None: ...

    def bind_rope(self, rope: RoPE) -> RetentionPolicy: ...

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


def retention_names() -> list[str]:
    return sorted(_REGISTRY)


def make_retention(name: str, budget: int | None, page_size: int, **options: Any
                   ) -> RetentionPolicy:
    """The registered policy `name` with a budget of `budget` tokens per sequence."""
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
    rotates_keys: bool = False

    def __init__(self, budget: int | None, page_size: int):
        self.budget = budget
        self.page_size = page_size

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

    def rotary_shifts(self, view: CacheView, keep: np.ndarray) -> np.ndarray | None:
        """[S'] rotary positions to add to each kept key once `keep` is compacted, or None."""
        return None

    def bind_rope(self, rope: RoPE) -> Any:
        """The policy for a model of this RoPE (policies that read none: itself)."""
        return self

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
        return step_key_scores(kv, layer, q, inp, shape, pages_per_block=pages_per_block,
                               soft_cap=soft_cap)


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

    def score_weights(self, view: CacheView | None, positions: np.ndarray, num_tokens: int
                      ) -> np.ndarray:
        if view is not None and view.is_prefill_done:
            return np.zeros(len(positions), np.float32)
        return (positions >= num_tokens - self.window).astype(np.float32)

    def select(self, view: CacheView, *, is_prefill_done: bool) -> np.ndarray | None:
        size = len(view.positions)
        budget = self.budget_of(view)
        if view.is_prefill_done or not is_prefill_done or size <= budget:
            return None
        prefix = size - self.window
        pooled = pool_scores(view.scores[:prefix], self.kernel, self.pooling)
        chosen = _top(pooled, budget - self.window)
        return np.concatenate([chosen, np.arange(prefix, size)])


@register_retention
class Quest(_Policy):
    """Query-aware page reads: every page stays, each decode query reads its top pages."""

    name = "quest"
    option_names = ("dense_layers", "heads")
    narrows_reads = True

    def __init__(self, budget: int | None, page_size: int, dense_layers: int = 2,
                 heads: str | quest.HeadReduction = quest.HeadReduction.MAX):
        if (isinstance(dense_layers, bool) or not isinstance(dense_layers, int)
                or dense_layers < 0):
            raise ValueError(f"quest dense_layers must be an int >= 0, got {dense_layers!r}")
        try:
            heads = quest.HeadReduction(heads)
        except ValueError:
            raise ValueError(f"quest heads must be one of "
                             f"{[h.value for h in quest.HeadReduction]}, got {heads!r}") from None
        super().__init__(_check_budget(self.name, budget, page_size), page_size)
        self.num_read_pages = self.budget // page_size
        self.dense_layers, self.heads = dense_layers, heads

    def wrap_state(self, kv: Any) -> quest.QuestKV:
        return quest.init_quest_kv(kv)

    def wrap_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        return quest.summarized_spec(spec)

    def select_reads(self, kv: quest.QuestKV, layer: jax.Array, q: jax.Array, inp: Any,
                     shape: Any) -> tuple[jax.Array, jax.Array] | None:
        bd = shape.num_decode
        if bd == 0:
            return None
        return quest.select_decode_pages(kv, layer, q[:bd], inp.block_tables[:bd],
                                         inp.kv_lens[:bd], self.num_read_pages,
                                         num_dense_layers=self.dense_layers,
                                         head_reduction=self.heads)


# ----------------------------------------------------------------------------- device: scores


def key_scores_blockwise(q: jax.Array, load_pages: PageLoader, block_tables: jax.Array,
                         kv_lens: jax.Array, q_lens: jax.Array, q_weights: jax.Array, *,
                         pages_per_block: int = 8, sm_scale: float | None = None,
                         soft_cap: float | None = None) -> jax.Array:
    """The attention probability each cached key receives, summed over heads and queries.

    Same masking as `paged_attention_blockwise` (query c of row b sits at cached index
    kv_lens[b] - q_lens[b] + c and sees every earlier index); two passes over the blocks, the
    first for each query's softmax normaliser, the second for the probabilities.

    Args:
      q: [B, C, N, D].
      load_pages: page ids [B, n] -> K, V [B, n, P, K, D].
      block_tables: [B, W] int32, W a multiple of pages_per_block.
      kv_lens, q_lens: [B] int32.
      q_weights: [B, C] float32, each query's weight (0 drops it).
      soft_cap: the model's attention logit soft cap (logits -> cap * tanh(logits / cap)),
        so the probabilities are the ones it attends with; None: no cap.
    Returns:
      [B, W * P] float32: entry (b, s) is sum over heads n and queries c of
      q_weights[b, c] * softmax_s(q[b, c, n] . k[b, s]); zero past kv_lens[b].
    """
    b, c, n, d = q.shape
    probe_k, _ = jax.eval_shape(load_pages, block_tables[:, :pages_per_block])
    _, _, p, k_heads, _ = probe_k.shape
    block = pages_per_block * p
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    qg = q.astype(jnp.float32).reshape(b, c, k_heads, n // k_heads, d) * scale
    q_idx = jnp.arange(c, dtype=jnp.int32)[None, :]  # [1, C]
    q_pos = (kv_lens - q_lens)[:, None] + q_idx  # [B, C]
    q_valid = q_idx < q_lens[:, None]  # [B, C]
    num_blocks = (jnp.max(kv_lens) + block - 1) // block

    def logits(i):
        pages = jax.lax.dynamic_slice_in_dim(block_tables, i * pages_per_block,
                                             pages_per_block, axis=1)  # [B, ppb]
        k, _ = load_pages(pages)  # [B, ppb, P, K, D]
        k = k.reshape(b, block, k_heads, d).astype(jnp.float32)  # [B, S', K, D]
        kv_pos = i * block + jnp.arange(block, dtype=jnp.int32)  # [S']
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (
            kv_pos[None, None, :] < kv_lens[:, None, None]) & q_valid[:, :, None]  # [B, C, S']
        s = jnp.einsum("bckgd,bskd->bkgcs", qg, k)  # [B, K, G, C, S']
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        return jnp.where(mask[:, None, None], s, -jnp.inf), mask

    def normaliser(i, carry):
        m, denom = carry  # [B, K, G, C] each
        s, mask = logits(i)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        w = jnp.where(mask[:, None, None], jnp.exp(s - m_safe[..., None]), 0.0)
        return m_new, alpha * denom + jnp.sum(w, axis=-1)

    g = n // k_heads
    init = (jnp.full((b, k_heads, g, c), -jnp.inf, jnp.float32),
            jnp.zeros((b, k_heads, g, c), jnp.float32))
    m, denom = jax.lax.fori_loop(0, num_blocks, normaliser, init)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    weight = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)
    weight = weight * q_weights.astype(jnp.float32)[:, None, None, :]  # [B, K, G, C]

    def accumulate(i, out):
        s, mask = logits(i)
        probs = jnp.where(mask[:, None, None], jnp.exp(s - m[..., None]), 0.0)
        block_scores = jnp.einsum("bkgcs,bkgc->bs", probs, weight)  # [B, S']
        return jax.lax.dynamic_update_slice_in_dim(out, block_scores, i * block, axis=1)

    out = jnp.zeros((b, block_tables.shape[1] * p), jnp.float32)
    return jax.lax.fori_loop(0, num_blocks, accumulate, out)  # [B, W*P]


class RowScorer(Protocol):
    """Scores the cached keys of a group of rows (`step_key_scores`' `score_rows`).

    q: [B, C, N, D] (RoPE applied), q_pos: [B, C] int32 their logical positions, load_pages:
    page ids [B, n] -> K, V [B, n, P, K, D], block_tables: [B, W], kv_lens, q_lens: [B],
    q_weights: [B, C] (0 past q_lens). Returns [B, W * P] float32, zero past kv_lens.
    """

    def __call__(self, q: jax.Array, q_pos: jax.Array, load_pages: PageLoader,
                 block_tables: jax.Array, kv_lens: jax.Array, q_lens: jax.Array,
                 q_weights: jax.Array) -> jax.Array: ...


def step_key_scores(kv: Any, layer: jax.Array, q: jax.Array, inp: Any, shape: Any, *,
                    pages_per_block: int, score_rows: RowScorer | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """Key scores of a step's rows (decode rows, then prefill rows). q: [T, N, D] -> [R, W*P].

    score_rows: what a row's keys score; None: the attention its weighted queries pay them
    (`key_scores_blockwise`). A group of rows whose queries all have weight 0 skips the
    computation.
    """
    bd, bp = shape.num_decode, shape.num_prefill
    width = inp.block_tables.shape[1] * kv.page_size

    def scored(q_rows, pos_rows, weights, rows):
        q_lens = inp.q_lens[rows]
        # A prefill view pads a row with the tokens after it: their weights are not its own.
        weights = jnp.where(jnp.arange(weights.shape[1])[None] < q_lens[:, None], weights, 0.0)

        def compute():
            tables, load = kv.row_loader(layer, inp.block_tables[rows], inp.kv_lens[rows],
                                         inp.seq_slots[rows], inp.kv_floors[rows])
            if score_rows is None:
                return key_scores_blockwise(q_rows, load, tables, inp.kv_lens[rows], q_lens,
                                            weights, pages_per_block=pages_per_block,
                                            soft_cap=soft_cap)
            return score_rows(q_rows, pos_rows, load, tables, inp.kv_lens[rows], q_lens,
                              weights)

        zeros = jnp.zeros((q_rows.shape[0], width), jnp.float32)
        return jax.lax.cond(jnp.any(weights > 0), compute, lambda: zeros)

    w, pos = inp.score_weights, inp.positions
    parts = []
    if bd:
        parts.append(scored(q[:bd, None], pos[:bd, None], w[:bd, None], slice(0, bd)))
    if bp:
        parts.append(scored(layout.prefill_view(q, inp, shape),
                            layout.prefill_view(pos, inp, shape),
                            layout.prefill_view(w, inp, shape), slice(bd, bd + bp)))
    return jnp.concatenate(parts, axis=0)  # [R, W*P]


# ----------------------------------------------------------------------------- device: moves


def move_slots(kv: Any, src: jax.Array, dst: jax.Array) -> Any:
    """Copies token slots src [M] into dst [M] in every layer (`kv_state.move_token_rows`)."""
    return kv_state.move_token_rows(kv, src, dst)


def rotate_slots(kv: Any, slots: jax.Array, shifts: jax.Array, rope: RoPE) -> Any:
    """Rotates the keys in slots [M] forward by shifts [M] rotary positions, in every layer.

    Keys hold RoPE at their position p; rotating by s gives the key at p + s. Values and other
    slots are unchanged. Repeated slots must come with equal shifts. A per-token codec's keys
    are decoded, rotated and encoded again (`KVState.map_keys`); KIVI's cannot be alone (its
    compaction rotates them as it re-encodes their groups).
    """
    return kv.map_keys(slots, jax.vmap(lambda x: rope.rotate(x, shifts)))


def _compact(kv: Any, plan: kv_state.Compaction, rotate: kv_state.Rotate | None) -> Any:
    return kv.compact(plan, rotate)


# ----------------------------------------------------------------------------- host: plans


@dataclasses.dataclass(frozen=True)
class SeqLayout:
    """Where a sequence's KV sat before a compaction, and its pages after (host data).

    Attributes:
      old_table, new_table: its block table before and after `BlockManager.retain`.
      kv_floor: its `KVCacheManager.kv_floor` before.
      seq_slot: its slot in the sequence-slot leaves (`KVCacheManager.seq_slot`).
    """

    old_table: list[int]
    new_table: list[int]
    kv_floor: int = 0
    seq_slot: int = 0


def plan_compaction(keep: np.ndarray, src: np.ndarray, dst: np.ndarray, layout: SeqLayout,
                    page_size: int, *, old_len: int, shifts: np.ndarray | None,
                    kept_size: int, moves_size: int, rotations_size: int = 1
                    ) -> kv_state.Compaction:
    """The `kv_state.Compaction` of one sequence keeping cache indices `keep` [S'].

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
        return out

    def moves(x, size):  # pad_repeat_last, or slot 0 onto itself when there is nothing
        return pad_repeat_last(x, size) if len(x) else np.zeros(size, np.int32)

    return kv_state.Compaction(
        src=moves(src, moves_size), dst=moves(dst, moves_size),
        rot_slots=moves(kept_dst[rotated], rotations_size),
        rot_shifts=moves(shifts[rotated], rotations_size),
        keep=padded(keep, kept_size, -1), kept_src=padded(kept_src, kept_size, -1),
        kept_dst=padded(kept_dst, kept_size, -1), shifts=padded(shifts, kept_size, 0),
        old_len=np.int32(old_len), new_len=np.int32(len(keep)),
        old_floor=np.int32(layout.kv_floor), seq_slot=np.int32(layout.seq_slot))


# ----------------------------------------------------------------------------- host: manager


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
        self._compact = kvjax_jit.jit(_compact, donate_argnums=0, static_argnums=2)
        self._rotate = rope.rotate if policy.rotates_keys else None
        self.stats = dict(evictions=0, evicted_tokens=0, moved_slots=0, freed_pages=0,
                          rotated_slots=0)

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

    @property
    def num_compiles(self) -> int:
        return self._compact._cache_size()

    def _sizes(self, page_size: int) -> tuple[int, list[int], int]:
        """(N, the sizes M, M2) of a compaction's arrays (`plan_compaction`): a compaction
        keeps `budget` tokens, moves at most that many (padded from P up) and rotates at most
        the sinks."""
        kept = -(-next_power_of_2(self.policy.budget) // page_size) * page_size
        moves = [n for n in powers_of_2_up_to(kept) if n >= min(page_size, kept)]
        rotations = next_power_of_2(self.policy.num_sinks) if self._rotate else 1
        return kept, moves, rotations

    def warmup(self, kv: Any) -> Any:
        """Compiles the compaction program of every size a compaction can ask for.

        Warm-up plans keep nothing and move slot 0 onto itself, which changes nothing. The
        programs are compiled for `kv` as it is (exact or quantized pages), the state every
        later compaction is given.
        """
        if not self.policy.evicts:
            return kv
        kept, moves, rotations = self._sizes(kv.page_size)
        layout = SeqLayout(old_table=[0], new_table=[0])
        for n in moves:
            plan = plan_compaction(np.zeros(0, np.int64), [], [], layout, kv.page_size,
                                   old_len=0, shifts=None, kept_size=kept, moves_size=n,
                                   rotations_size=rotations)
            kv = self._compact(kv, plan, self._rotate)
        return kv

    def num_evicted(self, seq_id: str) -> int:
        view = self._views.get(seq_id)
        return 0 if view is None else view.num_evicted

    def cached_positions(self, seq_id: str) -> np.ndarray:
        """[S] logical positions of the tokens `seq_id` caches (empty when it holds none)."""
        view = self._views.get(seq_id)
        return np.zeros(0, np.int32) if view is None else view.positions.copy()

    def score_weights(self, seq_id: str, positions: np.ndarray, num_tokens: int) -> np.ndarray:
        """[n] weights of the queries at logical `positions` of a sequence of num_tokens."""
        return self.policy.score_weights(self._views.get(seq_id), positions, num_tokens)

    def observe(self, seq_id: str, start: int, num_new: int,
                key_scores: np.ndarray | None) -> None:
        """Records `num_new` tokens computed at logical positions start.. and their step's scores.

        key_scores: [>= S] the row's StepOutput.key_scores (cache order), or None.
        """
        view = self._views.get(seq_id)
        if view is None:  # Nothing evicted yet: the cache holds positions 0 .. start - 1.
            view = self._views[seq_id] = CacheView(np.arange(start, dtype=np.int32),
                                                   np.zeros(start, np.float32))
        new = np.arange(start, start + num_new, dtype=np.int32)
        view.positions = np.concatenate([view.positions, new])
        view.scores = np.concatenate([view.scores, np.zeros(num_new, np.float32)])
        if key_scores is not None and self.policy.accumulates_scores:
            view.scores += key_scores[:len(view.scores)]
        elif key_scores is not None:
            view.scores = np.asarray(key_scores[:len(view.scores)], np.float32).copy()

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

    def evict(self, kv: Any, seq_id: str, keep: np.ndarray, src: np.ndarray,
              dst: np.ndarray, num_freed: int, *, is_prefill_done: bool,
              layout: SeqLayout) -> Any:
        """Keeps cache indices `keep` of `seq_id`: the block manager moved it from
        layout.old_table to layout.new_table with slot moves src -> dst; the device follows
        (`KVState.compact`)."""
        view = self._views[seq_id]
        shifts = self.policy.rotary_shifts(view, keep)
        kept, moves, rotations = self._sizes(kv.page_size)
        plan = plan_compaction(keep, src, dst, layout, kv.page_size,
                               old_len=len(view.positions), shifts=shifts, kept_size=kept,
                               moves_size=bucket(len(src), moves[0]),
                               rotations_size=rotations)
        kv = self._compact(kv, plan, self._rotate)
        view.is_prefill_done = view.is_prefill_done or is_prefill_done
        self.stats["evictions"] += 1
        self.stats["evicted_tokens"] += len(view.positions) - len(keep)
        self.stats["moved_slots"] += len(src)
        self.stats["freed_pages"] += num_freed
        self.stats["rotated_slots"] += 0 if shifts is None else int(np.count_nonzero(shifts))
        view.num_evicted += len(view.positions) - len(keep)
        view.positions = view.positions[keep]
        view.scores = view.scores[keep]
        return kv

    def record(self, seq_id: str) -> dict | None:
        """The sequence's record as plain data (for a snapshot), None when it has none."""
        view = self._views.get(seq_id)
        if view is None:
            return None
        budget = dict(budget=self._budgets[seq_id]) if seq_id in self._budgets else {}
        return dict(positions=view.positions.tolist(), scores=view.scores.tolist(),
                    num_evicted=view.num_evicted, is_prefill_done=view.is_prefill_done,
                    **budget)

    def restore(self, seq_id: str, record: dict | None) -> None:
        """Gives a sequence the `record` another engine's manager saved (None: none)."""
        if record is not None:
            self._views[seq_id] = CacheView(
                np.asarray(record["positions"], np.int32),
                np.asarray(record["scores"], np.float32), record["num_evicted"],
                record["is_prefill_done"])
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


# The scoring presses register themselves beside the policies above; importing them here makes
# every registered name available wherever the registry is.
from kvjax.kv import presses as _presses  # noqa: E402, F401
