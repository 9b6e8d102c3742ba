"""The low-rank key pool (`kv_codec='lowrank'`): attention over key coordinates in a rank-r basis.

Oracles: a numpy reference of attention over projected keys (scores (q U) . (k U) / sqrt(D),
int8 coordinates rounded in numpy), exact paged attention at r = D, the cache-free greedy
reference at r = D, and numpy's SVD of the keys an exact engine cached, for calibration.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.engine import kv_calibration
from kvjax.kv import attention, calibration, codecs, lowrank
from kvjax.testing import TINY, greedy_reference, tiny_model

L, K, G, D, P = 2, 2, 2, 8, 4


def _orthonormal_basis(rng: np.random.Generator, rank: int) -> np.ndarray:
    """[L, D, r, K]: orthonormal columns per layer and kv head."""
    q, _ = np.linalg.qr(rng.normal(size=(L, K, D, D)))
    return np.ascontiguousarray(np.transpose(q[..., :rank], (0, 2, 3, 1)), np.float32)


def _filled_pool(rng, rank: int, quantize: str, num_pages: int, lengths):
    """A pool with rows of random keys and values at randomly permuted pages."""
    codec = codecs.LowRankCodec(rank, quantize)
    kv = lowrank.init_lowrank_kv(TINY, num_pages, P, codec).with_basis(
        _orthonormal_basis(rng, rank))
    width = -(-max(lengths) // P)
    tables = rng.permutation(num_pages)[:len(lengths) * width].reshape(len(lengths), width)
    keys = rng.normal(size=(len(lengths), width * P, K, D)).astype(np.float32) * 2.0
    values = rng.normal(size=keys.shape).astype(np.float32)
    for b in range(len(lengths)):
        slots = (tables[b][:, None] * P + np.arange(P)).reshape(-1)
        slots = np.where(np.arange(width * P) < lengths[b], slots, -1)
        kv = kv.write(np.int32(1), slots, keys[b], values[b])
    return kv, tables.astype(np.int32), keys, values


def _projected_reference(q, keys, values, basis, lengths, quantize):
    """numpy: decode-free attention of the last len(q) positions over projected keys.

    q [B, C, N, D], keys/values [B, S, K, D], basis [D, r, K] -> [B, C, N, D]."""
    coords = np.einsum("bskd,drk->bskr", keys.astype(np.float64), basis)  # [B, S, K, r]
    if quantize == "int8":
        scale = np.abs(coords).max(-1, keepdims=True) / 127.0
        coords = np.clip(np.round(coords / np.where(scale > 0, scale, 1)), -127, 127) * scale
    b, c = q.shape[:2]
    qg = q.reshape(b, c, K, G, D).astype(np.float64)
    q_coords = np.einsum("bckgd,drk->bckgr", qg, basis)
    scores = np.einsum("bckgr,bskr->bkgcs", q_coords, coords) / np.sqrt(D)
    out = np.zeros((b, c, K, G, D))
    for row, length in enumerate(lengths):
        for i in range(c):
            pos = length - c + i
            s = scores[row, :, :, i, :pos + 1]
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[row, i] = np.einsum("kgs,skd->kgd", w, values[row, :pos + 1])
    return out.reshape(b, c, K * G, D)


def _blockwise(kv, q, tables, lengths):
    """The engine's reference path: queries projected by the state, pages read as stored."""
    b, c = q.shape[:2]
    q_read = kv.project_queries(np.int32(1), q)
    lens = np.asarray(lengths, np.int32)
    return np.asarray(attention.paged_attention_blockwise(
        q_read, lambda pages: kv.load_pages(np.int32(1), pages), tables, lens,
        np.full(b, c, np.int32), sm_scale=1.0 / np.sqrt(D), pages_per_block=2))


@pytest.mark.parametrize("quantize", ["int8", "none"])
def test_attention_reads_projected_keys_as_the_numpy_reference(quantize):
    rng = np.random.default_rng(0)
    lengths = [11, 6]
    kv, tables, keys, values = _filled_pool(rng, 3, quantize, 12, lengths)
    q = rng.normal(size=(2, 3, K * G, D)).astype(np.float32)
    want = _projected_reference(q, keys, values, np.asarray(kv.basis[1]), lengths, quantize)
    assert kv.k_stored[next(iter(kv.k_stored))].shape[-2:] == (K, 3)  # coordinates, not keys
    np.testing.assert_allclose(_blockwise(kv, q, tables, lengths), want, atol=2e-5, rtol=2e-5)


def test_full_rank_attention_equals_exact_attention():
    rng = np.random.default_rng(1)
    lengths = [9, 13]
    kv, tables, keys, values = _filled_pool(rng, D, "none", 10, lengths)
    q = rng.normal(size=(2, 2, K * G, D)).astype(np.float32)
    k_pages = np.zeros((10, P, K, D), np.float32)
    v_pages = np.zeros_like(k_pages)
    for b in range(2):
        k_pages[tables[b]] = keys[b].reshape(-1, P, K, D)
        v_pages[tables[b]] = values[b].reshape(-1, P, K, D)
    want = attention.paged_prefill_attention_reference(
        q, k_pages, v_pages, tables, np.asarray(lengths, np.int32), np.full(2, 2, np.int32))
    np.testing.assert_allclose(_blockwise(kv, q, tables, lengths), want, atol=1e-5, rtol=1e-5)


def _engine(model, rank, quantize="none", **options):
    config = kvjax.EngineConfig(
        page_size=P, num_pages=24, max_num_seqs=2, max_model_len=48, kv_codec="lowrank",
        kv_codec_options=dict(rank=rank, quantize=quantize, **options),
        enable_prefix_cache=False)
    return kvjax.Engine(model, config)


def test_full_rank_greedy_tokens_equal_exact_and_compiles_stay_flat(tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_LOWRANK_CACHE", str(tmp_path))
    model = tiny_model()
    prompts = [[7, 21, 3, 90, 14, 60, 33, 8, 5, 41, 77], [2, 99, 64, 18, 30, 11]]
    engine = _engine(model, D)
    sampling = kvjax.SamplingParams(max_new_tokens=10)
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, sampling)]
    assert got == [greedy_reference(model, p, 10) for p in prompts]
    compiles = engine.num_compiles
    engine.generate(prompts, kvjax.SamplingParams(max_new_tokens=6))
    assert engine.num_compiles == compiles


def test_bytes_per_token_follow_the_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_LOWRANK_CACHE", str(tmp_path))
    model = tiny_model()
    for rank, quantize, key_bytes in ((4, "none", 4 * 4), (4, "int8", 4 + 4), (8, "none", 32)):
        engine = _engine(model, rank, quantize)
        assert engine.kv_bytes_per_token == L * K * (key_bytes + D * 4)
        assert engine.kv.nbytes() == engine.num_pages * P * engine.kv_bytes_per_token \
            + L * D * rank * K * 4  # pages, and the bases beside them


def test_calibrated_bases_span_the_top_singular_vectors_of_cached_keys():
    model = tiny_model()
    prompts = np.random.default_rng(2).integers(0, TINY.vocab_size, (2, 60)).tolist()
    exact = kvjax.Engine(model, kvjax.EngineConfig(
        page_size=P, num_pages=64, max_num_seqs=1, max_model_len=128, max_prefill_chunk=128,
        min_chunk_bucket=128, max_num_batched_tokens=128, enable_prefix_cache=False))
    keys = []  # [L, n, K, D] per prompt: the post-RoPE keys an exact pool caches
    for i, prompt in enumerate(prompts):
        exact.add_request(f"p{i}", prompt, kvjax.SamplingParams(max_new_tokens=2))
        exact.step()  # the whole prompt in one chunk
        exact.drain()
        table = np.asarray(exact.kv_cache.block_table(f"p{i}#0"))
        pages = np.asarray(exact.kv.k_pages)[:, table]  # [L, n, P, K, D]
        keys.append(pages.reshape(L, -1, K, D)[:, :len(prompt)])
        while exact.has_unfinished():
            exact.step()
    keys = np.concatenate(keys, axis=1)
    rank = 3
    basis = calibration.key_bases(model.params, model.config, prompts, rank)  # [L, D, r, K]
    for layer in range(L):
        for head in range(K):
            _, _, vt = np.linalg.svd(keys[layer, :, head].astype(np.float64))
            want = vt[:rank].T @ vt[:rank]  # projector onto the top-r right singular vectors
            u = basis[layer, :, :, head].astype(np.float64)
            np.testing.assert_allclose(u.T @ u, np.eye(rank), atol=1e-5)
            np.testing.assert_allclose(u @ u.T, want, atol=1e-3)


def test_manual_calibration_waits_and_the_disk_cache_skips_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_LOWRANK_CACHE", str(tmp_path))
    model = tiny_model()
    engine = _engine(model, 4, calibration="manual")
    with pytest.raises(ValueError, match="calibrate_kv"):
        engine.add_request("r", [1, 2, 3], kvjax.SamplingParams(max_new_tokens=2))
    prompts = kv_calibration.embedded_prompts(model)
    engine.calibrate_kv(prompts)
    digest = engine.kv.codec.digest
    assert digest is not None and digest in engine.kv.codec_name
    assert len(engine.generate([[1, 2, 3]], kvjax.SamplingParams(max_new_tokens=2))[0]
               .outputs[0].token_ids) == 2

    def no_model(*args, **kwargs):
        raise AssertionError("the cached bases should have been read")

    monkeypatch.setattr(calibration, "key_bases", no_model)
    again = _engine(model, 4)  # embedded calibration: the same prompts, read from the cache
    assert again.kv.codec.digest == digest
