"""The scoring presses against numpy references: given K, Q (and V), the kept set is theirs.

Each case scores one layer of random paged K/V (unused pages NaN, permuted block tables) with the
press's device function, as the engine's step does, and the press's host `select` picks from
those scores; tests/presses_reference.py computes the same scores with loops and explicit
rotation matrices in float64.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from presses_reference import expected_attention, keep, knorm, observed, probe_attention, tova

from kvjax.kv.attention import pages_loader
from kvjax.kv.presses import (
    expected_attention_blockwise,
    key_norm_scores_blockwise,
    max_attention_blockwise,
    pyramid_budgets,
)
from kvjax.kv.retention import (
    CacheView,
    RetentionManager,
    key_scores_blockwise,
    make_retention,
)
from kvjax.kv.retention_host import EVERY_KEY
from kvjax.models.rope import RoPE

P = 4
N, K_HEADS, D = 4, 2, 8
WIDTH = 8  # pages per block table
ROPE = RoPE(theta=100.0)  # low base: angles that turn visibly within a few dozen positions
INV_FREQ = 1.0 / ROPE.theta ** (np.arange(0, D, 2) / D)


def rotate_reference(x: np.ndarray) -> np.ndarray:
    """x [S, heads, D] with RoPE applied at positions 0..S-1 (rotate-half pairs)."""
    angles = np.arange(len(x))[:, None] * INV_FREQ  # [S, D/2]
    c, s = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@pytest.fixture(scope="module")
def case():
    """Two sequences (23 and 14 tokens) of paged keys and values and all their queries."""
    rng = np.random.default_rng(0)
    lens = np.array([23, 14], np.int32)
    num_pages = 24
    k_pages = np.full((num_pages, P, K_HEADS, D), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    tables = rng.permutation(num_pages)[:2 * WIDTH].reshape(2, WIDTH).astype(np.int32)
    seqs = []
    for b, n in enumerate(lens):
        # A shared direction gives the queries a mean worth modelling.
        q = rotate_reference(rng.normal(size=(n, N, D)) + rng.normal(size=(1, N, D)))
        k = rotate_reference(rng.normal(size=(n, K_HEADS, D)) * rng.uniform(0.5, 2, (n, 1, 1)))
        v = rng.normal(size=(n, K_HEADS, D)) * rng.uniform(0.2, 3, (n, 1, 1))
        for i in range(n):
            k_pages[tables[b, i // P], i % P] = k[i]
            v_pages[tables[b, i // P], i % P] = v[i]
        seqs.append((q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)))
    return dict(lens=lens, tables=tables, seqs=seqs,
                load=pages_loader(jnp.asarray(k_pages), jnp.asarray(v_pages)))


def batch_queries(case, num_last: int | None = None):
    """Each sequence's last `num_last` queries (all when None), padded to one width: q [B, C, N,
    D], positions [B, C], q_lens [B]."""
    lens = case["lens"]
    counts = lens if num_last is None else np.minimum(lens, num_last)
    c = int(counts.max())
    q = np.zeros((2, c, N, D), np.float32)
    pos = np.zeros((2, c), np.int32)
    for b, (n, m) in enumerate(zip(lens, counts, strict=True)):
        q[b, :m] = case["seqs"][b][0][n - m:]
        pos[b, :m] = np.arange(n - m, n)
    return q, pos, counts.astype(np.int32)


def view_of(scores) -> CacheView:
    return CacheView(np.arange(len(scores), dtype=np.int32), np.asarray(scores, np.float32))


def kept(policy_name, budget, scores, **options):
    policy = make_retention(policy_name, budget, P, **options)
    got = policy.select(view_of(scores), is_prefill_done=True)
    return None if got is None else got.tolist()


def test_knorm_keeps_the_lowest_key_norms(case):
    got = np.asarray(key_norm_scores_blockwise(
        case["load"], jnp.asarray(case["tables"]), jnp.asarray(case["lens"]),
        jnp.array([True, True]), pages_per_block=2))
    for b, n in enumerate(case["lens"]):
        want = knorm(case["seqs"][b][1])
        np.testing.assert_allclose(got[b, :n], want, rtol=1e-5)
        assert not got[b, n:].any()
        assert kept("knorm", 9, got[b, :n]) == keep(want, 9)
    unscored = key_norm_scores_blockwise(case["load"], jnp.asarray(case["tables"]),
                                         jnp.asarray(case["lens"]), jnp.array([True, False]),
                                         pages_per_block=2)
    assert not np.asarray(unscored)[1].any()


def test_tova_keeps_the_newest_and_what_the_newest_query_attends_to(case):
    q, _, q_lens = batch_queries(case, num_last=1)
    got = np.asarray(key_scores_blockwise(
        jnp.asarray(q), case["load"], jnp.asarray(case["tables"]), jnp.asarray(case["lens"]),
        jnp.asarray(q_lens), jnp.ones((2, 1), jnp.float32), pages_per_block=2))
    for b, n in enumerate(case["lens"]):
        want = tova(case["seqs"][b][0][n - 1], case["seqs"][b][1])
        np.testing.assert_allclose(got[b, :n], want, rtol=1e-4, atol=1e-6)
        budget = int(n) - P  # the cache is at budget + P: TOVA evicts down to the budget
        assert kept("tova", budget, got[b, :n]) == keep(want, budget, last=1)
    assert kept("tova", 20, got[0, :23]) is None, "under budget + P nothing is evicted"


def test_observed_attention_keeps_the_largest_mean_prefill_attention(case):
    q, _, q_lens = batch_queries(case)
    got = np.asarray(key_scores_blockwise(
        jnp.asarray(q), case["load"], jnp.asarray(case["tables"]), jnp.asarray(case["lens"]),
        jnp.asarray(q_lens), jnp.ones(q.shape[:2], jnp.float32), pages_per_block=2))
    for b, n in enumerate(case["lens"]):
        want = observed(case["seqs"][b][0], case["seqs"][b][1])
        policy = make_retention("observed_attention", 7, P)
        scores = policy.token_scores(view_of(got[b, :n]))
        np.testing.assert_allclose(scores, want, rtol=1e-4, atol=1e-7)
        assert kept("observed_attention", 7, got[b, :n]) == keep(want, 7)


@pytest.mark.parametrize("covariance,vnorm", [(True, True), (False, False)])
def test_expected_attention_keeps_sinks_and_the_largest_expected_attention(case, covariance,
                                                                           vnorm):
    sinks, future = 2, 16
    q, pos, q_lens = batch_queries(case)
    weights = ((pos >= sinks) & (np.arange(q.shape[1])[None] < q_lens[:, None]))
    got = np.asarray(expected_attention_blockwise(
        jnp.asarray(q), jnp.asarray(pos), case["load"], jnp.asarray(case["tables"]),
        jnp.asarray(case["lens"]), jnp.asarray(q_lens), jnp.asarray(weights, jnp.float32), ROPE,
        num_future=future, num_sinks=sinks, covariance=covariance, vnorm=vnorm,
        pages_per_block=2))
    options = dict(num_sinks=sinks, num_future=future, covariance=covariance, vnorm=vnorm)
    for b, n in enumerate(case["lens"]):
        q_seq, k_seq, v_seq = case["seqs"][b]
        want = expected_attention(q_seq, k_seq, v_seq, INV_FREQ, num_future=future,
                                  num_sinks=sinks, covariance=covariance, vnorm=vnorm)
        np.testing.assert_allclose(got[b, :n], want, rtol=2e-4, atol=1e-7)
        assert not got[b, n:].any()
        assert kept("expected_attention", 8, got[b, :n], **options) == keep(want, 8, first=sinks)


@pytest.mark.parametrize("spans,sinks", [([(9, 13), EVERY_KEY], 2), ([(0, 4), (2, 8)], 3),
                                         ([EVERY_KEY, EVERY_KEY], 0)])
def test_kvzip_scores_the_span_by_a_softmax_over_sinks_span_and_probe(case, spans, sinks):
    """Each row's last 6 / 5 tokens are its probe: its queries score the span's keys, the
    softmax over the sinks, the span and the probe's own keys (KVzip's cross-attention), or
    every key (EVERY_KEY); blocks of 8 keys, tiles of 4 queries."""
    q_lens = np.array([6, 5], np.int32)
    q = np.zeros((2, 6, N, D), np.float32)
    for b, (n, m) in enumerate(zip(case["lens"], q_lens, strict=True)):
        q[b, :m] = case["seqs"][b][0][n - m:]
    got = np.asarray(max_attention_blockwise(
        jnp.asarray(q), case["load"], jnp.asarray(case["tables"]), jnp.asarray(case["lens"]),
        jnp.asarray(q_lens), jnp.ones(q.shape[:2], jnp.float32), jnp.asarray(spans),
        num_sinks=sinks, pages_per_block=2, query_tile=4))
    for b, (n, m) in enumerate(zip(case["lens"], q_lens, strict=True)):
        context = int(n - m)
        span = None if tuple(spans[b]) == EVERY_KEY else spans[b]
        want = probe_attention(case["seqs"][b][0], case["seqs"][b][1], context, span, sinks)
        np.testing.assert_allclose(got[b, :context], want, rtol=1e-4, atol=1e-7)
        assert not got[b, context:].any(), "only the context's keys score"
    # The softmax over fewer keys gives the span's keys more than over all.
    if sinks == 2:
        context = int(case["lens"][0] - q_lens[0])
        every = probe_attention(case["seqs"][0][0], case["seqs"][0][1], context)
        assert (got[0, 9:13] > every[9:13]).all()


def test_tova_scores_replace_and_observed_scores_accumulate():
    tova_manager = RetentionManager(make_retention("tova", 8, P))
    observed_manager = RetentionManager(make_retention("observed_attention", 8, P))
    for manager in (tova_manager, observed_manager):
        manager.observe("s", 0, 3, np.array([1.0, 2.0, 3.0, 0.0]))
        manager.observe("s", 3, 1, np.array([0.5, 0.5, 0.5, 0.5]))
    assert tova_manager.record("s")["scores"] == [0.5] * 4
    assert observed_manager.record("s")["scores"] == [1.5, 2.5, 3.5, 0.5]


def test_tova_scores_only_the_steps_after_which_it_evicts():
    """TOVA reads the newest query's scores only when it evicts (each step's replace the
    last), so it weights a query on exactly those steps and the others skip the scoring:
    prefill chunks and decode steps, a controller's lower budget applying from the next step."""
    manager = RetentionManager(make_retention("tova", 20, P))
    rng = np.random.default_rng(0)
    start, evictions = 0, 0
    for step, num_new in enumerate([24, 9] + [1] * 40):
        if step == 20:
            manager.set_budget("s", 12)
        positions = np.arange(start, start + num_new, dtype=np.int32)
        # A speculative verify row of one query weights it as the decode step would.
        verify = manager.verify_score_weights("s", positions) if num_new == 1 else None
        weights = manager.score_weights("s", positions, start + num_new)
        if verify is not None:
            np.testing.assert_array_equal(verify, weights)
        cached = len(manager.cached_positions("s")) if step else 0
        manager.observe("s", start, num_new, rng.random(cached + num_new).astype(np.float32))
        keep = manager.select("s", is_prefill_done=True)
        assert weights.any() == (keep is not None), step
        assert not weights[:-1].any()
        if keep is not None:  # the eviction, as the engine records it
            evictions += 1
            view = manager._views["s"]
            view.positions, view.scores = view.positions[keep], view.scores[keep]
            view.num_evicted += cached + num_new - len(keep)
        start += num_new
    assert evictions >= 4 and len(manager.cached_positions("s")) < 12 + P


def test_presses_validate_budgets_and_options():
    assert make_retention("expected_attention", 5, P).min_budget == 5  # 4 sinks + 1
    for name, budget, options, match in [
            ("tova", 0, {}, "tova.*>= 1"), ("knorm", None, {}, "knorm.*>= 1"),
            ("expected_attention", 4, {}, ">= 5"),
            ("expected_attention", 8, dict(num_future=0), "num_future"),
            ("expected_attention", 8, dict(covariance="yes"), "covariance"),
            ("observed_attention", 8, dict(window=2), "no option")]:
        with pytest.raises(ValueError, match=match):
            make_retention(name, budget, P, **options)
    with pytest.raises(ValueError, match="needs rope"):
        RetentionManager(make_retention("expected_attention", 8, P))


@pytest.mark.parametrize("layers,budget,tokens,window,beta", [
    (30, 512, 2048, 64, 20), (2, 10, 40, 2, 4), (7, 100, 130, 8, 20), (5, 64, 4096, 0, 1)])
def test_pyramid_budgets_fall_linearly_and_keep_the_uniform_total(layers, budget, tokens,
                                                                  window, beta):
    got = pyramid_budgets(layers, budget, tokens, window=window, beta=beta)
    assert got.sum() == layers * budget
    assert np.all(np.diff(got) <= 0) and got.max() <= tokens and got.min() >= window
    share = budget - window
    # The paper's real-valued schedule: last layer share / beta, linear up to the first; the
    # integer budgets are within one token of it wherever no layer is capped at the prompt.
    want = window + 2 * share - share / beta - np.arange(layers) * (
        2 * share - 2 * share / beta) / max(layers - 1, 1)
    if want.max() <= tokens:
        assert np.all(np.abs(got - want) < 1.0)
    if beta == 1:
        assert np.all(got == budget)


def test_pyramid_budgets_are_uniform_when_nothing_is_dropped_and_reject_bad_options():
    assert pyramid_budgets(4, 64, 50).tolist() == [50] * 4
    assert pyramid_budgets(4, 32, 500, window=64).tolist() == [32] * 4
    with pytest.raises(ValueError, match="beta"):
        pyramid_budgets(4, 128, 500, beta=0.5)
    with pytest.raises(ValueError, match="num_layers"):
        pyramid_budgets(0, 128, 500)
