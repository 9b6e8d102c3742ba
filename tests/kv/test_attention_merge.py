"""Exact merging of attention partials over disjoint key sets, against a dense numpy softmax."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.kv import attention

SETTINGS = dict(max_examples=25, deadline=None, database=None,
                suppress_health_check=list(hypothesis.HealthCheck))


def dense_numpy(q, k, v, soft_cap):
    """q [N, D], k, v [S, K, D] -> (out [N, D], lse [N]) in float64: the oracle."""
    n, d = q.shape
    kk = np.repeat(k, n // k.shape[1], axis=1).astype(np.float64)  # [S, N, D]
    vv = np.repeat(v, n // k.shape[1], axis=1).astype(np.float64)
    logits = np.einsum("nd,snd->ns", q.astype(np.float64), kk) / np.sqrt(d)  # [N, S]
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    if logits.shape[1] == 0:
        return np.zeros((n, d)), np.full(n, -np.inf)
    m = logits.max(axis=1, keepdims=True)
    w = np.exp(logits - m)
    return (np.einsum("ns,snd->nd", w, vv) / w.sum(1, keepdims=True),
            (m[:, 0] + np.log(w.sum(1))))


def _case(data):
    kv_heads = data.draw(st.sampled_from([1, 2]), label="K")
    group = data.draw(st.sampled_from([1, 3]), label="G")
    d = 8
    s = data.draw(st.integers(1, 40), label="S")
    soft_cap = data.draw(st.sampled_from([None, 2.0]), label="soft_cap")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    q = rng.normal(size=(kv_heads * group, d)).astype(np.float32) * 2
    k = rng.normal(size=(s, kv_heads, d)).astype(np.float32) * 2
    v = rng.normal(size=(s, kv_heads, d)).astype(np.float32)
    return q, k, v, soft_cap, rng


_merge = jax.jit(attention.merge_partials)


@hypothesis.settings(**SETTINGS)
@hypothesis.given(data=st.data())
def test_merge_of_any_disjoint_split_equals_dense_softmax(data):
    q, k, v, soft_cap, rng = _case(data)
    num_parts = data.draw(st.integers(1, 4), label="parts")
    part_of_key = rng.integers(0, num_parts, size=k.shape[0])  # empty parts happen
    parts = [dense_numpy(q, k[part_of_key == i], v[part_of_key == i], soft_cap)
             for i in range(num_parts)]
    outs = np.stack([o for o, _ in parts]).astype(np.float32)  # [S, N, D]
    lses = np.stack([lse for _, lse in parts]).astype(np.float32)  # [S, N]
    out, lse = _merge(outs, lses)
    want, want_lse = dense_numpy(q, k, v, soft_cap)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-6, atol=2e-5)


PAGE, NUM_PAGES, MAX_PARTS = 4, 11, 4


@functools.partial(jax.jit, static_argnames="soft_cap")
def _merged_ranges(q, k_pages, v_pages, table, starts, ends, soft_cap):
    """Part i reads positions [starts[i], ends[i]) of the row's pages; the parts merged."""
    def part(lo, hi):
        out, lse = attention.paged_attention_blockwise(
            q[None, None], attention.pages_loader(k_pages, v_pages), table[None], hi[None],
            jnp.ones(1, jnp.int32), pages_per_block=2, soft_cap=soft_cap, kv_starts=lo[None],
            return_lse=True)
        return out[0, 0], lse[0, 0]

    outs, lses = jax.vmap(part)(starts, ends)  # [S, N, D], [S, N]
    return attention.merge_partials(outs, lses)


@hypothesis.settings(**SETTINGS)
@hypothesis.given(data=st.data())
def test_blockwise_partials_over_ranges_merge_to_dense(data):
    """What the step does: parts of one row's cache read by position range (kv_starts,
    kv_lens) of the same pages, each with its log-sum-exp, then merged."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    s = data.draw(st.integers(1, PAGE * (NUM_PAGES - 1)), label="S")
    soft_cap = data.draw(st.sampled_from([None, 2.0]), label="soft_cap")
    q = rng.normal(size=(6, 8)).astype(np.float32) * 2  # N = 6 over K = 2: GQA
    k = rng.normal(size=(s, 2, 8)).astype(np.float32) * 2
    v = rng.normal(size=(s, 2, 8)).astype(np.float32)
    perm = rng.permutation(NUM_PAGES)  # a shuffled block table; unused slots hold NaN
    k_pages = np.full((NUM_PAGES, PAGE, 2, 8), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    for pos in range(s):
        k_pages[perm[pos // PAGE], pos % PAGE] = k[pos]
        v_pages[perm[pos // PAGE], pos % PAGE] = v[pos]
    cuts = sorted(data.draw(st.lists(st.integers(0, s), min_size=MAX_PARTS - 1,
                                     max_size=MAX_PARTS - 1), label="cuts"))
    bounds = np.asarray([0, *cuts, s], np.int32)  # empty parts where cuts repeat
    out, lse = _merged_ranges(q, k_pages, v_pages, jnp.asarray(perm[:NUM_PAGES - 1], jnp.int32),
                              bounds[:-1], bounds[1:], soft_cap=soft_cap)
    want, want_lse = dense_numpy(q, k, v, soft_cap)  # the query sees all s keys
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-6, atol=2e-5)


def test_one_nonempty_part_passes_through_unchanged():
    rng = np.random.default_rng(0)
    out = jnp.asarray(rng.normal(size=(3, 6, 8)), jnp.float32)
    lse = jnp.asarray(rng.normal(size=(3, 6)), jnp.float32)
    merged, merged_lse = attention.merge_partials(
        jnp.stack([out, jnp.full_like(out, jnp.nan)]),
        jnp.stack([lse, jnp.full_like(lse, -jnp.inf)]))
    np.testing.assert_array_equal(np.asarray(merged), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(merged_lse), np.asarray(lse))


@functools.partial(jax.jit, static_argnames="soft_cap")
def _native_split(q, k_dev, v_dev, k_host, v_host, table, host_table, lens, host_lens,
                  soft_cap):
    from kvjax.engine import host_rows
    from kvjax.kv import native
    from kvjax.kv.state import PagedKV

    return host_rows.kernel_split(
        native.lse_decoder(soft_cap=soft_cap), PagedKV(k_pages=k_dev, v_pages=v_dev),
        PagedKV(k_pages=k_host, v_pages=v_host), 0, q, table, lens, host_table, host_lens, PAGE)


@hypothesis.settings(**{**SETTINGS, "max_examples": 15})
@hypothesis.given(data=st.data())
def test_native_kernel_split_between_pools_merges_to_dense(data):
    """Host-resident rows on the native CPU kernel: the first h pages of a row in a host pool,
    the rest in the device pool (each under a shuffled table, unused pages NaN), each part's
    attention and log-sum-exp from the kernel, merged: the dense softmax over every key."""
    from kvjax.kv import native

    if native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    lens = [data.draw(st.integers(0, PAGE * (NUM_PAGES - 1)), label=f"S{b}") for b in range(2)]
    host = [data.draw(st.integers(0, max(s - 1, 0) // PAGE), label=f"h{b}")
            for b, s in enumerate(lens)]  # full pages only; the written page stays
    soft_cap = data.draw(st.sampled_from([None, 2.0]), label="soft_cap")
    q = rng.normal(size=(2, 6, 8)).astype(np.float32) * 2  # N = 6 over K = 2: GQA
    pools = [np.full((1, 2 * NUM_PAGES, PAGE, 2, 8), np.nan, np.float32) for _ in range(4)]
    tables = np.zeros((2, NUM_PAGES), np.int32)
    host_tables = np.zeros((2, NUM_PAGES), np.int32)
    wants = []
    for b, (s, h) in enumerate(zip(lens, host, strict=True)):
        k = rng.normal(size=(s, 2, 8)).astype(np.float32) * 2
        v = rng.normal(size=(s, 2, 8)).astype(np.float32)
        tables[b] = rng.permutation(NUM_PAGES) + b * NUM_PAGES
        host_tables[b] = rng.permutation(NUM_PAGES) + b * NUM_PAGES
        for pos in range(s):
            in_host = pos < h * PAGE
            k_pool, v_pool = pools[2:] if in_host else pools[:2]
            page = (host_tables if in_host else tables)[b, pos // PAGE]
            k_pool[0, page, pos % PAGE], v_pool[0, page, pos % PAGE] = k[pos], v[pos]
        for pos in range(h * PAGE):  # the device table's host-resident entries hold NaN
            pools[0][0, tables[b, pos // PAGE]] = np.nan
        wants.append(dense_numpy(q[b], k, v, soft_cap)[0])
    out = _native_split(q, *pools, jnp.asarray(tables), jnp.asarray(host_tables),
                        jnp.asarray(lens, jnp.int32),
                        jnp.asarray([h * PAGE for h in host], jnp.int32), soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(out), np.stack(wants), rtol=2e-5, atol=2e-5)
