"""Reference attention against a per-token numpy oracle over ragged shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.kv import attention

F32_TOL = dict(atol=2e-5, rtol=2e-5)


def numpy_attention(q, k_seq, v_seq, q_pos, *, soft_cap=None, sliding_window=None):
    """One query [N, D] against one sequence's keys [S, K, D] up to q_pos, naively."""
    n, d = q.shape
    g = n // k_seq.shape[1]
    out = np.zeros((n, d))
    for h in range(n):
        lo = 0 if sliding_window is None else max(0, q_pos - sliding_window + 1)
        keys = k_seq[lo:q_pos + 1, h // g].astype(np.float64)
        vals = v_seq[lo:q_pos + 1, h // g].astype(np.float64)
        s = keys @ q[h].astype(np.float64) / np.sqrt(d)
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vals
    return out


def make_case(rng, *, num_seqs, page_size, num_kv_heads, group, head_dim, max_len):
    """Random pages (unused ones NaN), permuted block tables and ragged lengths."""
    kv_lens = rng.integers(1, max_len + 1, size=num_seqs)
    pages_per_seq = -(-max_len // page_size)
    num_pages = num_seqs * pages_per_seq + 3
    perm = rng.permutation(num_pages)
    tables = perm[:num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq).astype(np.int32)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pages = np.full(shape, np.nan, np.float32)
    v_pages = np.full(shape, np.nan, np.float32)
    seqs_k, seqs_v = [], []
    for b in range(num_seqs):
        ks = rng.standard_normal((kv_lens[b], num_kv_heads, head_dim)).astype(np.float32)
        vs = rng.standard_normal((kv_lens[b], num_kv_heads, head_dim)).astype(np.float32)
        for t in range(kv_lens[b]):
            k_pages[tables[b, t // page_size], t % page_size] = ks[t]
            v_pages[tables[b, t // page_size], t % page_size] = vs[t]
        seqs_k.append(ks)
        seqs_v.append(vs)
    return kv_lens.astype(np.int32), tables, k_pages, v_pages, seqs_k, seqs_v


CASES = [dict(page_size=p, num_kv_heads=k, group=g, head_dim=d)
         for p in (1, 4, 16) for k, g in ((1, 1), (2, 3), (3, 1)) for d in (8, 64)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_decode_matches_numpy(case):
    rng = np.random.default_rng(0)
    kv_lens, tables, kp, vp, ks, vs = make_case(rng, num_seqs=5, max_len=37, **case)
    n = case["num_kv_heads"] * case["group"]
    q = rng.standard_normal((5, n, case["head_dim"])).astype(np.float32)
    got = attention.paged_decode_attention_reference(q, kp, vp, tables, kv_lens)
    for b in range(5):
        want = numpy_attention(q[b], ks[b], vs[b], kv_lens[b] - 1)
        np.testing.assert_allclose(np.asarray(got[b]), want, **F32_TOL)


@pytest.mark.parametrize("case", CASES[::3], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
                         )
def test_prefill_and_ragged_match_numpy(case):
    rng = np.random.default_rng(1)
    kv_lens, tables, kp, vp, ks, vs = make_case(rng, num_seqs=4, max_len=29, **case)
    q_lens = np.minimum(rng.integers(1, 9, 4), kv_lens).astype(np.int32)
    n, d, chunk = case["num_kv_heads"] * case["group"], case["head_dim"], 8
    q = rng.standard_normal((4, chunk, n, d)).astype(np.float32)
    got = np.asarray(attention.paged_prefill_attention_reference(q, kp, vp, tables, kv_lens,
                                                                 q_lens))
    packed = np.concatenate([q[b, :q_lens[b]] for b in range(4)] + [q[0, :3]])  # 3 padding
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ragged = np.asarray(attention.ragged_paged_attention_reference(packed, kp, vp, tables,
                                                                   kv_lens, cu))
    for b in range(4):
        for c in range(chunk):
            if c >= q_lens[b]:
                np.testing.assert_array_equal(got[b, c], 0.0)  # padding queries give zeros
                continue
            want = numpy_attention(q[b, c], ks[b], vs[b], kv_lens[b] - q_lens[b] + c)
            np.testing.assert_allclose(got[b, c], want, **F32_TOL)
            np.testing.assert_allclose(ragged[cu[b] + c], want, **F32_TOL)
    np.testing.assert_array_equal(ragged[cu[-1]:], 0.0)


@pytest.mark.parametrize("soft_cap,window", [(5.0, None), (None, 6), (3.0, 4)])
def test_soft_cap_and_sliding_window(soft_cap, window):
    rng = np.random.default_rng(2)
    kv_lens, tables, kp, vp, ks, vs = make_case(rng, num_seqs=3, max_len=20, page_size=4,
                                                num_kv_heads=2, group=2, head_dim=8)
    q = 3 * rng.standard_normal((3, 4, 8)).astype(np.float32)
    got = attention.paged_decode_attention_reference(q, kp, vp, tables, kv_lens,
                                                     soft_cap=soft_cap, sliding_window=window)
    for b in range(3):
        want = numpy_attention(q[b], ks[b], vs[b], kv_lens[b] - 1, soft_cap=soft_cap,
                               sliding_window=window)
        np.testing.assert_allclose(np.asarray(got[b]), want, **F32_TOL)


def test_zero_length_rows_are_zero_not_nan():
    rng = np.random.default_rng(3)
    kv_lens, tables, kp, vp, _, _ = make_case(rng, num_seqs=2, max_len=8, page_size=4,
                                              num_kv_heads=1, group=2, head_dim=8)
    kv_lens[1] = 0
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)
    got = np.asarray(attention.paged_decode_attention_reference(q, kp, vp, tables, kv_lens))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[1], 0.0)


def test_bfloat16_inputs_use_float32_math():
    rng = np.random.default_rng(4)
    kv_lens, tables, kp, vp, ks, vs = make_case(rng, num_seqs=2, max_len=30, page_size=8,
                                                num_kv_heads=2, group=2, head_dim=64)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    got = attention.paged_decode_attention_reference(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(np.nan_to_num(kp), jnp.bfloat16),
        jnp.asarray(np.nan_to_num(vp), jnp.bfloat16), tables, kv_lens)
    assert got.dtype == jnp.bfloat16
    for b in range(2):
        want = numpy_attention(q[b], ks[b], vs[b], kv_lens[b] - 1)
        np.testing.assert_allclose(np.asarray(got[b], np.float32), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("case", CASES[::4], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
                         )
@pytest.mark.parametrize("pages_per_block", [1, 3, 8])
def test_blockwise_matches_prefill_reference(case, pages_per_block):
    """The engine's jnp fast path equals the oracle, whatever the block size."""
    rng = np.random.default_rng(5)
    kv_lens, tables, kp, vp, _, _ = make_case(rng, num_seqs=4, max_len=45, **case)
    kv_lens[2] = 0  # a padded row
    width = -(-tables.shape[1] // pages_per_block) * pages_per_block
    wide = np.zeros((4, width), np.int32)  # padding entries point at page 0: masked by length
    wide[:, :tables.shape[1]] = tables
    q_lens = np.minimum(rng.integers(1, 7, 4), kv_lens).astype(np.int32)
    n, d = case["num_kv_heads"] * case["group"], case["head_dim"]
    q = rng.standard_normal((4, 6, n, d)).astype(np.float32)
    want = attention.paged_prefill_attention_reference(q, kp, vp, tables, kv_lens, q_lens)
    got = attention.paged_attention_blockwise(q, attention.pages_loader(kp, vp), wide, kv_lens,
                                              q_lens, pages_per_block=pages_per_block)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)


def test_blockwise_pads_block_tables_to_a_whole_block():
    """Block tables narrower than a whole number of key blocks (the engine pads them to 8
    pages, prefill reads 16 at a time) give the oracle's output, query tiles included."""
    rng = np.random.default_rng(8)
    case = dict(page_size=4, num_kv_heads=2, group=2, head_dim=8)
    kv_lens, tables, kp, vp, _, _ = make_case(rng, num_seqs=3, max_len=41, **case)
    assert tables.shape[1] % 4
    q_lens = np.minimum([8, 5, 8], kv_lens).astype(np.int32)
    q = rng.standard_normal((3, 8, 4, 8)).astype(np.float32)
    want = attention.paged_prefill_attention_reference(q, kp, vp, tables, kv_lens, q_lens)
    got = attention.paged_attention_blockwise(q, attention.pages_loader(kp, vp), tables, kv_lens,
                                              q_lens, pages_per_block=4, query_tile=4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)


@pytest.mark.parametrize("query_tile", [4, 8])
def test_query_tiles_see_only_their_causal_blocks_and_match_the_reference(query_tile):
    """A chunk taken a tile of queries at a time (each walking only the blocks its queries
    see) equals the oracle: rows with ragged query counts, a padded row, queries of a tile all
    past q_len."""
    rng = np.random.default_rng(7)
    case = dict(page_size=4, num_kv_heads=2, group=3, head_dim=8)
    kv_lens, tables, kp, vp, _, _ = make_case(rng, num_seqs=4, max_len=45, **case)
    kv_lens[2] = 0  # a padded row
    q_lens = np.minimum([16, 9, 0, 3], kv_lens).astype(np.int32)
    width = -(-tables.shape[1] // 2) * 2
    wide = np.zeros((4, width), np.int32)
    wide[:, :tables.shape[1]] = tables
    q = rng.standard_normal((4, 16, 6, 8)).astype(np.float32)
    want = attention.paged_prefill_attention_reference(q, kp, vp, tables, kv_lens, q_lens)
    got = attention.paged_attention_blockwise(q, attention.pages_loader(kp, vp), wide, kv_lens,
                                              q_lens, pages_per_block=2, query_tile=query_tile)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)


@pytest.mark.parametrize("query_tile", [4, 16])
def test_blockwise_soft_cap_matches_numpy(query_tile):
    """Gemma 2's attention logit soft cap on the engine's jnp path, every query of ragged
    chunks (one query tile, and several) against the per-query numpy oracle."""
    rng = np.random.default_rng(11)
    case = dict(page_size=4, num_kv_heads=2, group=2, head_dim=8)
    kv_lens, tables, kp, vp, ks, vs = make_case(rng, num_seqs=3, max_len=40, **case)
    q_lens = np.minimum([16, 7, 1], kv_lens).astype(np.int32)
    width = -(-tables.shape[1] // 2) * 2
    wide = np.zeros((3, width), np.int32)
    wide[:, :tables.shape[1]] = tables
    q = 4 * rng.standard_normal((3, 16, 4, 8)).astype(np.float32)  # logits well past the cap
    got = np.asarray(attention.paged_attention_blockwise(
        q, attention.pages_loader(np.nan_to_num(kp), np.nan_to_num(vp)), wide, kv_lens,
        q_lens, pages_per_block=2, query_tile=query_tile, soft_cap=2.0))
    for b in range(3):
        for c in range(q_lens[b]):
            want = numpy_attention(q[b, c], ks[b], vs[b], kv_lens[b] - q_lens[b] + c,
                                   soft_cap=2.0)
            np.testing.assert_allclose(got[b, c], want, **F32_TOL)
        last = q_lens[b] - 1  # sees several keys, so the cap changes its weights
        uncapped = numpy_attention(q[b, last], ks[b], vs[b], kv_lens[b] - 1)
        assert not np.allclose(got[b, last], uncapped, **F32_TOL)


def test_blockwise_window_reads_each_rows_window_pages_only():
    """Rows of very different lengths under one traced window: each row's walk starts at the
    block of its own oldest visible key, so no row reads a block of pages wholly before its
    window (pages a sliding-window group gives back); results equal the windowed oracle."""
    rng = np.random.default_rng(8)
    page_size, window, ppb = 4, 6, 3  # 15-page tables: whole blocks, no padding entries
    kv_lens, tables, kp, vp, _, _ = make_case(rng, num_seqs=3, page_size=page_size,
                                              num_kv_heads=2, group=2, head_dim=8, max_len=60)
    kv_lens[:] = [60, 21, 33]  # every row past its window; slots past make_case's lengths
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)  # become zero tokens
    q_lens = np.array([1, 3, 2], np.int32)
    q = rng.standard_normal((3, 3, 4, 8)).astype(np.float32)
    read = []  # (row, page) of every page the walk loads

    def load(pages):
        jax.debug.callback(lambda p: read.extend(
            (b, int(x)) for b in range(p.shape[0]) for x in p[b]), pages)
        return jnp.asarray(kp)[pages], jnp.asarray(vp)[pages]

    got = jax.jit(lambda w: attention.paged_attention_blockwise(
        q, load, tables, kv_lens, q_lens, pages_per_block=ppb, window=w))(jnp.int32(window))
    jax.effects_barrier()
    want = attention.paged_prefill_attention_reference(q, kp, vp, tables, kv_lens, q_lens,
                                                       sliding_window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)
    for b in range(3):
        oldest = kv_lens[b] - q_lens[b] + 1 - window
        released = set(tables[b, :max(oldest, 0) // (ppb * page_size) * ppb].tolist())
        assert released, "the case must give back some pages"
        assert not released & {page for row, page in read if row == b}, b
