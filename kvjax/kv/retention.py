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
              its B // P pages of highest key bound (the max or   heads='max',
              sum over query heads), the newest page always       echo_prefetch=None,
              among them, except in the first dense_layers        record_reads=False,
              layers, which read every page (Quest,               echo_keep_misses=True
              kvjax.kv.quest); with echo_prefetch=m the host
              pool holds every full page and the device only
              the B // P + m pages the previous selection ranked
              first in each layer (ECHO, kvjax.engine.echo),
              keeping the pages a step fetched as misses unless
              echo_keep_misses=False; record_reads=True returns
              each decode step's selection (StepOutput.page_reads)
              without ECHO
  ==========  ==================================================  ===========================

The scoring presses tova, knorm, expected_attention, observed_attention and kvzip
(kvjax.kv.presses) register here too.

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
`kvjax.kv.budgets` shares a budget per layer (PyramidKV) and per head (AdaKV) over per-layer,
per-head scores and declares the layer groups whose own block tables free those pages; the
engine serves PyramidKV's per-layer schedule over the presses that compress once that way
(`EngineConfig.retention_schedule`, `kvjax.kv.layer_retention`: a cached length, key scores
and a compaction per table group), and the per-head schemes are measured on a simulated cache
(`kvjax.bench.budgets`).

Prefix cache. A page indexed before a sequence's first eviction holds exact K/V (nothing was
evicted when it was computed) and stays indexed: compaction copies it on write rather than
change it. From the first eviction on, a sequence indexes nothing more (`BlockManager.retain`),
and the policy and budget are part of the provenance fingerprint, so no page is ever served
to a request that expects another retention.

Codecs. The device side of a compaction is `KVState.compact` with a `kv_state.Compaction`
(`plan_compaction` builds it on the host from the block manager's new layout, as the
`CompactionPlan` a `KVOpKind.COMPACT` op carries; the runner applies it with a `Compactor`
in the step's dispatch). A state that stores each
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
Speculative decoding verifies drafts against the cache the policy keeps and lets it decide
over the accepted tokens only (`kvjax.scheduler.spec`, `RetentionPolicy.max_undecided_tokens`).
A request of streaming, h2o or tova may be longer than the pool (it never holds more than its
budget plus a prefill chunk); others must fit the pool whole.

Modules: the host side (the policies' choices, the registry, `RetentionManager`, `SeqLayout`)
is defined without jax in `kvjax.kv.retention_host`, so the KV cache manager and the scheduler
import none; this module holds the device side and Quest, registers the scoring presses, and
re-exports the host side's names.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import jit as kvjax_jit
from kvjax.kv import layout, quest
from kvjax.kv import state as kv_state
from kvjax.kv.attention import PageLoader

# The host side (policies' choices, the registry, the host record) is defined without jax in
# kvjax.kv.retention_host; every name is importable from here as well.
from kvjax.kv.retention_host import (  # noqa: F401
    H2O,
    CacheView,
    CompactionPlan,
    NoRetention,
    Pooling,
    Probe,
    RetentionManager,
    RetentionPolicy,
    SeqLayout,
    SnapKV,
    StreamingLLM,
    _check_budget,
    _Evicting,
    _Policy,
    _top,
    compresses_once_undecided,
    make_retention,
    plan_compaction,
    pool_scores,
    register_retention,
    retention_names,
)
from kvjax.kv.spec import KVCacheSpec
from kvjax.models.rope import RoPE


@register_retention
class Quest(_Policy):
    """Query-aware page reads: every page stays, each decode query reads its top pages."""

    name = "quest"
    option_names = ("dense_layers", "heads", "echo_prefetch", "record_reads",
                    "echo_keep_misses")
    narrows_reads = True
    num_index_leaves = 2  # key_min, key_max (`QuestKV.page_leaves`)

    def __init__(self, budget: int | None, page_size: int, dense_layers: int = 2,
                 heads: str | quest.HeadReduction = quest.HeadReduction.MAX,
                 echo_prefetch: int | None = None, record_reads: bool = False,
                 echo_keep_misses: bool = True):
        if not isinstance(record_reads, bool):
            raise ValueError(f"quest record_reads must be a bool, got {record_reads!r}")
        if not isinstance(echo_keep_misses, bool):
            raise ValueError(f"quest echo_keep_misses must be a bool, got {echo_keep_misses!r}")
        if echo_prefetch is not None and (isinstance(echo_prefetch, bool) or not isinstance(
                echo_prefetch, int) or echo_prefetch < 0):
            raise ValueError(f"quest echo_prefetch must be None or an int >= 0, got "
                             f"{echo_prefetch!r}")
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
        self.echo_prefetch = echo_prefetch
        # ECHO: each step writes the pages it read from the host pool into frames, so the next
        # does not fetch them again (`kvjax.scheduler.echo`).
        self.echo_keep_misses = echo_keep_misses
        # Each decode step's selection goes back to the host (`StepOutput.page_reads`) only
        # where something reads it: ECHO's planner, or an observer that asked for it.
        self.records_reads = echo_prefetch is not None or record_reads

    def fingerprint(self) -> str:
        # Where pages live (ECHO) changes no value attention reads.
        return (f"{self.name}:B{self.budget}:dense_layers={self.dense_layers},"
                f"heads={self.heads.value}")

    def wrap_state(self, kv: Any) -> quest.QuestKV:
        return quest.init_quest_kv(kv)

    def wrap_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        return quest.summarized_spec(spec)

    def select_reads(self, kv: quest.QuestKV, layer: jax.Array, q: jax.Array, inp: Any,
                     shape: Any, host_kv: quest.QuestKV | None = None
                     ) -> tuple[jax.Array, jax.Array] | None:
        """The decode rows' selected entries; with `host_kv` (ECHO), from the summaries of
        every page where it lies (`quest.echo_summaries`)."""
        bd = shape.num_decode
        if bd == 0:
            return None
        summaries = None if host_kv is None else quest.echo_summaries(
            kv, host_kv, inp.block_tables[:bd], inp.host_tables)
        return quest.select_decode_pages(kv, layer, q[:bd], inp.block_tables[:bd],
                                         inp.kv_lens[:bd], self.num_read_pages,
                                         num_dense_layers=self.dense_layers,
                                         head_reduction=self.heads, summaries=summaries)


# ----------------------------------------------------------------------------- device: scores


# `key_scores_blockwise` keeps a step's logits (and loads the keys once) up to this many
# float32 entries (64 MiB): decode rows and a prefill row's scored window, not every query of a
# long prefill chunk.
MAX_KEPT_LOGITS = 1 << 24


def key_scores_blockwise(q: jax.Array, load_pages: PageLoader, block_tables: jax.Array,
                         kv_lens: jax.Array, q_lens: jax.Array, q_weights: jax.Array, *,
                         pages_per_block: int = 8, sm_scale: float | None = None,
                         soft_cap: float | None = None,
                         max_kept_logits: int = MAX_KEPT_LOGITS,
                         query_tile: int = 256) -> jax.Array:
    """The attention probability each cached key receives, summed over heads and queries.

    Same masking as `paged_attention_blockwise` (query c of row b sits at cached index
    kv_lens[b] - q_lens[b] + c and sees every earlier index). One pass over the blocks loads
    the keys and finds each query's softmax normaliser; the probabilities then come from the
    logits it kept ([B, N, C, W*P], when at most `max_kept_logits` entries: decode rows, a
    prefill row's scored window) or, for many queries (every query of a long prefill chunk),
    from a second pass loading the keys again, `query_tile` queries at a time: each tile
    passes over the key blocks its weighted queries can see, so a chunk that starts its
    sequence scores about half the (query, key) pairs, a tile of weight-0 queries none, and a
    tile's logits stay small.

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
    g, width = n // k_heads, block_tables.shape[1] * p
    qg = q.astype(jnp.float32).reshape(b, c, k_heads, g, d) * scale
    q_idx = jnp.arange(c, dtype=jnp.int32)[None, :]  # [1, C]
    q_pos = (kv_lens - q_lens)[:, None] + q_idx  # [B, C]
    q_valid = q_idx < q_lens[:, None]  # [B, C]
    q_weights = q_weights.astype(jnp.float32)
    num_blocks = (jnp.max(kv_lens) + block - 1) // block

    def logits(i, qg, q_pos, q_valid):  # the queries' logits against key block i, masked
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

    def first_pass(queries, weights, blocks, keep):
        """Each query's max logit m and weight / softmax normaliser over key blocks
        [0, blocks), [B, K, G, C'] each; with `keep`, also the logits [B, K, G, C', W*P]."""
        tq = queries[0].shape[1]

        def body(i, carry):
            m, denom, kept = carry
            s, mask = logits(i, *queries)  # masked entries -inf: exp(-inf - m) = 0 below
            if keep:
                kept = jax.lax.dynamic_update_slice_in_dim(kept, s, i * block, axis=-1)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
            w = jnp.where(mask[:, None, None], jnp.exp(s - m_safe[..., None]), 0.0)
            return m_new, alpha * denom + jnp.sum(w, axis=-1), kept

        init = (jnp.full((b, k_heads, g, tq), -jnp.inf, jnp.float32),
                jnp.zeros((b, k_heads, g, tq), jnp.float32),
                jnp.full((b, k_heads, g, tq, width) if keep else (), -jnp.inf, jnp.float32))
        m, denom, kept = jax.lax.fori_loop(0, blocks, body, init)
        inverse = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)
        return jnp.where(jnp.isfinite(m), m, 0.0), inverse * weights[:, None, None, :], kept

    if b * n * c * width <= max_kept_logits:  # blocks past num_blocks stayed -inf
        m, weight, kept = first_pass((qg, q_pos, q_valid), q_weights, num_blocks, True)
        return jnp.einsum("bkgcs,bkgc->bs", jnp.exp(kept - m[..., None]), weight)

    tq = min(query_tile, c)
    num_tiles = -(-c // tq)
    pad = num_tiles * tq - c  # padded queries are invalid, weight 0
    if pad:
        qg = jnp.pad(qg, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        q_pos, q_valid, q_weights = (jnp.pad(x, ((0, 0), (0, pad)))
                                     for x in (q_pos, q_valid, q_weights))

    def tile(t, out):
        queries = tuple(jax.lax.dynamic_slice_in_dim(x, t * tq, tq, axis=1)
                        for x in (qg, q_pos, q_valid))
        weights = jax.lax.dynamic_slice_in_dim(q_weights, t * tq, tq, axis=1)  # [B, tq]
        seen = jnp.max(jnp.where(queries[2] & (weights != 0), queries[1] + 1, 0))
        blocks = jnp.minimum(num_blocks, (seen + block - 1) // block)
        m, weight, _ = first_pass(queries, weights, blocks, False)

        def second_pass(i, out):
            s, mask = logits(i, *queries)
            probs = jnp.where(mask[:, None, None], jnp.exp(s - m[..., None]), 0.0)
            block_scores = jnp.einsum("bkgcs,bkgc->bs", probs, weight)  # [B, S']
            start = i * block
            return jax.lax.dynamic_update_slice_in_dim(
                out, jax.lax.dynamic_slice_in_dim(out, start, block, axis=1) + block_scores,
                start, axis=1)

        return jax.lax.fori_loop(0, blocks, second_pass, out)

    out = jnp.zeros((b, width), jnp.float32)
    return jax.lax.fori_loop(0, num_tiles, tile, out)  # [B, W*P]


class RowScorer(Protocol):
    """Scores the cached keys of a group of rows (`step_key_scores`' `score_rows`).

    q: [B, C, N, D] (RoPE applied), q_pos: [B, C] int32 their logical positions, load_pages:
    page ids [B, n] -> K, V [B, n, P, K, D], block_tables: [B, W], kv_lens, q_lens: [B],
    q_weights: [B, C] (0 past q_lens), spans: [B, 2] (`StepInput.score_spans`). Returns
    [B, W * P] float32, zero past kv_lens.
    """

    def __call__(self, q: jax.Array, q_pos: jax.Array, load_pages: PageLoader,
                 block_tables: jax.Array, kv_lens: jax.Array, q_lens: jax.Array,
                 q_weights: jax.Array, spans: jax.Array) -> jax.Array: ...


def last_queries(q: jax.Array, pos: jax.Array, weights: jax.Array, q_lens: jax.Array,
                 num: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The last `num` queries of each prefill row: q [Bp, C, ...], pos, weights [Bp, C] and
    q_lens [Bp] -> the same over [Bp, num], q_lens min(q_lens, num). A row's query c of the
    result is its query q_len - min(q_len, num) + c, so it keeps its position relative to the
    row's kv length (`key_scores_blockwise` places query c at kv_len - q_len + c)."""
    start = jnp.maximum(q_lens - num, 0)[:, None]  # [Bp, 1]
    index = start + jnp.arange(num, dtype=jnp.int32)[None]  # [Bp, num], < C since num < C

    def take(x):
        return jnp.take_along_axis(x, index.reshape(*index.shape, *(1,) * (x.ndim - 2)), axis=1)

    return take(q), take(pos), take(weights), jnp.minimum(q_lens, num)


def step_key_scores(kv: Any, layer: jax.Array, q: jax.Array, inp: Any, shape: Any, *,
                    pages_per_block: int, score_rows: RowScorer | None = None,
                    soft_cap: float | None = None, scored_queries: int | None = None
                    ) -> jax.Array:
    """Key scores of a step's rows (decode rows, then prefill rows). q: [T, N, D] -> [R, W*P],
    or in a verify step (decode width Wd > 1) [R, Wd, W*P]: each decode row's queries scored
    one at a time, query c as the one query of a decode step at its kv length (what plain
    decoding would score for its token), a prefill row's sum at index 0.

    score_rows: what a row's keys score; None: the attention its weighted queries pay them
    (`key_scores_blockwise`). A group of rows whose queries all have weight 0 skips the
    computation. scored_queries: at most this many of a prefill row's queries have a weight,
    all among its last ones (`RetentionPolicy.scored_queries`): only those are scored (at 8k
    tokens in one chunk, SnapKV's 64-query window instead of 8192 queries); None: every query.
    """
    bd, bp, wd = shape.num_decode, shape.num_prefill, shape.decode_width
    width = inp.block_tables.shape[1] * kv.page_size

    def scored(q_rows, pos_rows, weights, tables, kv_lens, q_lens, seq_slots, kv_floors,
               spans):
        # A prefill view pads a row with the tokens after it: their weights are not its own.
        weights = jnp.where(jnp.arange(weights.shape[1])[None] < q_lens[:, None], weights, 0.0)

        def compute():
            row_tables, load = kv.row_loader(layer, tables, kv_lens, seq_slots, kv_floors)
            if score_rows is None:
                return key_scores_blockwise(q_rows, load, row_tables, kv_lens, q_lens,
                                            weights, pages_per_block=pages_per_block,
                                            soft_cap=soft_cap)
            return score_rows(q_rows, pos_rows, load, row_tables, kv_lens, q_lens, weights,
                              spans)

        zeros = jnp.zeros((q_rows.shape[0], width), jnp.float32)
        return jax.lax.cond(jnp.any(weights > 0), compute, lambda: zeros)

    def rows_of(rows: slice, repeat: int = 1) -> tuple[jax.Array, ...]:
        return tuple(jnp.repeat(x[rows], repeat, axis=0) for x in (
            inp.block_tables, inp.kv_lens, inp.q_lens, inp.seq_slots, inp.kv_floors,
            inp.score_spans))

    w, pos = inp.score_weights, inp.positions
    parts = []
    if bd and wd == 1:
        parts.append(scored(q[:bd, None], pos[:bd, None], w[:bd, None], *rows_of(slice(0, bd))))
    elif bd:  # Bd * Wd one-query rows: query c of a row sees its first kv_len - q_len + c + 1
        tables, kv_lens, q_lens, slots, floors, spans = rows_of(slice(0, bd), wd)
        c = jnp.tile(jnp.arange(wd, dtype=jnp.int32), bd)  # [Bd * Wd]
        is_query = c < q_lens
        one_lens = jnp.where(is_query, kv_lens - q_lens + c + 1, 0)
        num = bd * wd
        out = scored(q[:num, None], pos[:num, None], w[:num, None], tables, one_lens,
                     is_query.astype(jnp.int32), slots, floors, spans)  # [Bd * Wd, W*P]
        parts.append(out.reshape(bd, wd, width))
    if bp:
        q_p, pos_p, w_p = (layout.prefill_view(x, inp, shape) for x in (q, pos, w))
        tables, kv_lens, q_lens, slots, floors, spans = rows_of(slice(bd, bd + bp))
        if scored_queries is not None and scored_queries < q_p.shape[1]:
            q_p, pos_p, w_p, q_lens = last_queries(q_p, pos_p, w_p, q_lens, scored_queries)
        out = scored(q_p, pos_p, w_p, tables, kv_lens, q_lens, slots, floors, spans)
        if wd > 1:  # [Bp, W*P] -> [Bp, Wd, W*P], the sum at query 0
            out = jnp.zeros((bp, wd, width), jnp.float32).at[:, 0].set(out)
        parts.append(out)
    return jnp.concatenate(parts, axis=0)  # [R, W*P] or [R, Wd, W*P]


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


def compaction_of(plan: CompactionPlan) -> kv_state.Compaction:
    """The device's `kv_state.Compaction` of a host `CompactionPlan` (int32 arrays)."""
    return kv_state.Compaction(**plan.arrays())


class Compactor:
    """The device side of `KVOpKind.COMPACT` ops: the jitted `KVState.compact`, the state
    donated, one program per plan size.

    Args:
      rotate: how kept keys turn (the model's `RoPE.rotate`) for a policy that rotates
        them, else None.
    """

    def __init__(self, rotate: kv_state.Rotate | None = None):
        self._rotate = rotate
        self._program = kvjax_jit.jit(_compact, donate_argnums=0, static_argnums=2)

    def __call__(self, kv: Any, plan: CompactionPlan) -> Any:
        return self._program(kv, compaction_of(plan), self._rotate)

    @property
    def num_compiles(self) -> int:
        return self._program.num_compiles


# The scoring presses register themselves beside the policies; importing them here makes
# every registered name available wherever the registry is.
from kvjax.kv import presses as _presses  # noqa: E402, F401
