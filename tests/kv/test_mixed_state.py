"""MixedPrecisionKV against numpy: each row reads back its value quantized at its class.

Sequences write ragged steps into randomly permuted pages; some pages are then demoted in place
(keys and values apart, sometimes twice, sometimes to a finer class, which changes nothing).
The oracle keeps, per token, the float value a reader must see: the token's value, rounded by a
numpy int8 / int4 quantizer each time its class gets coarser. Attention over the pool must
equal numpy dense causal attention over those values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import ModelConfig
from kvjax.kv import mixed, spec
from kvjax.kv.attention import paged_attention_blockwise
from kvjax.kv.state import KVState
from kvjax.testing import permuted_block_tables

CONFIG = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, name="mixed-state-test")
L, K, D, N = CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, CONFIG.num_heads
PAGE_SIZE, NUM_PAGES, GROUP = 4, 16, 8
LENGTHS = (13, 6, 9)


def _int8_numpy(x):
    scale = np.abs(x).max(-1, keepdims=True) / np.float32(127.0)
    codes = np.clip(np.round(x / np.where(scale > 0, scale, 1)), -127, 127)
    return (codes * scale).astype(np.float32)


def _int4_numpy(x):
    """The int4 round trip, and where a code sits on a rounding tie (int8 values rounded
    again land on ties often), the step by which the device may round the other way."""
    g = x.reshape(*x.shape[:-1], -1, GROUP)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = hi / np.float32(15.0) - lo / np.float32(15.0)  # the codec's order of operations
    t = (g - lo) / np.where(scale > 0, scale, 1)
    codes = np.clip(np.round(t), 0, 15)
    tie = np.abs(t - np.floor(t) - 0.5) < 1e-3
    return ((lo + codes * scale).reshape(x.shape).astype(np.float32),
            (tie * scale).reshape(x.shape))


def _round_to(x, bits, slack=None):
    """x rounded at class `bits`, and the slack (`_int4_numpy`) added to `slack`."""
    slack = np.zeros_like(x) if slack is None else slack
    if bits == 4:
        x, tie = _int4_numpy(x)
        return x, slack + tie
    return (_int8_numpy(x) if bits == 8 else x), slack


@jax.jit
def _write(kv, layer, slots, k, v):
    return kv.write(layer, slots, k, v)


@jax.jit
def _demote(kv, pages, k_bits, v_bits):
    return kv.demote(pages, k_bits, v_bits)


def _attend(kv, layer, q, tables, lens):
    return jax.jit(lambda kv, q, t, n: paged_attention_blockwise(
        q, lambda p: kv.load_pages(layer, p), t, n, jnp.ones_like(n), pages_per_block=2))(
        kv, q, tables, lens)


def _numpy_attention(q, k, v):
    """q [N, D] of the last position, k, v [S, K, D] -> [N, D]."""
    kk, vv = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # [S, N, D]
    s = np.einsum("nd,snd->ns", q, kk) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("ns,snd->nd", p / p.sum(-1, keepdims=True), vv)


def _run(write_bits, demotions, seed=0):
    rng = np.random.default_rng(seed)
    kv = mixed.init_mixed_kv(CONFIG, NUM_PAGES, PAGE_SIZE, group=GROUP, write_bits=write_bits)
    assert isinstance(kv, KVState)
    tables = permuted_block_tables(rng, LENGTHS, PAGE_SIZE, NUM_PAGES)
    width = tables.shape[1]
    # The float each token must read back, per layer: [L, seq, S, K, D], and its classes.
    k_ref = rng.normal(size=(L, len(LENGTHS), max(LENGTHS), K, D)).astype(np.float32) * 3
    v_ref = rng.normal(size=k_ref.shape).astype(np.float32)
    (k_ref, k_slack), (v_ref, v_slack) = (_round_to(k_ref, write_bits[0]),
                                          _round_to(v_ref, write_bits[1]))
    for layer in range(L):
        for i, n in enumerate(LENGTHS):
            done = 0
            while done < n:  # ragged chunks, padded with NaN tokens that write nothing
                c = min(int(rng.integers(1, 6)), n - done)
                pos = np.arange(done, done + c)
                slots = np.concatenate([tables[i, pos // PAGE_SIZE] * PAGE_SIZE
                                        + pos % PAGE_SIZE, [-1, -1]]).astype(np.int32)
                raw_k = np.concatenate([k_ref[layer, i, done:done + c], np.full((2, K, D),
                                                                                np.nan)])
                raw_v = np.concatenate([v_ref[layer, i, done:done + c], np.full((2, K, D),
                                                                                np.nan)])
                kv = _write(kv, jnp.int32(layer), slots, raw_k.astype(np.float32),
                            raw_v.astype(np.float32))
                done += c
    page_of = {int(p): (i, j) for i in range(len(LENGTHS)) for j, p in enumerate(tables[i])
               if j < -(-LENGTHS[i] // PAGE_SIZE)}
    k_class = np.full((len(LENGTHS), width), write_bits[0])
    v_class = np.full((len(LENGTHS), width), write_bits[1])
    for entries, kb, vb in demotions:  # (sequence, page of its table) pairs
        pages = [int(tables[i, j]) for i, j in entries]
        kv = _demote(kv, np.asarray(pages, np.int32), jnp.int32(kb), jnp.int32(vb))
        for p in dict.fromkeys(pages):
            i, j = page_of[p]
            rows = slice(j * PAGE_SIZE, (j + 1) * PAGE_SIZE)
            for cls, target, ref, slack in ((k_class, kb, k_ref, k_slack),
                                            (v_class, vb, v_ref, v_slack)):
                if spec.coarseness(target) > spec.coarseness(int(cls[i, j])):
                    cls[i, j] = target
                    ref[:, i, rows], slack[:, i, rows] = _round_to(
                        ref[:, i, rows], target, slack[:, i, rows])
    return kv, tables, (k_ref, k_slack), (v_ref, v_slack), k_class, v_class


DEMOTIONS = [([(0, 0), (1, 1), (1, 1), (1, 1)], 8, 4), ([(2, 0), (0, 0)], 4, 4),
             ([(0, 3)], 8, 8), ([(2, 0), (2, 2)], 8, 0)]


@pytest.mark.parametrize("write_bits", [(0, 0), (8, 4)])
def test_attention_over_a_mixed_pool_equals_numpy_over_per_class_roundtrips(write_bits):
    kv, tables, (k_ref, k_slack), (v_ref, v_slack), k_class, v_class = _run(write_bits,
                                                                           DEMOTIONS)
    # Every row reads back its per-class round trip; ties (the only latitude) are rare.
    assert (k_slack > 0).mean() < 0.05 and (v_slack > 0).mean() < 0.05
    rng = np.random.default_rng(1)
    lens = np.asarray(LENGTHS, np.int32)
    num_checked = 0
    for layer in range(L):
        # Rows and classes as stored.
        k, v = jax.jit(kv.load_pages, static_argnums=())(jnp.int32(layer), tables)
        bits = np.asarray(kv.k_bits[layer])[tables]  # [B, W, P]
        for i, n in enumerate(LENGTHS):
            got_k = np.asarray(k[i]).reshape(-1, K, D)[:n]
            got_v = np.asarray(v[i]).reshape(-1, K, D)[:n]
            for got, ref, slack in ((got_k, k_ref, k_slack), (got_v, v_ref, v_slack)):
                err = np.abs(got - ref[layer, i, :n])
                assert (err <= 1e-5 + 1e-5 * np.abs(ref[layer, i, :n])
                        + 1.001 * slack[layer, i, :n]).all(), err.max()
            m = -(-n // PAGE_SIZE)
            assert (bits[i, :m] == k_class[i, :m, None]).reshape(-1)[:n].all()
        q = rng.normal(size=(len(LENGTHS), 1, N, D)).astype(np.float32)
        out = np.asarray(_attend(kv, layer, q, tables, lens))
        for i, n in enumerate(LENGTHS):
            # Attention over what the pool stores equals numpy attention over those rows...
            got_k = np.asarray(k[i]).reshape(-1, K, D)[:n]
            got_v = np.asarray(v[i]).reshape(-1, K, D)[:n]
            want = _numpy_attention(q[i, 0], got_k, got_v)
            np.testing.assert_allclose(out[i, 0], want, rtol=2e-5, atol=2e-5)
            # ... which are the per-class round trips, up to the rare ties.
            no_ties = not (k_slack[layer, i, :n].any() or v_slack[layer, i, :n].any())
            if no_ties:
                num_checked += 1
                want = _numpy_attention(q[i, 0], k_ref[layer, i, :n], v_ref[layer, i, :n])
                np.testing.assert_allclose(out[i, 0], want, rtol=2e-5, atol=2e-5)
    assert num_checked >= L
    # Demotion happened: some keys are coarser than they were written.
    assert (k_class != write_bits[0]).any()


def test_spec_counts_bytes_per_class_and_demote_compiles_once():
    pool = mixed.cache_spec(CONFIG, PAGE_SIZE, group=GROUP)
    exact = 2 * K * D * 4 + 2  # K and V float32, plus one class byte each
    k8v4 = K * (D + 4) + K * (D // 2 + 2 * 4 * D // GROUP) + 2
    assert pool.bytes_per_token == L * exact
    assert pool.page_bytes_at(0, 0) == L * PAGE_SIZE * exact
    assert pool.page_bytes_at(8, 4) == L * PAGE_SIZE * k8v4
    with pytest.raises(ValueError, match="k2v0"):
        pool.page_bytes_at(2, 0)
    kv = mixed.init_mixed_kv(CONFIG, NUM_PAGES, PAGE_SIZE, group=GROUP)
    demote = jax.jit(lambda kv, p, kb, vb: kv.demote(p, kb, vb))
    for kb, vb in ((8, 4), (4, 4), (0, 8)):
        kv = demote(kv, np.asarray([1, 2], np.int32), jnp.int32(kb), jnp.int32(vb))
    assert demote._cache_size() == 1  # the class is data, not shape
    with pytest.raises(ValueError, match="bits=3"):
        mixed.init_mixed_kv(CONFIG, NUM_PAGES, PAGE_SIZE, write_bits=(3, 0))


def test_importance_classes_keep_the_most_important_pages_finest():
    """DiffKV within one sequence, a page at a time: pages ranked by their most important
    token under -||k|| (KNorm's importance) keep exact, int8 or int4 keys and values, applied
    as one `demote` per class (as the ledger's ops are); every row of a page shares its class
    and reads back its own class's round trip."""
    rng = np.random.default_rng(2)
    n, pages = 11, np.asarray([5, 2, 9], np.int32)  # the last page holds 3 tokens
    slots = (pages[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(-1)[:n].astype(np.int32)
    k = rng.normal(size=(L, n, K, D)).astype(np.float32) * rng.uniform(0.5, 3, (1, n, 1, 1))
    v = rng.normal(size=(L, n, K, D)).astype(np.float32)
    kv = mixed.init_mixed_kv(CONFIG, NUM_PAGES, PAGE_SIZE, group=GROUP)
    for layer in range(L):
        kv = _write(kv, jnp.int32(layer), slots, k[layer], v[layer])
    scores = -np.linalg.norm(k, axis=-1).sum(axis=(0, 2))  # [S]
    page_bits = np.asarray(mixed.importance_bits(jnp.asarray(scores), PAGE_SIZE, 1, 1))
    best = [scores[i * PAGE_SIZE:(i + 1) * PAGE_SIZE].max() for i in range(len(pages))]
    assert list(page_bits[np.argsort(best)[::-1]]) == [0, 8, 4]
    for bits in (8, 4):
        kv = _demote(kv, jnp.asarray(pages[page_bits == bits]), jnp.int32(bits),
                     jnp.int32(bits))
    bits = np.repeat(page_bits, PAGE_SIZE)[:n]
    got_k, got_v = kv.load_pages(jnp.int32(1), jnp.asarray(pages[None]))
    for got, x in ((got_k, k[1]), (got_v, v[1])):
        got = np.asarray(got).reshape(-1, K, D)[:n]
        for t in range(n):
            want, slack = _round_to(x[t], int(bits[t]))
            assert (np.abs(got[t] - want) <= 1e-5 + 1e-5 * np.abs(want) + slack).all()
    np.testing.assert_array_equal(np.asarray(kv.k_bits[:, pages]),
                                  np.broadcast_to(page_bits[None, :, None], (L, 3, PAGE_SIZE)))
