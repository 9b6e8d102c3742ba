"""Reference attention over KV pages in pure jnp with float32 math: the oracle for every kernel.

All functions take one layer's pages, `k_pages` / `v_pages`: [num_pages, P, K, D], and a block
table per sequence, `block_tables`: [B, Pmax] int32 (entry j is the page holding tokens
[j*P, (j+1)*P) of the sequence). `kv_lens`: [B] int32, tokens of each sequence in the cache
(including the ones written by the current step). Entries of `block_tables` past a sequence's
length may hold any valid page index: they are masked by length, never read into the result.

Three entry points, all with the same meaning:
  * `paged_decode_attention_reference`: one query per sequence (decode).
  * `paged_prefill_attention_reference`: a padded chunk of C queries per sequence.
  * `ragged_paged_attention_reference`: queries of several sequences packed on one token axis,
    delimited by `cu_q_lens`; causal within each sequence. The general oracle.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

# load_pages(page_ids [B, n]) -> (k, v), each [B, n, P, K, D].
PageLoader = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


def _scale(head_dim: int, sm_scale: float | None) -> float:
    return 1.0 / np.sqrt(head_dim) if sm_scale is None else sm_scale


def _gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """pages [num_pages, P, K, D], block_tables [B, Pmax] -> [B, Pmax*P, K, D]."""
    b, pmax = block_tables.shape
    _, p, k, d = pages.shape
    return pages[block_tables].reshape(b, pmax * p, k, d)


def _softmax_attend(scores: jax.Array, mask: jax.Array, v: jax.Array, soft_cap: float | None,
                    out_spec: str) -> jax.Array:
    """Masked float32 softmax over the last axis of `scores`, then the weighted sum of `v`."""
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask, scores, -jnp.inf)
    # A row with no visible key (a padded query) gets zeros, not NaN.
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum(out_spec, probs, v)


def _visible(kv_pos: jax.Array, q_pos: jax.Array, kv_len: jax.Array,
             sliding_window: int | jax.Array | None) -> jax.Array:
    """Which kv positions a query at q_pos sees (broadcasting). A sliding window W keeps keys
    q_pos - W + 1 .. q_pos (Mistral / Gemma); an int32 scalar window <= 0 is none."""
    mask = (kv_pos <= q_pos) & (kv_pos < kv_len)
    if sliding_window is not None:
        mask &= (sliding_window <= 0) | (kv_pos > q_pos - sliding_window)
    return mask


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
) -> jax.Array:
    """Decode attention: query b sits at position kv_lens[b] - 1 of its sequence.

    Args:
      q: [B, N, D].
      k_pages, v_pages: [num_pages, P, K, D].
      block_tables: [B, Pmax] int32.
      kv_lens: [B] int32; 0 marks a padded row (its output is zeros).
    Returns:
      [B, N, D] in q's dtype.
    """
    b, n, d = q.shape
    k_heads = k_pages.shape[2]
    k = _gather_pages(k_pages, block_tables).astype(jnp.float32)  # [B, S, K, D]
    v = _gather_pages(v_pages, block_tables).astype(jnp.float32)
    s = k.shape[1]
    qg = q.astype(jnp.float32).reshape(b, k_heads, n // k_heads, d)  # [B, K, G, D]
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k) * _scale(d, sm_scale)  # [B, K, G, S]
    kv_pos = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, S]
    mask = _visible(kv_pos, kv_lens[:, None] - 1, kv_lens[:, None], sliding_window)  # [B, S]
    # Stale or NaN-filled slots beyond the length must not leak through 0 * NaN.
    v = jnp.where(mask[:, :, None, None], v, 0.0)
    out = _softmax_attend(scores, mask[:, None, None, :], v, soft_cap, "bkgs,bskd->bkgd")
    return out.reshape(b, n, d).astype(q.dtype)


def paged_prefill_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
) -> jax.Array:
    """Chunked-prefill attention: row b holds the last q_lens[b] tokens of its sequence.

    Query c of row b sits at position kv_lens[b] - q_lens[b] + c and attends causally to every
    earlier token of its sequence (earlier pages and earlier queries of the same chunk).

    Args:
      q: [B, C, N, D]; queries c >= q_lens[b] are padding (their output is zeros).
      k_pages, v_pages: [num_pages, P, K, D].
      block_tables: [B, Pmax] int32.
      kv_lens: [B] int32, tokens in the cache including this chunk.
      q_lens: [B] int32, 0 <= q_lens <= min(C, kv_lens).
    Returns:
      [B, C, N, D] in q's dtype.
    """
    b, c, n, d = q.shape
    k_heads = k_pages.shape[2]
    k = _gather_pages(k_pages, block_tables).astype(jnp.float32)  # [B, S, K, D]
    v = _gather_pages(v_pages, block_tables).astype(jnp.float32)
    s = k.shape[1]
    qg = q.astype(jnp.float32).reshape(b, c, k_heads, n // k_heads, d)  # [B, C, K, G, D]
    scores = jnp.einsum("bckgd,bskd->bkgcs", qg, k) * _scale(d, sm_scale)  # [B, K, G, C, S]
    q_idx = jnp.arange(c, dtype=jnp.int32)[None, :]  # [1, C]
    q_pos = (kv_lens - q_lens)[:, None] + q_idx  # [B, C]
    kv_pos = jnp.arange(s, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    mask = _visible(kv_pos, q_pos[:, :, None], kv_lens[:, None, None], sliding_window)
    mask &= (q_idx < q_lens[:, None])[:, :, None]  # [B, C, S]
    v = jnp.where(jnp.any(mask, axis=1)[:, :, None, None], v, 0.0)
    out = _softmax_attend(scores, mask[:, None, None], v, soft_cap, "bkgcs,bskd->bckgd")
    return out.reshape(b, c, n, d).astype(q.dtype)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
) -> jax.Array:
    """Ragged attention: the queries of B sequences packed along one token axis.

    Tokens cu_q_lens[b] .. cu_q_lens[b+1]-1 are the last (cu_q_lens[b+1] - cu_q_lens[b]) tokens
    of sequence b; tokens at or past cu_q_lens[B] are padding (zeros out). Decode is the case of
    one token per sequence. Memory is O(T * S): this is the oracle, not the fast path.

    Args:
      q: [T, N, D].
      k_pages, v_pages: [num_pages, P, K, D].
      block_tables: [B, Pmax] int32.
      kv_lens: [B] int32.
      cu_q_lens: [B + 1] int32, nondecreasing, cu_q_lens[0] == 0.
    Returns:
      [T, N, D] in q's dtype.
    """
    t, n, d = q.shape
    b = block_tables.shape[0]
    k_heads = k_pages.shape[2]
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, b - 1)  # [T]
    is_valid = tok < cu_q_lens[b]
    q_pos = kv_lens[seq] - (cu_q_lens[seq + 1] - tok)  # [T]
    k = _gather_pages(k_pages, block_tables[seq]).astype(jnp.float32)  # [T, S, K, D]
    v = _gather_pages(v_pages, block_tables[seq]).astype(jnp.float32)
    s = k.shape[1]
    qg = q.astype(jnp.float32).reshape(t, k_heads, n // k_heads, d)  # [T, K, G, D]
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, k) * _scale(d, sm_scale)  # [T, K, G, S]
    kv_pos = jnp.arange(s, dtype=jnp.int32)[None, :]
    mask = _visible(kv_pos, q_pos[:, None], kv_lens[seq][:, None], sliding_window)
    mask &= is_valid[:, None]  # [T, S]
    v = jnp.where(mask[:, :, None, None], v, 0.0)
    out = _softmax_attend(scores, mask[:, None, None, :], v, soft_cap, "tkgs,tskd->tkgd")
    return out.reshape(t, n, d).astype(q.dtype)


def dense_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array
                              ) -> jax.Array:
    """Plain causal softmax attention of one sequence, for tests: the naive oracle.

    Args:
      q: [T, N, D]; k, v: [S, K, D]; q_positions: [T] (query t sees keys 0..q_positions[t]).
    Returns:
      [T, N, D] float32.
    """
    t, n, d = q.shape
    k_heads = k.shape[1]
    kk = jnp.repeat(k.astype(jnp.float32), n // k_heads, axis=1)  # [S, N, D]
    vv = jnp.repeat(v.astype(jnp.float32), n // k_heads, axis=1)
    scores = jnp.einsum("tnd,snd->nts", q.astype(jnp.float32), kk) / np.sqrt(d)  # [N, T, S]
    mask = jnp.arange(k.shape[0])[None, :] <= q_positions[:, None]  # [T, S]
    probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("nts,snd->tnd", probs, vv)  # [T, N, D]


# Key block of long prefill chunks: with query tiles of 256, blocks of 16 pages of 16 tokens
# prefill faster than 8-page blocks and 128-query tiles on the 2-core CPU host (fewer, larger
# matmuls and softmax passes; docs/benchmarks.md "Native prefill attention").
PREFILL_PAGES_PER_BLOCK = 16


def pages_loader(k_pages: jax.Array, v_pages: jax.Array) -> PageLoader:
    """A PageLoader over plain page arrays [num_pages, P, K, D]."""
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
    return lambda pages: (k_pages[pages], v_pages[pages])


def paged_attention_blockwise(
    q: jax.Array,
    load_pages: PageLoader,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array,
    *,
    pages_per_block: int = 8,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    query_tile: int = 256,
    window: jax.Array | int | None = None,
    kv_starts: jax.Array | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The engine's jnp fast path: `paged_prefill_attention_reference` computed block by block.

    Walks the block tables `pages_per_block` pages at a time with an online softmax, for only as
    many blocks as the longest sequence needs (a dynamic trip count), so the block table can
    keep its full width and the step compiles once whatever the context lengths. Decode is the
    case C == 1, q_lens == 1. Long chunks (C a multiple of `query_tile`, larger than it) are
    taken `query_tile` queries at a time, each tile walking only the blocks its queries see
    (causal), so the work is about half of all queries times all blocks and a tile's scores
    stay in cache.

    Args:
      q: [B, C, N, D_k].
      load_pages: maps page ids [B, n] to float K [B, n, P, K, D_k] and V [B, n, P, K, D];
        this is where a KV layout (or a quantized codec) plugs in, reading only the pages it
        is asked for. D_k is D but for keys read in another form (a low-rank pool's
        coordinates, with q projected alike: `KVState.project_queries`); then pass sm_scale.
      block_tables: [B, W] int32 (padded here with page 0, masked, to a multiple of
        pages_per_block).
      kv_lens, q_lens: [B] int32.
      window: a sliding window (int32 scalar, traced or not; 0 or None: none): a query at
        position t sees keys t - window + 1 .. t, and each row's walk starts at the first
        block its queries need, so pages before it (given back to the pool) are never read.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap) (Gemma 2).
      kv_starts: [B] int32 or None: row b reads only cache positions >= kv_starts[b] (the
        earlier ones live elsewhere, `merge_partials` joins the parts); None: from 0.
      return_lse: also return the log-sum-exp of each query's (capped, scaled) logits over
        the keys it read, [B, C, N] float32 (-inf where it read none).
    Returns:
      [B, C, N, D] in q's dtype, and with return_lse the log-sum-exp.
    """
    b, c, n, d = q.shape  # d: D_k
    block_tables = jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % pages_per_block)))
    probe_k, probe_v = jax.eval_shape(load_pages, block_tables[:, :pages_per_block])
    _, _, p, k_heads, _ = probe_k.shape
    dv = probe_v.shape[-1]  # D, also where keys are read at another width (q's: d)
    g = n // k_heads
    block = pages_per_block * p
    qg = q.astype(jnp.float32).reshape(b, c, k_heads, g, d) * _scale(d, sm_scale)
    q_idx = jnp.arange(c, dtype=jnp.int32)[None, :]  # [1, C]
    q_pos = (kv_lens - q_lens)[:, None] + q_idx  # [B, C]
    q_valid = q_idx < q_lens[:, None]  # [B, C]
    tile = query_tile if c > query_tile and c % query_tile == 0 else c

    def attend(qt, pos, valid):
        """Queries qt [B, Ct, K, G, D] at positions pos [B, Ct] (valid [B, Ct])."""
        ct = qt.shape[1]
        seen = jnp.minimum(jnp.where(valid, pos + 1, 0).max(axis=1), kv_lens)  # [B]
        end_blocks = (seen + block - 1) // block  # [B]
        first_blocks = jnp.zeros((b,), jnp.int32)
        if window is not None:  # each row from the block holding its oldest visible key
            oldest = jnp.where(valid, pos, jnp.iinfo(jnp.int32).max).min(axis=1) - window + 1
            first_blocks = jnp.where(window > 0, jnp.clip(oldest, 0, seen) // block, 0)
        if kv_starts is not None:  # and from the block holding its first position here
            first_blocks = jnp.maximum(first_blocks, kv_starts // block)
        num_steps = jnp.max(end_blocks - first_blocks)

        def body(i, carry):
            m, denom, acc = carry  # [B, K, G, Ct], [B, K, G, Ct], [B, K, G, Ct, D]
            blocks = first_blocks + i  # [B]; a row past its end reads masked pages
            if window is None and kv_starts is None:
                pages = jax.lax.dynamic_slice_in_dim(block_tables, i * pages_per_block,
                                                     pages_per_block, axis=1)  # [B, ppb]
            else:
                entry = blocks[:, None] * pages_per_block + jnp.arange(pages_per_block)
                pages = jnp.take_along_axis(block_tables, jnp.minimum(
                    entry, block_tables.shape[1] - 1), axis=1)  # [B, ppb]
            k, v = load_pages(pages)  # [B, ppb, P, K, D] each
            k = k.reshape(b, block, k_heads, d).astype(jnp.float32)  # [B, S', K, D]
            v = v.reshape(b, block, k_heads, dv).astype(jnp.float32)
            kv_pos = (blocks[:, None] * block
                      + jnp.arange(block, dtype=jnp.int32))[:, None, :]  # [B, 1, S']
            mask = (kv_pos <= pos[:, :, None]) & (kv_pos < kv_lens[:, None, None]) & valid[
                :, :, None]  # [B, Ct, S']
            if window is not None:
                mask &= (window <= 0) | (kv_pos > pos[:, :, None] - window)
            if kv_starts is not None:
                mask &= kv_pos >= kv_starts[:, None, None]
            v = jnp.where(jnp.any(mask, axis=1)[:, :, None, None], v, 0.0)
            s = jnp.einsum("bckgd,bskd->bkgcs", qt, k)  # [B, K, G, Ct, S']
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask[:, None, None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            w = jnp.exp(s - m_safe[..., None])  # masked scores are -inf: exp gives 0
            alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
            denom = alpha * denom + jnp.sum(w, axis=-1)
            acc = alpha[..., None] * acc + jnp.einsum("bkgcs,bskd->bkgcd", w, v)
            return m_new, denom, acc

        init = (jnp.full((b, k_heads, g, ct), -jnp.inf, jnp.float32),
                jnp.zeros((b, k_heads, g, ct), jnp.float32),
                jnp.zeros((b, k_heads, g, ct, dv), jnp.float32))
        m, denom, acc = jax.lax.fori_loop(0, num_steps, body, init)
        out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [B, K, G, Ct, D]
        lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
        return (jnp.einsum("bkgcd->bckgd", out).reshape(b, ct, n, dv),
                jnp.einsum("bkgc->bckg", lse).reshape(b, ct, n))  # [B, Ct, N, D], [B, Ct, N]

    if tile == c:
        out, lse = attend(qg, q_pos, q_valid)
    else:
        def split(x):  # [B, C, ...] -> [C / tile, B, tile, ...]
            return jnp.moveaxis(x.reshape(b, c // tile, tile, *x.shape[2:]), 1, 0)

        out, lse = jax.lax.map(lambda xs: attend(*xs), (split(qg), split(q_pos), split(q_valid)))
        out = jnp.moveaxis(out, 0, 1).reshape(b, c, n, dv)
        lse = jnp.moveaxis(lse, 0, 1).reshape(b, c, n)
    return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)


def merge_partials(outs: jax.Array, lses: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Attention over a union of disjoint key sets, from each set's attention: exact.

    Part s attended over its keys alone, giving out[s] = sum_j p_sj v_j with p_sj =
    exp(l_j - lse[s]) and lse[s] = log sum_j exp(l_j). The union's attention weighs each part by
    exp(lse[s] - lse), lse = log sum_s exp(lse[s]). A part that read no key has lse -inf and
    weight 0 (its output is ignored, so zeros or anything finite); with one non-empty part the
    result is that part's output unchanged.

    Args:
      outs: [S, ..., D] the parts' outputs (any float dtype; the sum is float32).
      lses: [S, ...] float32, their log-sum-exps (-inf: the part read no key).
    Returns:
      ([..., D] in outs' dtype, [...] float32 lse of the union; -inf where no part read a key).
    """
    m = jnp.max(lses, axis=0)  # [...]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    weights = jnp.exp(lses - m_safe)  # [S, ...]; -inf parts give 0
    denom = jnp.sum(weights, axis=0)  # [...]
    outs32 = jnp.where(weights[..., None] > 0, outs.astype(jnp.float32), 0.0)
    out = jnp.sum(weights[..., None] * outs32, axis=0) / jnp.where(denom > 0, denom, 1.0)[
        ..., None]  # [..., D]
    lse = jnp.where(denom > 0, m_safe + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out.astype(outs.dtype), lse
