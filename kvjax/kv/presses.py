"""Scoring presses: retention policies that rank tokens by a score and keep the best.

The presses of NVIDIA's kvpress that kvjax serves, registered beside the policies of
`kvjax.kv.retention` (same protocol, same compaction, same budgets):

  ==================  ===============================================  ========================
  name                keeps (budget B tokens per sequence)             options (defaults)
  ==================  ===============================================  ========================
  tova                evicts at B + P cached tokens, down to B: the    -
                      newest token + the B - 1 others the newest
                      query attends to most (TOVA); its scores are
                      that step's alone, not accumulated
  knorm               at the end of prefill: the B prompt tokens       -
                      whose keys have the lowest L2 norm (KNorm)
  expected_attention  at the end of prefill: the first num_sinks       num_future=512,
                      tokens + the B - num_sinks others of largest     num_sinks=4,
                      expected attention from the next num_future      covariance=True,
                      queries (ExpectedAttention, below)               vnorm=True
  observed_attention  at the end of prefill: the B prompt tokens of    -
                      largest mean attention over the prompt queries
                      that see them (observed attention)
  kvzip               after its probe rows (below): the first          chunk=2048,
                      num_sinks tokens + the B - num_sinks others      num_sinks=4, tail=8,
                      the model attends to most while it repeats the   instruction_ids,
                      context (KVzip's context reconstruction;         softmax='chunk',
                      query-agnostic)                                  instruction_ids,
                                                                       continue_ids,
                                                                       suffix_ids (None:
                                                                       the model's tokenizer
                                                                       encodes KVzip's text)
  ==================  ===============================================  ========================

The four prefill presses compress once, when the prefill of the sequence's tokens completes
(as snapkv; kvzip once its probe rows are scored); generated tokens are all kept.

KVzip. After the prefill, the sequence runs one probe row per `chunk` tokens of its context
(`kvjax.scheduler.probes`): "Repeat the previous context exactly." (for later chunks "Repeat the
part of the previous context exactly, starting with" and the previous chunk's last `tail`
tokens), the suffix that ends a user turn ("\n": a model without a chat template), then the
chunk's tokens, at the positions after the context. A cached key of the chunk scores the most
attention any probe query of its kv head's group pays it, and its token the sum of that over
layers and kv heads (per table under a per-layer or per-head schedule). The attention is a
softmax over the first num_sinks keys, the chunk's and the probe's own so far (softmax='chunk',
KVzip's and kvpress's KVzipPress's cross-attention; the probe's forward pass itself sees the
whole context), or over every key the query sees (softmax='all'); the two agree for a context of
one chunk, and 'chunk' reads a fraction of the keys of a long one. A probe is one row of a step,
so the chunk is at most the step's token budget less the instruction (a probe's scores are
maxima per layer and head, which rows of part of its queries could not add up); the probe's own
K/V go on pages past the context, given back once it is scored. kvpress ranks every layer and
head together by default (`layerwise=False`: retention_schedule='global' here).

Scores per token. Pages hold every layer and kv head of a token, so a token's score is its
per-layer, per-head score summed over layers and heads (kvpress keeps per layer and head, which
paged memory cannot free; `kvjax.kv.retention`'s "Scores"): tova and observed_attention sum the
softmax probability over query heads (a mean up to a constant); knorm sums -||k|| over layers and
kv heads; expected_attention sums its per-kv-head score.

ExpectedAttention. Future queries are modelled as Gaussian: per layer and query head, the mean mu
and covariance S of the prompt's queries before RoPE (positions num_sinks on, the outliers of
the first tokens left out), turned by the average RoPE rotation R over the next num_future
positions (mu' = R mu, S' = R S R^T). A key k (RoPE applied) then gets the expected logit
exp(mu'.k / sqrt(D) + k^T S' k / (2 D)) (the Gaussian's moment generating function), normalised
over the non-sink keys per head (a softmax), averaged over the query heads of its kv head, and
(vnorm) times its value's norm. The sinks are always kept. The statistics come from the queries
of the step that completes the prefill: the whole prompt when it is prefilled in one chunk (as
kvpress does), else the last chunk's. Queries are turned back by the model's RoPE, so a RoPE
whose frequencies depend on the position cannot serve it (`kvjax.engine.compat`).

Per-layer and per-head budgets (PyramidKV, AdaKV) over any of these scores: `kvjax.kv.budgets`
(`pyramid_budgets` is re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kv.attention import PageLoader
from kvjax.kv.budgets import pyramid_budgets  # noqa: F401
from kvjax.kv.retention import (
    CacheView,
    Probe,
    _check_budget,
    _Evicting,
    _Policy,
    _top,
    compresses_once_undecided,
    register_retention,
    step_key_scores,
)
from kvjax.models.rope import RoPE


def _check_int(name: str, option: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} {option} must be an int >= {minimum}, got {value!r}")
    return value


def _check_bool(name: str, option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} {option} must be a bool, got {value!r}")
    return value


def _last_query(positions: np.ndarray) -> np.ndarray:
    """[n] weights: 1 for the newest of a row's queries."""
    return (positions == positions.max()).astype(np.float32) if len(positions) else \
        np.zeros(0, np.float32)


@register_retention
class TOVA(_Evicting):
    """The newest token plus the tokens the newest query attends to most."""

    name = "tova"
    scores_keys = True
    accumulates_scores = False
    scored_queries = 1  # `score_weights`: a row's newest query

    def __init__(self, budget: int | None, page_size: int):
        super().__init__(_check_budget(self.name, budget, 1), page_size)
        self.min_budget = 1

    def score_weights(self, view: CacheView | None, positions: np.ndarray, num_tokens: int
                      ) -> np.ndarray:
        """The newest query, on the step after which `select` evicts (the cache then holds
        budget + P tokens); no query on the other steps, whose scores nothing reads (each
        step's scores replace the last), so their step skips the scoring."""
        weights = _last_query(positions)
        if view is not None and len(view.positions) and len(positions):
            num_new = int(positions.max()) - int(view.positions[-1])
            undecided = self.max_undecided_tokens(view)  # tokens until the trigger
            if undecided is not None and num_new < undecided:
                weights[:] = 0.0
        return weights

    def select(self, view: CacheView, *, is_prefill_done: bool) -> np.ndarray | None:
        if not self._is_over(view):
            return None
        newest = len(view.positions) - 1
        chosen = _top(view.scores[:newest], self.budget_of(view) - 1)
        return np.concatenate([chosen, [newest]])


class _PrefillPress(_Policy):
    """Compresses once, at the end of prefill, to the budget's best-scored tokens.

    The first `num_sinks` tokens are always kept; `token_scores` ranks the others.
    """

    evicts = True
    scores_keys = True
    compresses_once = True
    num_sinks: int = 0

    def __init__(self, budget: int | None, page_size: int):
        super().__init__(_check_budget(self.name, budget, self.num_sinks + 1), page_size)
        self.min_budget = self.num_sinks + 1

    def protected_tokens(self) -> tuple[int, int]:
        return self.num_sinks, 0

    def token_scores(self, view: CacheView) -> np.ndarray:
        """[S] the score of each cached token (larger: kept first)."""
        return view.scores

    def select(self, view: CacheView, *, is_prefill_done: bool) -> np.ndarray | None:
        size, budget = len(view.positions), self.budget_of(view)
        if view.is_prefill_done or not is_prefill_done or size <= budget:
            return None
        sinks = self.num_sinks
        chosen = _top(self.ranked_scores(view), budget - sinks) + sinks
        return np.concatenate([np.arange(sinks), chosen])

    def ranked_scores(self, view: CacheView) -> np.ndarray:
        """[S - num_sinks] the scores of the tokens after the sinks, which `select` keeps the
        best of (a head-wise split ranks heads by them, `kvjax.kv.head_retention`)."""
        return self.token_scores(view)[self.num_sinks:]

    def max_undecided_tokens(self, view: CacheView) -> int | None:
        return compresses_once_undecided(view)


@register_retention
class KNorm(_PrefillPress):
    """The prompt tokens whose keys have the lowest L2 norm."""

    name = "knorm"

    def score_weights(self, view: CacheView | None, positions: np.ndarray, num_tokens: int
                      ) -> np.ndarray:
        # The last prompt token's step sees every key: the one step that scores them.
        done = view is not None and view.is_prefill_done
        return np.zeros(len(positions), np.float32) if done else \
            (positions == num_tokens - 1).astype(np.float32)

    def key_scores(self, kv: Any, layer: jax.Array, q: jax.Array, inp: Any, shape: Any, *,
                   pages_per_block: int, soft_cap: float | None = None) -> jax.Array:
        del soft_cap  # key norms involve no query logits

        def score_rows(q, q_pos, load_pages, block_tables, kv_lens, q_lens, q_weights, spans):
            return key_norm_scores_blockwise(load_pages, block_tables, kv_lens,
                                             jnp.any(q_weights > 0, axis=1),
                                             pages_per_block=pages_per_block)

        return step_key_scores(kv, layer, q, inp, shape, pages_per_block=pages_per_block,
                               score_rows=score_rows)


@register_retention
class ObservedAttention(_PrefillPress):
    """The prompt tokens of largest mean attention from the prompt queries that see them."""

    name = "observed_attention"

    def score_weights(self, view: CacheView | None, positions: np.ndarray, num_tokens: int
                      ) -> np.ndarray:
        done = view is not None and view.is_prefill_done
        return np.full(len(positions), 0.0 if done else 1.0, np.float32)

    def token_scores(self, view: CacheView) -> np.ndarray:
        # Causal attention: the token at position p is seen by the queries p .. S - 1 only.
        num_seen = view.positions[-1] + 1 - view.positions
        return view.scores / num_seen


@register_retention
class ExpectedAttention(_PrefillPress):
    """Sinks plus the tokens of largest expected attention from future queries."""

    name = "expected_attention"
    option_names = ("num_future", "num_sinks", "covariance", "vnorm")
    needs_rope = True

    def __init__(self, budget: int | None, page_size: int, num_future: int = 512,
                 num_sinks: int = 4, covariance: bool = True, vnorm: bool = True,
                 rope: RoPE | None = None):
        self.num_future = _check_int(self.name, "num_future", num_future, 1)
        self.num_sinks = _check_int(self.name, "num_sinks", num_sinks, 0)
        self.covariance = _check_bool(self.name, "covariance", covariance)
        self.vnorm = _check_bool(self.name, "vnorm", vnorm)
        self.rope = rope
        super().__init__(budget, page_size)

    def bind_rope(self, rope: RoPE) -> ExpectedAttention:
        return ExpectedAttention(self.budget, self.page_size, rope=rope, **self.options())

    def score_weights(self, view: CacheView | None, positions: np.ndarray, num_tokens: int
                      ) -> np.ndarray:
        done = view is not None and view.is_prefill_done
        if done or not len(positions) or positions.max() != num_tokens - 1:
            return np.zeros(len(positions), np.float32)
        return (positions >= self.num_sinks).astype(np.float32)

    def key_scores(self, kv: Any, layer: jax.Array, q: jax.Array, inp: Any, shape: Any, *,
                   pages_per_block: int, soft_cap: float | None = None) -> jax.Array:
        del soft_cap  # scores expected logits under a Gaussian of queries, before any cap
        if self.rope is None:
            raise ValueError("expected_attention needs the model's RoPE (bind_rope)")

        def score_rows(q, q_pos, load_pages, block_tables, kv_lens, q_lens, q_weights, spans):
            return expected_attention_blockwise(
                q, q_pos, load_pages, block_tables, kv_lens, q_lens, q_weights, self.rope,
                num_future=self.num_future, num_sinks=self.num_sinks,
                covariance=self.covariance, vnorm=self.vnorm, pages_per_block=pages_per_block)

        return step_key_scores(kv, layer, q, inp, shape, pages_per_block=pages_per_block,
                               score_rows=score_rows)


def _check_ids(name: str, option: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError(f"{name} {option} must be None or a sequence of token ids, "
                         f"got {value!r}")
    return tuple(value)


@register_retention
class KVzip(_PrefillPress):
    """Sinks plus the tokens the model attends to most while it repeats the context (KVzip).

    Query-agnostic: the scores come from probe rows, not from the prompt's own queries.
    """

    name = "kvzip"
    option_names = ("chunk", "num_sinks", "tail", "softmax", "instruction_ids",
                    "continue_ids", "suffix_ids")
    # What a probe query's softmax, whose maxima score the chunk's keys, runs over.
    SOFTMAX = dict(chunk="the sinks, the chunk and the probe (KVzip's)",
                   all="every key the query sees")
    needs_tokenizer = True
    probes_first = True
    # The probes' text (KVzip's); the suffix ends a user turn of a model without a chat
    # template.
    TEXTS = dict(instruction_ids="\n\nRepeat the previous context exactly.",
                 continue_ids="\n\nRepeat the part of the previous context exactly, "
                              "starting with",
                 suffix_ids="\n")

    def __init__(self, budget: int | None, page_size: int, chunk: int = 2048,
                 num_sinks: int = 4, tail: int = 8, softmax: str = "chunk",
                 instruction_ids: Sequence[int] | None = None,
                 continue_ids: Sequence[int] | None = None,
                 suffix_ids: Sequence[int] | None = None):
        self.chunk = _check_int(self.name, "chunk", chunk, 1)
        self.num_sinks = _check_int(self.name, "num_sinks", num_sinks, 0)
        self.tail = _check_int(self.name, "tail", tail, 0)
        if softmax not in self.SOFTMAX:
            raise ValueError(f"kvzip softmax must be one of {list(self.SOFTMAX)}, got "
                             f"{softmax!r}")
        self.softmax = softmax
        self.instruction_ids = _check_ids(self.name, "instruction_ids", instruction_ids)
        self.continue_ids = _check_ids(self.name, "continue_ids", continue_ids)
        self.suffix_ids = _check_ids(self.name, "suffix_ids", suffix_ids)
        super().__init__(budget, page_size)

    def bind_tokenizer(self, tokenizer: Any) -> KVzip:
        """The press with each probe text it was not given as ids encoded by `tokenizer`."""
        options = self.options()
        missing = [k for k in self.TEXTS if options[k] is None]
        if missing and tokenizer is None:
            raise ValueError(f"retention 'kvzip' needs the model's tokenizer to encode its "
                             f"probes, or the options {missing} as token ids")
        for k in missing:
            options[k] = tuple(tokenizer.encode(self.TEXTS[k]))
        return KVzip(self.budget, self.page_size, **options)

    def overhead(self) -> int:
        """The most tokens a probe row holds beside its chunk of the context."""
        ids = (self.instruction_ids, self.continue_ids, self.suffix_ids)
        if any(x is None for x in ids):
            raise ValueError("retention 'kvzip' has no probe ids: bind_tokenizer first")
        first, later, suffix = (len(x) for x in ids)
        return suffix + max(first, later + self.tail)

    def probes(self, tokens: list[int], room: int) -> list[Probe]:
        """One probe per `chunk` tokens of the context (fewer when `room` is short): the
        instruction (the continuation instruction and the previous chunk's last `tail`
        tokens after the first), the suffix, then the chunk, scoring that chunk's keys (by
        `softmax`'s keys). None without room for a chunk token."""
        size = min(self.chunk, room - self.overhead())
        if size < 1:
            return []
        probes = []
        for start in range(0, len(tokens), size):
            end = min(start + size, len(tokens))
            head = self.instruction_ids if start == 0 else (
                *self.continue_ids, *tokens[max(0, start - self.tail):start])
            probes.append(Probe((*head, *self.suffix_ids, *tokens[start:end]), start, end,
                                span=(start, end) if self.softmax == "chunk" else None))
        return probes

    def select(self, view: CacheView, *, is_prefill_done: bool) -> np.ndarray | None:
        return super().select(view, is_prefill_done=is_prefill_done) if view.probed else None

    def key_scores(self, kv: Any, layer: jax.Array, q: jax.Array, inp: Any, shape: Any, *,
                   pages_per_block: int, soft_cap: float | None = None) -> jax.Array:
        def score_rows(q, q_pos, load_pages, block_tables, kv_lens, q_lens, q_weights, spans):
            return max_attention_blockwise(q, load_pages, block_tables, kv_lens, q_lens,
                                           q_weights, spans, num_sinks=self.num_sinks,
                                           pages_per_block=pages_per_block, soft_cap=soft_cap)

        return step_key_scores(kv, layer, q, inp, shape, pages_per_block=pages_per_block,
                               score_rows=score_rows)


# ----------------------------------------------------------------------------- device: scores


def _key_blocks(load_pages: PageLoader, block_tables: jax.Array, pages_per_block: int
                ) -> tuple[int, int, int, int]:
    """(P, K, D, tokens per block) of the pages `load_pages` reads."""
    probe_k, _ = jax.eval_shape(load_pages, block_tables[:, :pages_per_block])
    _, _, p, k_heads, d = probe_k.shape
    return p, k_heads, d, pages_per_block * p


def _load_block(load_pages: PageLoader, block_tables: jax.Array, i: jax.Array,
                pages_per_block: int) -> tuple[jax.Array, jax.Array]:
    """Block i's keys and values, [B, S', K, D] float32 each (S' = pages_per_block * P)."""
    pages = jax.lax.dynamic_slice_in_dim(block_tables, i * pages_per_block, pages_per_block,
                                         axis=1)  # [B, ppb]
    k, v = load_pages(pages)  # [B, ppb, P, K, D]
    b, _, p, k_heads, d = k.shape
    shape = (b, pages_per_block * p, k_heads, d)
    return k.reshape(shape).astype(jnp.float32), v.reshape(shape).astype(jnp.float32)


def key_norm_scores_blockwise(load_pages: PageLoader, block_tables: jax.Array,
                              kv_lens: jax.Array, is_scored: jax.Array, *,
                              pages_per_block: int = 8) -> jax.Array:
    """-||k|| summed over kv heads, per cached key (KNorm's score: lower norms rank higher).

    Args:
      load_pages: page ids [B, n] -> K, V [B, n, P, K, D].
      block_tables: [B, W] int32, W a multiple of pages_per_block.
      kv_lens: [B] int32.
      is_scored: [B] bool; rows that are not get zeros.
    Returns:
      [B, W * P] float32, zero past kv_lens[b].
    """
    b, width = block_tables.shape
    p, _, _, block = _key_blocks(load_pages, block_tables, pages_per_block)
    num_blocks = (jnp.max(kv_lens) + block - 1) // block

    def body(i, out):
        k, _ = _load_block(load_pages, block_tables, i, pages_per_block)  # [B, S', K, D]
        norms = jnp.sqrt(jnp.sum(k * k, axis=-1)).sum(axis=-1)  # [B, S']
        kv_pos = i * block + jnp.arange(block, dtype=jnp.int32)  # [S']
        valid = (kv_pos[None] < kv_lens[:, None]) & is_scored[:, None]  # [B, S']
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(valid, -norms, 0.0),
                                                   i * block, axis=1)

    return jax.lax.fori_loop(0, num_blocks, body, jnp.zeros((b, width * p), jnp.float32))


def query_statistics(q: jax.Array, q_pos: jax.Array, q_weights: jax.Array, rope: RoPE
                     ) -> tuple[jax.Array, jax.Array]:
    """Weighted mean and covariance of queries turned back to position 0 (before RoPE).

    q: [B, C, N, D] (RoPE applied at q_pos [B, C]); q_weights: [B, C] (rows of weight 0 give
    zeros). Returns mu [B, N, D] and cov [B, N, D, D] float32.
    """
    b, c, n, d = q.shape
    raw = rope.rotate(q.reshape(b * c, n, d).astype(jnp.float32),
                      -q_pos.reshape(b * c)).reshape(b, c, n, d)  # [B, C, N, D]
    total = jnp.sum(q_weights, axis=1)  # [B]
    w = q_weights / jnp.where(total > 0, total, 1.0)[:, None]  # [B, C]
    mu = jnp.einsum("bc,bcnd->bnd", w, raw)  # [B, N, D]
    centred = raw - mu[:, None]  # [B, C, N, D]
    cov = jnp.einsum("bc,bcnd,bcne->bnde", w, centred, centred)  # [B, N, D, D]
    return mu, cov


def mean_rotation(rope: RoPE, start: jax.Array, num_future: int, dim: int) -> jax.Array:
    """[B, D, D] the RoPE rotation averaged over positions start[b] .. start[b] + F - 1.

    Rotate-half pairs: R = [[diag(cos), -diag(sin)], [diag(sin), diag(cos)]], cos and sin
    (times RoPE's attention factor) averaged over the positions.
    """
    b = start.shape[0]
    future = (start[:, None] + jnp.arange(num_future, dtype=jnp.int32)).reshape(-1)  # [B*F]
    angles = rope.angles(future, dim).reshape(b, num_future, dim // 2)  # [B, F, D/2]
    cos = jnp.mean(jnp.cos(angles), axis=1) * rope.attention_factor  # [B, D/2]
    sin = jnp.mean(jnp.sin(angles), axis=1) * rope.attention_factor
    top = jnp.concatenate([jax.vmap(jnp.diag)(cos), jax.vmap(jnp.diag)(-sin)], axis=2)
    bottom = jnp.concatenate([jax.vmap(jnp.diag)(sin), jax.vmap(jnp.diag)(cos)], axis=2)
    return jnp.concatenate([top, bottom], axis=1)  # [B, D, D]


def expected_attention_blockwise(q: jax.Array, q_pos: jax.Array, load_pages: PageLoader,
                                 block_tables: jax.Array, kv_lens: jax.Array,
                                 q_lens: jax.Array, q_weights: jax.Array, rope: RoPE, *,
                                 num_future: int, num_sinks: int, covariance: bool = True,
                                 vnorm: bool = True, pages_per_block: int = 8) -> jax.Array:
    """ExpectedAttention's score of each cached key, summed over kv heads (module doc).

    Args:
      q: [B, C, N, D] queries, RoPE applied at q_pos [B, C]; q_weights [B, C] picks the ones
        the statistics use (rows of weight 0 score nothing).
      load_pages: page ids [B, n] -> K, V [B, n, P, K, D].
      block_tables: [B, W] int32, W a multiple of pages_per_block.
      kv_lens, q_lens: [B] int32; the future starts after each row's last query.
    Returns:
      [B, W * P] float32: zero for the first num_sinks keys and past kv_lens[b].
    """
    b, c, n, d = q.shape
    _, width = block_tables.shape
    p, k_heads, _, block = _key_blocks(load_pages, block_tables, pages_per_block)
    g = n // k_heads
    mu, cov = query_statistics(q, q_pos, q_weights, rope)
    last = jnp.take_along_axis(q_pos, jnp.maximum(q_lens - 1, 0)[:, None], axis=1)[:, 0]
    rot = mean_rotation(rope, last + 1, num_future, d)  # [B, D, D]
    mu = jnp.einsum("bij,bnj->bni", rot, mu).reshape(b, k_heads, g, d)  # [B, K, G, D]
    cov = jnp.einsum("bij,bnjk,blk->bnil", rot, cov, rot).reshape(b, k_heads, g, d, d)
    is_scored = jnp.any(q_weights > 0, axis=1)  # [B]
    num_blocks = (jnp.max(kv_lens) + block - 1) // block

    def logits(i):
        k, v = _load_block(load_pages, block_tables, i, pages_per_block)  # [B, S', K, D]
        s = jnp.einsum("bkgd,bskd->bkgs", mu, k) / np.sqrt(d)  # [B, K, G, S']
        if covariance:
            s = s + jnp.einsum("bskd,bkgde,bske->bkgs", k, cov, k) / (2 * d)
        kv_pos = i * block + jnp.arange(block, dtype=jnp.int32)  # [S']
        mask = (kv_pos[None] >= num_sinks) & (kv_pos[None] < kv_lens[:, None]) & \
            is_scored[:, None]  # [B, S']
        return jnp.where(mask[:, None, None], s, -jnp.inf), mask, v

    def normaliser(i, carry):
        m, denom = carry  # [B, K, G] each
        s, mask, _ = logits(i)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        w = jnp.where(mask[:, None, None], jnp.exp(s - m_safe[..., None]), 0.0)
        return m_new, alpha * denom + jnp.sum(w, axis=-1)

    init = (jnp.full((b, k_heads, g), -jnp.inf, jnp.float32),
            jnp.zeros((b, k_heads, g), jnp.float32))
    m, denom = jax.lax.fori_loop(0, num_blocks, normaliser, init)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    inv = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)  # [B, K, G]

    def accumulate(i, out):
        s, mask, v = logits(i)
        probs = jnp.where(mask[:, None, None], jnp.exp(s - m[..., None]), 0.0)
        per_kv_head = jnp.einsum("bkgs,bkg->bks", probs, inv) / g  # [B, K, S']
        if vnorm:
            per_kv_head = per_kv_head * jnp.sqrt(jnp.sum(v * v, axis=-1)).transpose(0, 2, 1)
        block_scores = jnp.where(mask, per_kv_head.sum(axis=1), 0.0)  # [B, S']
        return jax.lax.dynamic_update_slice_in_dim(out, block_scores, i * block, axis=1)

    return jax.lax.fori_loop(0, num_blocks, accumulate, jnp.zeros((b, width * p), jnp.float32))


def max_attention_blockwise(q: jax.Array, load_pages: PageLoader, block_tables: jax.Array,
                            kv_lens: jax.Array, q_lens: jax.Array, q_weights: jax.Array,
                            spans: jax.Array | None = None, *, num_sinks: int = 0,
                            pages_per_block: int = 8, soft_cap: float | None = None,
                            query_tile: int = 128) -> jax.Array:
    """KVzip's score of each cached key of a row's span: the most attention any weighted query
    of a kv head's group pays it, summed over kv heads. The attention is a causal softmax (as
    in `paged_attention_blockwise`) over the keys of the span, the first `num_sinks` and the
    row's own (from kv_lens[b] - q_lens[b] on); a span reaching the row's own keys makes it
    every key the query sees.

    Two passes per tile of `query_tile` queries, over the key blocks the softmax reads: the
    first finds each query's normaliser, the second its probabilities of the span's keys,
    reduced by max into the keys'.

    Args:
      q: [B, C, N, D] (RoPE applied); query c of row b sits at cached index
        kv_lens[b] - q_lens[b] + c.
      load_pages: page ids [B, n] -> K, V [B, n, P, K, D].
      block_tables: [B, W] int32, W a multiple of pages_per_block.
      kv_lens, q_lens: [B] int32.
      q_weights: [B, C] float32: queries of weight 0 score nothing.
      spans: [B, 2] int32, each row's cached indices [lo, hi) (`StepInput.score_spans`); None:
        every key.
      num_sinks: at most one key block's worth.
    Returns:
      [B, W * P] float32: zero outside the rows' spans, past kv_lens[b] and for rows without a
      weighted query.
    """
    b, c, n, d = q.shape
    _, width = block_tables.shape
    p, k_heads, _, block = _key_blocks(load_pages, block_tables, pages_per_block)
    if num_sinks > block:
        raise ValueError(f"kvzip num_sinks={num_sinks} exceeds a key block ({block} keys)")
    g = n // k_heads
    tq = min(query_tile, c)
    num_tiles = -(-c // tq)
    pad = num_tiles * tq - c
    qg = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(
        b, num_tiles * tq, k_heads, g, d) / np.sqrt(d)
    q_idx = jnp.arange(num_tiles * tq, dtype=jnp.int32)[None]  # [1, C']
    own = kv_lens - q_lens  # [B]: the rows' own keys start here
    q_pos = own[:, None] + q_idx  # [B, C']
    q_valid = (q_idx < q_lens[:, None]) & (jnp.pad(q_weights, ((0, 0), (0, pad))) > 0)
    spans = jnp.broadcast_to(jnp.array([0, own.max()], jnp.int32), (b, 2)) if spans is None \
        else spans
    lo, hi = spans[:, 0], jnp.minimum(spans[:, 1], own)  # [B]: the span, before the own keys
    any_row = q_valid.any(axis=1)
    # The blocks read, in order: the sinks' (block 0, unless a span starts there), the
    # spans', the rows' own keys'.
    span_start = jnp.min(jnp.where(any_row, lo, width * p)) // block
    sink_end = ((num_sinks > 0) & (span_start > 0)).astype(jnp.int32)
    span_end = jnp.maximum((jnp.max(jnp.where(any_row, hi, 0)) + block - 1) // block,
                           span_start)
    own_start = jnp.maximum(jnp.min(jnp.where(any_row, own, width * p)) // block, span_end)

    def tile(t, out):
        qt, pos, valid = (jax.lax.dynamic_slice_in_dim(x, t * tq, tq, axis=1)
                          for x in (qg, q_pos, q_valid))
        blocks = (jnp.max(jnp.where(valid, pos + 1, 0)) + block - 1) // block  # causal end
        own_end = jnp.maximum(blocks, own_start)
        num_span = jnp.maximum(jnp.minimum(span_end, blocks) - span_start, 0)
        num_read = sink_end + num_span + own_end - own_start

        def block_at(j):  # the j-th block read
            return jnp.where(j < sink_end, 0, jnp.where(j < sink_end + num_span,
                                                        span_start + j - sink_end,
                                                        own_start + j - sink_end - num_span))

        def logits(i):  # [B, K, G, tq, S'] masked -inf; the mask [B, tq, S'] and in-span [B, S']
            k, _ = _load_block(load_pages, block_tables, i, pages_per_block)
            s = jnp.einsum("bckgd,bskd->bkgcs", qt, k)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kv_pos = i * block + jnp.arange(block, dtype=jnp.int32)[None]  # [1, S']
            in_span = (kv_pos >= lo[:, None]) & (kv_pos < hi[:, None])
            read = in_span | (kv_pos < num_sinks) | (kv_pos >= own[:, None])  # [B, S']
            mask = (kv_pos[:, None] <= pos[:, :, None]) & (
                kv_pos[:, None] < kv_lens[:, None, None]) & valid[:, :, None] & read[:, None]
            return jnp.where(mask[:, None, None], s, -jnp.inf), mask, in_span

        def normaliser(j, carry):
            m, denom = carry  # [B, K, G, tq]
            s, mask, _ = logits(block_at(j))
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
            w = jnp.where(mask[:, None, None], jnp.exp(s - m_safe[..., None]), 0.0)
            return m_new, alpha * denom + jnp.sum(w, axis=-1)

        init = (jnp.full((b, k_heads, g, tq), -jnp.inf, jnp.float32),
                jnp.zeros((b, k_heads, g, tq), jnp.float32))
        m, denom = jax.lax.fori_loop(0, num_read, normaliser, init)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        inv = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)

        def most(i, out):
            s, mask, in_span = logits(i)
            keep = mask & in_span[:, None]
            probs = jnp.where(keep[:, None, None], jnp.exp(s - m[..., None]), 0.0)
            block_max = jnp.max(probs * inv[..., None], axis=(2, 3))  # [B, K, S']
            start = i * block
            kept = jax.lax.dynamic_slice_in_dim(out, start, block, axis=2)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.maximum(kept, block_max),
                                                       start, axis=2)

        return jax.lax.fori_loop(span_start, span_start + num_span, most, out)

    out = jax.lax.fori_loop(0, num_tiles, tile, jnp.zeros((b, k_heads, width * p), jnp.float32))
    return out.sum(axis=1)  # [B, W*P]
