"""Retention policies and Quest page selection against brute-force numpy versions.

Selections are checked against exhaustive search (the kept subset of the budget's size that
maximizes the total score, under the policy's constraints) on small cases; the device pieces
(key scores, Quest summaries and bounds, slot moves) against dense numpy; the block manager's
compaction against a model of the pages' contents.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from kvjax.kv import quest
from kvjax.kv.attention import pages_loader
from kvjax.kv.retention import (
    CacheView,
    Pooling,
    RetentionManager,
    key_scores_blockwise,
    last_queries,
    make_retention,
    move_slots,
    pool_scores,
    retention_names,
    rotate_slots,
)
from kvjax.kv.state import PagedKV
from kvjax.memory.block_manager import AllocStatus, BlockManager
from kvjax.models.rope import RoPE

P = 4


def view_of(scores) -> CacheView:
    scores = np.asarray(scores, np.float32)
    return CacheView(positions=np.arange(len(scores), dtype=np.int32), scores=scores)


def best_subset(scores, size, required, candidates) -> list[int]:
    """Exhaustive search: `required` plus the `size - len(required)` candidates of largest sum."""
    best = max(itertools.combinations(candidates, size - len(required)),
               key=lambda c: sum(scores[i] for i in c))
    return sorted(list(best) + list(required))


# ----------------------------------------------------------------------------- selections


def test_registry_lists_every_policy_and_rejects_unknown_names_and_options():
    assert retention_names() == ["expected_attention", "h2o", "knorm", "kvzip", "none",
                                 "observed_attention", "quest", "snapkv", "streaming", "tova"]
    with pytest.raises(ValueError, match="'lru'"):
        make_retention("lru", 8, P)
    with pytest.raises(ValueError, match="window_size"):
        make_retention("snapkv", 80, P, window_size=8)
    with pytest.raises(ValueError, match="retention_budget"):
        make_retention("streaming", None, P)
    with pytest.raises(ValueError, match="num_sinks"):
        make_retention("streaming", 8, P, num_sinks=-1)
    with pytest.raises(ValueError, match="num_sinks < page_size"):
        make_retention("streaming", 8, P, num_sinks=P, cache_positions=True)
    with pytest.raises(ValueError, match="cache_positions"):
        make_retention("streaming", 8, P, cache_positions=1)
    with pytest.raises(ValueError, match="pooling"):
        make_retention("snapkv", 80, P, pooling="median")
    with pytest.raises(ValueError, match="kernel"):
        make_retention("snapkv", 80, P, kernel=4)
    with pytest.raises(ValueError, match="num_recent"):
        make_retention("h2o", 8, P, num_recent=9)
    with pytest.raises(ValueError, match=">= 4"):
        make_retention("quest", 3, P)
    with pytest.raises(ValueError, match="dense_layers"):
        make_retention("quest", 8, P, dense_layers=-1)
    with pytest.raises(ValueError, match="heads"):
        make_retention("quest", 8, P, heads="mean")
    with pytest.raises(ValueError, match="no retention_budget"):
        make_retention("none", 8, P)


def test_fingerprint_names_policy_budget_and_options():
    prints = {make_retention("none", None, P).fingerprint(),
              make_retention("streaming", 8, P).fingerprint(),
              make_retention("streaming", 12, P).fingerprint(),
              make_retention("streaming", 8, P, num_sinks=2).fingerprint(),
              make_retention("streaming", 8, P, num_sinks=2, cache_positions=True).fingerprint(),
              make_retention("h2o", 8, P).fingerprint(),
              make_retention("snapkv", 80, P).fingerprint(),
              make_retention("snapkv", 80, P, pooling="avg").fingerprint(),
              make_retention("quest", 8, P).fingerprint(),
              make_retention("quest", 8, P, dense_layers=0).fingerprint(),
              make_retention("quest", 8, P, heads="sum").fingerprint()}
    assert len(prints) == 11


@pytest.mark.parametrize("size,budget,sinks", [(12, 8, 4), (13, 8, 0), (20, 9, 2), (11, 8, 4)])
def test_streaming_keeps_sinks_and_recent_window(size, budget, sinks):
    policy = make_retention("streaming", budget, P, num_sinks=sinks)
    keep = policy.select(view_of(np.zeros(size)), is_prefill_done=False)
    if size < budget + P:
        assert keep is None
        return
    expected = [i for i in range(size) if i < sinks or size - i <= budget - sinks]
    assert keep.tolist() == expected


def test_streaming_cache_positions_shifts_sinks_by_the_tokens_dropped():
    plain = make_retention("streaming", 8, P, num_sinks=2)
    moving = make_retention("streaming", 8, P, num_sinks=2, cache_positions=True)
    view = view_of(np.zeros(13))  # over budget + P: back down to 8, dropping 5
    keep = moving.select(view, is_prefill_done=True)
    assert plain.rotary_shifts(view, keep) is None
    assert moving.rotary_shifts(view, keep).tolist() == [5, 5] + [0] * 6
    with pytest.raises(ValueError, match="needs rope"):
        RetentionManager(moving)


def test_rotated_sink_keys_give_the_logits_of_in_cache_positions():
    """rotate_slots turns a key at position p into the key at p + s; with the sinks shifted
    by the E tokens evicted, a query at logical position m scores them as a query at its cache
    position m - E scores sinks at their own positions (StreamingLLM)."""
    rng = np.random.default_rng(4)
    num_layers, num_pages, k_heads, d, rope = 2, 3, 2, 8, RoPE(theta=10000.0)
    raw = rng.normal(size=(num_layers, num_pages * P, k_heads, d)).astype(np.float32)
    positions = jnp.arange(num_pages * P)
    k = jax.vmap(lambda x: rope.apply(x, positions))(jnp.asarray(raw))
    shape = (num_layers, num_pages, P, k_heads, d)
    kv = PagedKV(k_pages=k.reshape(shape), v_pages=jnp.asarray(raw).reshape(shape))
    slots, shifts = jnp.array([1, 6, 6]), jnp.array([40, 3, 3])  # a repeat, same shift
    got = np.asarray(rotate_slots(kv, slots, shifts, rope).k_pages).reshape(raw.shape)
    want = np.array(k)
    for slot, shift in ((1, 40), (6, 3)):
        want[:, slot] = rope.apply(jnp.asarray(raw[:, slot]), jnp.full(num_layers, slot + shift))
    np.testing.assert_allclose(got, want, atol=1e-5)
    q, m, evicted = rng.normal(size=(1, k_heads, d)).astype(np.float32), 90, 40
    in_cache = rope.apply(jnp.asarray(q), jnp.array([m - evicted]))[0]  # [K, D]
    logical = rope.apply(jnp.asarray(q), jnp.array([m]))[0]
    np.testing.assert_allclose(np.sum(np.asarray(logical) * got[0, 1], -1),
                               np.sum(np.asarray(in_cache) * np.asarray(k[0, 1]), -1),
                               atol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_h2o_keeps_recent_plus_heaviest(seed):
    rng = np.random.default_rng(seed)
    size, budget, recent = int(rng.integers(10, 14)), 6, int(rng.integers(1, 5))
    scores = rng.random(size)
    keep = make_retention("h2o", budget, P, num_recent=recent).select(
        view_of(scores), is_prefill_done=False)
    required = list(range(size - recent, size))
    assert keep.tolist() == best_subset(scores, budget, required, range(size - recent))


def pool_reference(x, kernel, pooling):
    half = kernel // 2
    out = []
    for i in range(len(x)):
        window = [x[j] for j in range(i - half, i + half + 1) if 0 <= j < len(x)]
        out.append(max(window) if pooling == "max" else sum(window) / kernel)
    return np.array(out)


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_pooling_matches_loop(pooling, kernel):
    x = np.random.default_rng(kernel).random(11).astype(np.float32)
    np.testing.assert_allclose(pool_scores(x, kernel, Pooling(pooling)),
                               pool_reference(x, kernel, pooling), rtol=1e-6)


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("seed", range(4))
def test_snapkv_keeps_window_plus_best_pooled(pooling, seed):
    rng = np.random.default_rng(seed)
    size, budget, window, kernel = 14, 8, 3, 3
    scores = rng.random(size)
    policy = make_retention("snapkv", budget, P, window=window, kernel=kernel, pooling=pooling)
    view = view_of(scores)
    assert policy.select(view, is_prefill_done=False) is None  # only at the end of prefill
    keep = policy.select(view, is_prefill_done=True)
    pooled = pool_reference(scores[:size - window], kernel, pooling)
    required = list(range(size - window, size))
    assert keep.tolist() == best_subset(pooled, budget, required, range(size - window))
    view.is_prefill_done = True
    assert policy.select(view, is_prefill_done=True) is None  # compresses once
    weights = policy.score_weights(None, np.arange(10, 16), 15)
    assert weights.tolist() == [0, 0, 1, 1, 1, 1]  # the last `window` tokens of 15
    assert not policy.score_weights(view, np.arange(10, 16), 15).any()


def test_snapkv_leaves_short_prompts_alone():
    policy = make_retention("snapkv", 8, P, window=3)
    assert policy.select(view_of(np.ones(8)), is_prefill_done=True) is None


# ----------------------------------------------------------------------------- key scores


def dense_key_scores(q, k_seq, kv_len, q_len, weights, soft_cap=None):
    """[S] attention probability mass per key: loops over queries and heads, float64."""
    c, n, d = q.shape
    g = n // k_seq.shape[1]
    out = np.zeros(kv_len)
    for ci in range(q_len):
        pos = kv_len - q_len + ci
        for h in range(n):
            logits = k_seq[:pos + 1, h // g] @ q[ci, h] / np.sqrt(d)
            if soft_cap is not None:
                logits = soft_cap * np.tanh(logits / soft_cap)
            p = np.exp(logits - logits.max())
            out[:pos + 1] += weights[ci] * p / p.sum()
    return out


@pytest.mark.parametrize("soft_cap", [None, 1.5])
@pytest.mark.parametrize("kept_logits,query_tile", [(True, 256), (False, 256), (False, 2)])
def test_key_scores_match_dense_softmax_mass(soft_cap, kept_logits, query_tile):
    """The probabilities are the ones the model attends with, soft cap (Gemma 2) included;
    from the logits the first pass kept, or (too many to keep) from a second pass, over
    every query at once or in tiles of two (the last one padded), each over the key blocks
    its queries see."""
    rng = np.random.default_rng(0)
    b, c, n, k_heads, d, num_pages, width = 3, 5, 4, 2, 8, 24, 8
    k_pages = rng.normal(size=(num_pages, P, k_heads, d)).astype(np.float32)
    v_pages = np.full_like(k_pages, np.nan)  # values are never needed
    tables = rng.permutation(num_pages)[:b * width].reshape(b, width).astype(np.int32)
    kv_lens = np.array([17, 3, 30], np.int32)
    q_lens = np.array([5, 1, 4], np.int32)
    q = 3 * rng.normal(size=(b, c, n, d)).astype(np.float32)  # logits past the cap
    weights = rng.random((b, c)).astype(np.float32)
    got = np.asarray(key_scores_blockwise(
        jnp.asarray(q), pages_loader(k_pages, v_pages), jnp.asarray(tables),
        jnp.asarray(kv_lens), jnp.asarray(q_lens), jnp.asarray(weights), pages_per_block=2,
        soft_cap=soft_cap, max_kept_logits=b * n * c * width * P if kept_logits else 0,
        query_tile=query_tile))
    assert got.shape == (b, width * P)
    for i in range(b):
        k_seq = k_pages[tables[i]].reshape(width * P, k_heads, d)
        want = dense_key_scores(q[i], k_seq, kv_lens[i], q_lens[i], weights[i], soft_cap)
        np.testing.assert_allclose(got[i, :kv_lens[i]], want, rtol=2e-5, atol=1e-6)
        assert not got[i, kv_lens[i]:].any()


def test_scoring_only_the_last_queries_gives_the_dense_scores_of_a_weighted_window():
    """A press whose weighted queries are a prefill row's last ones (SnapKV's window) scores
    only those (`last_queries`): rows longer and shorter than the window, each query at its
    own causal position, against the dense mass of every query with the same weights."""
    rng = np.random.default_rng(2)
    b, c, n, k_heads, d, num_pages, width, window = 3, 9, 4, 2, 8, 24, 8, 3
    k_pages = rng.normal(size=(num_pages, P, k_heads, d)).astype(np.float32)
    tables = rng.permutation(num_pages)[:b * width].reshape(b, width).astype(np.int32)
    kv_lens = np.array([20, 2, 31], np.int32)
    q_lens = np.array([9, 2, 6], np.int32)
    q = 3 * rng.normal(size=(b, c, n, d)).astype(np.float32)
    idx = np.arange(c)[None]
    weights = ((idx < q_lens[:, None]) & (idx >= q_lens[:, None] - window)).astype(np.float32)
    pos = (kv_lens - q_lens)[:, None] + idx
    q_w, pos_w, w_w, lens_w = last_queries(jnp.asarray(q), jnp.asarray(pos),
                                           jnp.asarray(weights), jnp.asarray(q_lens), window)
    np.testing.assert_array_equal(lens_w, [3, 2, 3])
    np.testing.assert_array_equal(pos_w[0], [17, 18, 19])  # the row's last three positions
    got = np.asarray(key_scores_blockwise(
        q_w, pages_loader(k_pages, np.full_like(k_pages, np.nan)), jnp.asarray(tables),
        jnp.asarray(kv_lens), lens_w, w_w, pages_per_block=2))
    for i in range(b):
        k_seq = k_pages[tables[i]].reshape(width * P, k_heads, d)
        want = dense_key_scores(q[i], k_seq, kv_lens[i], q_lens[i], weights[i])
        np.testing.assert_allclose(got[i, :kv_lens[i]], want, rtol=2e-5, atol=1e-6)


def test_a_policy_weighting_queries_it_promised_not_to_score_is_refused():
    """`scored_queries` is a policy's promise that the step may drop every query of a prefill
    row but its last ones: SnapKV and TOVA keep it on a row longer than their window, and a
    policy that weights an earlier query is refused before the step would drop it silently."""
    for name in ("snapkv", "tova"):
        manager = RetentionManager(make_retention(name, 128, P))
        weights = manager.score_weights("s", np.arange(200, dtype=np.int32), 200)
        last = manager.policy.scored_queries
        assert last is not None and np.any(weights[-last:]) and not np.any(weights[:-last])

    class Broken(type(make_retention("snapkv", 128, P))):
        def score_weights(self, view, positions, num_tokens):
            return np.ones(len(positions), np.float32)

    manager = RetentionManager(Broken(128, P))
    with pytest.raises(RuntimeError, match=r"before the row's last 64 .* for 'seq-7'"):
        manager.score_weights("seq-7", np.arange(200, dtype=np.int32), 200)


# ----------------------------------------------------------------------------- quest


def test_quest_bounds_dominate_every_key_logit_and_are_tight_for_one_key():
    rng = np.random.default_rng(1)
    b, w, n, k_heads, d = 2, 6, 4, 2, 8
    keys = rng.normal(size=(b, w, P, k_heads, d)).astype(np.float32)
    q = rng.normal(size=(b, n, d)).astype(np.float32)
    bounds = np.asarray(quest.page_bounds(jnp.asarray(q), jnp.asarray(keys.min(axis=2)),
                                          jnp.asarray(keys.max(axis=2))))  # [B, W, N]
    g = n // k_heads
    logits = np.einsum("bnd,bwpnd->bwpn", q, np.repeat(keys, g, axis=3))  # [B, W, P, N]
    assert np.all(bounds[:, :, None, :] >= logits - 1e-5)
    one = np.asarray(quest.page_bounds(jnp.asarray(q), jnp.asarray(keys[:, :, 0]),
                                       jnp.asarray(keys[:, :, 0])))
    np.testing.assert_allclose(one, logits[:, :, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_quest_select_pages_matches_sorting(seed):
    rng = np.random.default_rng(seed)
    b, w, num_read = 4, 8, 3
    scores = rng.normal(size=(b, w)).astype(np.float32)
    kv_lens = np.array([1, 9, 12, 29], np.int32)
    idx, lens = quest.select_pages(jnp.asarray(scores), jnp.asarray(kv_lens), P, num_read)
    idx, lens = np.asarray(idx), np.asarray(lens)
    for i in range(b):
        num_valid = -(-kv_lens[i] // P)
        last = num_valid - 1
        others = sorted(range(last), key=lambda j: -scores[i, j])
        want = sorted([last] + others[:num_read - 1])
        assert idx[i, :len(want)].tolist() == want
        kept_tokens = sum(min(P, kv_lens[i] - j * P) for j in want)
        assert lens[i] == kept_tokens


def test_quest_summaries_track_written_keys_across_chunks_and_recycled_pages():
    rng = np.random.default_rng(2)
    num_layers, num_pages, k_heads, d = 2, 5, 2, 4
    base = PagedKV(k_pages=jnp.zeros((num_layers, num_pages, P, k_heads, d)),
                   v_pages=jnp.zeros((num_layers, num_pages, P, k_heads, d)))
    kv = quest.init_quest_kv(base)
    written: dict[tuple[int, int], list[np.ndarray]] = {}

    def write(layer, slots):
        nonlocal kv
        k = rng.normal(size=(len(slots), k_heads, d)).astype(np.float32) * 10
        kv = kv.write(jnp.int32(layer), jnp.asarray(slots, jnp.int32), jnp.asarray(k),
                      jnp.asarray(k))
        for slot, key in zip(slots, k, strict=True):
            if slot >= 0:
                page = slot // P
                if slot % P == 0:
                    written[layer, page] = []
                written[layer, page].append(key)

    page_3, page_1 = [3 * P + i for i in range(P)], [1 * P + i for i in range(P)]
    write(0, page_3[:3] + [-1])  # a partial page, one padded token
    write(0, page_3[3:] + page_1[:2])  # finishes page 3, starts page 1
    write(1, page_1)
    write(0, page_3[:2])  # page 3 recycled: its old keys must not survive
    for (layer, page), keys in written.items():
        np.testing.assert_array_equal(np.asarray(kv.key_min[layer, page]), np.min(keys, 0))
        np.testing.assert_array_equal(np.asarray(kv.key_max[layer, page]), np.max(keys, 0))
    copied = kv.copy_pages(jnp.array([3]), jnp.array([4]))
    np.testing.assert_array_equal(np.asarray(copied.key_min[:, 4]),
                                  np.asarray(copied.key_min[:, 3]))


def narrow_reference(keys, q, table, kv_len, num_read, layer, dense_layers, heads):
    """Numpy Quest selection of one decode row: (pages read in table order, tokens they hold).

    keys: [L, num_pages, P, K, D] written keys; q: [N, D]; table: [W] page ids.
    """
    num_valid = -(-kv_len // P)
    if layer < dense_layers or num_valid <= num_read:
        return list(table[:num_valid]), kv_len
    g = q.shape[0] // keys.shape[3]
    scores = []
    for j in range(num_valid - 1):  # the last page is always read
        page = keys[layer, table[j], :min(P, kv_len - j * P)]  # [n, K, D] written tokens
        lo, hi = page.min(axis=0), page.max(axis=0)  # [K, D]
        per_head = [np.sum(np.maximum(q[h] * lo[h // g], q[h] * hi[h // g]))
                    for h in range(q.shape[0])]
        scores.append(max(per_head) if heads == "max" else sum(per_head))
    best = sorted(range(num_valid - 1), key=lambda j: -scores[j])[:num_read - 1]
    chosen = sorted(best) + [num_valid - 1]
    tokens = sum(min(P, kv_len - j * P) for j in chosen)
    return [table[j] for j in chosen], tokens


@pytest.mark.parametrize("dense_layers,heads", [(0, "max"), (2, "max"), (1, "sum")])
def test_quest_narrowing_matches_numpy_and_reads_everything_in_dense_layers(dense_layers, heads):
    rng = np.random.default_rng(3)
    num_layers, num_pages, k_heads, n, d, w, num_read = 4, 24, 2, 4, 8, 6, 3
    keys = rng.normal(size=(num_layers, num_pages, P, k_heads, d)).astype(np.float32)
    kv = quest.init_quest_kv(PagedKV(k_pages=jnp.zeros(keys.shape),
                                     v_pages=jnp.zeros(keys.shape)))
    kv_lens = np.array([23, 9, 6, 17], np.int32)  # one row short enough to read everything
    tables = rng.permutation(num_pages)[:len(kv_lens) * w].reshape(len(kv_lens), w)
    slots = np.concatenate([tables[b, :-(-kv_lens[b] // P)][:, None] * P + np.arange(P)
                            for b in range(len(kv_lens))]).ravel()
    for layer in range(num_layers):
        kv = kv.write(jnp.int32(layer), jnp.asarray(slots, jnp.int32),
                      jnp.asarray(keys[layer].reshape(-1, k_heads, d)[slots]),
                      jnp.zeros((len(slots), k_heads, d)))
    q = rng.normal(size=(len(kv_lens), n, d)).astype(np.float32)

    @jax.jit
    def narrow(layer):
        return quest.narrow_decode_rows(kv, layer, jnp.asarray(q), jnp.asarray(tables, jnp.int32),
                                        jnp.asarray(kv_lens), num_read,
                                        num_dense_layers=dense_layers,
                                        head_reduction=quest.HeadReduction(heads))

    for layer in range(num_layers):
        got_tables, got_lens = map(np.asarray, narrow(jnp.int32(layer)))
        for b in range(len(kv_lens)):
            want_pages, want_len = narrow_reference(keys, q[b], tables[b], int(kv_lens[b]),
                                                    num_read, layer, dense_layers, heads)
            assert got_tables[b, :len(want_pages)].tolist() == want_pages, (layer, b)
            assert got_lens[b] == want_len, (layer, b)
        # The stored summaries still bound every written key's logit, in every layer.
        bounds = np.asarray(quest.page_bounds(jnp.asarray(q), kv.key_min[layer][tables],
                                              kv.key_max[layer][tables]))  # [B, W, N]
        g = n // k_heads
        page_keys = np.repeat(keys[layer][tables], g, axis=3)  # [B, W, P, N, D]
        logits = np.einsum("bnd,bwpnd->bwpn", q, page_keys)
        written = np.arange(w * P).reshape(w, P)[None] < kv_lens[:, None, None]  # [B, W, P]
        assert np.all(np.where(written[..., None], bounds[:, :, None] >= logits - 1e-5, True))


# ----------------------------------------------------------------------------- compaction


def apply_moves(content: np.ndarray, src, dst) -> np.ndarray:
    """The device move on a numpy slot array: every read before any write."""
    out = content.copy()
    out[np.asarray(dst, np.int64)] = content[np.asarray(src, np.int64)]
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_block_manager_retain_compacts_kept_tokens_and_frees_the_rest(data):
    num_pages = 24
    bm = BlockManager(num_pages, P)
    content = np.full(num_pages * P, -1, np.int64)  # slot -> token id written there
    prompt = list(range(100, 100 + data.draw(st.integers(6, 28))))
    other = prompt[:data.draw(st.integers(1, len(prompt)))] + [7, 8, 9]

    def prefill(seq_id, tokens):
        cached = bm.add_sequence(seq_id, tokens)
        status, copies = bm.ensure_writable(seq_id, cached, len(tokens))
        assert status is AllocStatus.OK and not copies
        table = bm.block_table(seq_id)
        for pos in range(cached, len(tokens)):
            content[table[pos // P] * P + pos % P] = tokens[pos]
        bm.commit(seq_id, tokens)

    prefill("a", prompt)
    if data.draw(st.booleans()):
        bm.fork("a", "fork")
    prefill("b", other)  # may share a's indexed prompt pages
    before = {s: [content[bm.block_table(s)[i // P] * P + i % P] for i in range(len(t))]
              for s, t in (("b", other),)}
    size = len(prompt)
    keep = sorted(data.draw(st.sets(st.integers(0, size - 1), min_size=1, max_size=size)))
    old_table = bm.block_table("a")
    status, src, dst, freed = bm.retain("a", keep)
    assert status is AllocStatus.OK
    content = apply_moves(content, src, dst)
    table = bm.block_table("a")
    assert len(table) == -(-len(keep) // P)
    got = [content[table[i // P] * P + i % P] for i in range(len(keep))]
    assert got == [prompt[k] for k in keep]
    # Other sequences and the prefix cache see their tokens unchanged.
    assert [content[bm.block_table("b")[i // P] * P + i % P] for i in range(len(other))] == \
        before["b"]
    if bm.has_sequence("fork"):
        fork_table = bm.block_table("fork")
        assert [content[fork_table[i // P] * P + i % P] for i in range(size)] == prompt
    written_pages = {d // P for d in np.asarray(dst).tolist()}
    for page in written_pages:
        assert bm.ref_count(page) == 1 and not bm.prefix_cache.is_indexed(page)
    for page in freed:
        assert page in old_table and page not in table and bm.ref_count(page) == 0
    assert bm.peek_cached_tokens(prompt) <= (len(prompt) - 1) // P * P
    bm.commit("a", prompt + [1, 2, 3])  # a compacted sequence indexes nothing more
    for seq_id in ("a", "b", "fork"):
        if bm.has_sequence(seq_id):
            bm.free(seq_id)
    assert bm.num_used_pages() == 0
    assert bm.num_free_pages() == num_pages


def test_retain_rejects_bad_keep_lists():
    bm = BlockManager(8, P)
    bm.add_sequence("a", list(range(10)))
    bm.ensure_writable("a", 0, 10)
    for keep in ([], [3, 3], [5, 2], [10], [-1, 2]):
        with pytest.raises(ValueError, match="keep"):
            bm.retain("a", keep)


def test_move_slots_reads_before_writing():
    x = jnp.arange(2 * 3 * P * 1 * 1, dtype=jnp.float32).reshape(2, 3, P, 1, 1)
    kv = PagedKV(k_pages=x, v_pages=-x)
    src, dst = np.array([5, 0, 9]), np.array([0, 5, 1])  # a swap and a chain
    moved = move_slots(kv, jnp.asarray(src), jnp.asarray(dst))
    for layer in range(2):
        flat = np.asarray(x[layer]).reshape(-1)
        want = apply_moves(flat, src, dst)
        np.testing.assert_array_equal(np.asarray(moved.k_pages[layer]).reshape(-1), want)
        np.testing.assert_array_equal(np.asarray(moved.v_pages[layer]).reshape(-1), -want)
    assert jax.tree.structure(moved) == jax.tree.structure(kv)


@pytest.mark.parametrize("name,options", [
    ("streaming", dict(num_sinks=2)), ("h2o", dict(num_recent=3)), ("tova", {}),
    ("snapkv", dict(window=3, kernel=3)), ("knorm", {}), ("observed_attention", {})])
@settings(max_examples=30, deadline=None)
@given(cached=st.integers(1, 30), budget=st.integers(8, 14), is_prefill_done=st.booleans(),
       seed=st.integers(0, 2**16))
def test_max_undecided_tokens_is_where_token_by_token_decoding_first_decides(
        name, options, cached, budget, is_prefill_done, seed):
    """Brute force: decode tokens one at a time, asking the policy after each; the first one
    after which it would keep less than everything is `max_undecided_tokens` (None: never
    within a horizon longer than any budget). A policy that compresses once, at the end of
    prefill, settles that decision after the next token whether it compresses or not (the
    manager records it), so it allows one token while the decision is pending."""
    from kvjax.kv.retention import CacheView, make_retention

    policy = make_retention(name, budget, 4, **options)
    rng = np.random.default_rng(seed)
    view = CacheView(np.arange(cached, dtype=np.int32), rng.random(cached).astype(np.float32),
                     is_prefill_done=is_prefill_done)
    limit = policy.max_undecided_tokens(view)
    first = None
    for n in range(1, 4 * budget):
        grown = CacheView(np.arange(cached + n, dtype=np.int32),
                          np.concatenate([view.scores, rng.random(n).astype(np.float32)]),
                          is_prefill_done=is_prefill_done)
        if policy.select(grown, is_prefill_done=True) is not None:
            first = n
            break
    if name in ("snapkv", "knorm", "observed_attention") and not is_prefill_done:
        assert limit == 1
    else:
        assert limit == first
