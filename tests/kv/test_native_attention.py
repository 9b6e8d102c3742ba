"""The native CPU decode kernel against a per-token numpy oracle and the engine's jnp path."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import F32_TOL, make_case, numpy_attention

import kvjax
from kvjax.engine.step import AttentionImpl
from kvjax.kv import native
from kvjax.testing import TINY, tiny_model

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=str(native.unavailable_reason()))

# (page size, kv heads, group, head dim): the specialized shapes (D 64/128 with their groups)
# and the generic path (D 8, 32 and 24, groups 5 and 2).
CASES = [(16, 3, 3, 64), (4, 2, 4, 64), (1, 1, 1, 64), (16, 2, 8, 128), (4, 2, 5, 8),
         (4, 2, 5, 32), (4, 1, 2, 24)]


def _layered(pages: np.ndarray, layer: int, num_layers: int = 3) -> np.ndarray:
    """pages [num_pages, ...] placed at `layer` of a [L, num_pages, ...] pool (others NaN)."""
    out = np.full((num_layers, *pages.shape), np.nan, pages.dtype)
    out[layer] = pages
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "P{}-K{}-G{}-D{}".format(*c))
def test_decode_reads_float_pages_in_place_like_numpy(case):
    page_size, k_heads, group, head_dim = case
    rng = np.random.default_rng(0)
    kv_lens, tables, kp, vp, ks, vs = make_case(
        rng, num_seqs=5, max_len=37, page_size=page_size, num_kv_heads=k_heads, group=group,
        head_dim=head_dim)
    kv_lens[3] = 0  # a padded row
    q = rng.standard_normal((5, k_heads * group, head_dim)).astype(np.float32)
    run = jax.jit(native.paged_decode_attention)
    got = np.asarray(run(q, _layered(kp, 1), _layered(vp, 1), 1, tables, kv_lens))
    for b in range(5):
        want = (np.zeros_like(q[b]) if kv_lens[b] == 0
                else numpy_attention(q[b], ks[b], vs[b], kv_lens[b] - 1))
        np.testing.assert_allclose(got[b], want, **F32_TOL)


@pytest.mark.parametrize("case", [(16, 3, 3, 64), (4, 2, 5, 8)],
                         ids=lambda c: "P{}-K{}-G{}-D{}".format(*c))
def test_rows_of_several_queries_attend_causally_like_numpy(case):
    """Speculative verify rows: q_lens[b] of Q queries at the row's last positions, each
    seeing the tokens up to its own; queries past q_lens (and padded rows) get zeros."""
    page_size, k_heads, group, head_dim = case
    rng = np.random.default_rng(2)
    kv_lens, tables, kp, vp, ks, vs = make_case(
        rng, num_seqs=4, max_len=40, page_size=page_size, num_kv_heads=k_heads, group=group,
        head_dim=head_dim)
    num_queries = 5
    kv_lens[2] = 0  # a padded row
    q_lens = np.minimum([5, 1, 0, 3], kv_lens).astype(np.int32)
    q = rng.standard_normal((4, num_queries, k_heads * group, head_dim)).astype(np.float32)
    run = jax.jit(native.paged_decode_attention)
    got = np.asarray(run(q, _layered(kp, 0), _layered(vp, 0), 0, tables, kv_lens,
                         q_lens=q_lens))
    for b in range(4):
        for i in range(num_queries):
            if i >= q_lens[b]:
                want = np.zeros_like(q[b, i])
            else:
                want = numpy_attention(q[b, i], ks[b], vs[b], kv_lens[b] - q_lens[b] + i)
            np.testing.assert_allclose(got[b, i], want, **F32_TOL)


def test_decode_reads_bfloat16_pages_and_int8_codes_with_scales():
    rng = np.random.default_rng(1)
    kv_lens, tables, kp, vp, _, _ = make_case(rng, num_seqs=4, max_len=50, page_size=16,
                                              num_kv_heads=3, group=3, head_dim=64)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    q = rng.standard_normal((4, 9, 64)).astype(np.float32)
    layer = jnp.int32(2)  # a traced layer index, as inside the layer scan

    kb, vb = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16)
    want = kvjax.kv.attention.paged_decode_attention_reference(
        q, kb.astype(jnp.float32), vb.astype(jnp.float32), tables, kv_lens)
    got = native.paged_decode_attention(q, jnp.stack([kb] * 3), jnp.stack([vb] * 3), layer,
                                        tables, kv_lens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)

    def int8(x):
        scale = np.abs(x).max(-1) / 127
        codes = np.clip(np.round(x / np.where(scale > 0, scale, 1)[..., None]), -127, 127)
        return codes.astype(np.int8), scale.astype(np.float32)

    (kc, kscale), (vc, vscale) = int8(kp), int8(vp)
    want = kvjax.kv.attention.paged_decode_attention_reference(
        q, kc * kscale[..., None], vc * vscale[..., None], tables, kv_lens)
    stack = lambda x: np.stack([x] * 3)  # noqa: E731
    got = native.paged_decode_attention(q, stack(kc), stack(vc), layer, tables, kv_lens,
                                        k_scale=stack(kscale), v_scale=stack(vscale))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)


def test_loading_the_kernel_leaves_subnormal_floats_alone():
    """The process keeps IEEE subnormals (a -ffast-math library would flush them to zero)."""
    assert native.unavailable_reason() is None
    tiny = np.float32(1e-40)
    assert tiny * np.float32(1.0) != 0.0


# Groups of 32 and more read 32 channels at a time in the codes' own order (with AVX-512),
# groups of 16 one vector at a time, groups of 8 eight channels at a time.
@pytest.mark.parametrize("name,options", [
    ("int4", dict(group=32)), ("int4", dict(group=64)), ("int4", dict(group=16)),
    ("int4", dict(group=8)), ("int2", dict(group=32)), ("int2", dict(group=16)),
    ("int8", dict(group=32))],
    ids=["int4-g32", "int4-g64", "int4-g16", "int4-g8", "int2-g32", "int2-g16", "int8-g32"])
def test_decode_reads_packed_codes_with_group_scales_and_zeros(name, options):
    """Packed asymmetric codes decode in the kernel exactly as the codec decodes them."""
    codec = kvjax.kv.codecs.get_codec(name, **options)
    rng = np.random.default_rng(2)
    kv_lens, tables, kp, vp, _, _ = make_case(rng, num_seqs=4, max_len=45, page_size=16,
                                              num_kv_heads=2, group=3, head_dim=64)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    q = rng.standard_normal((4, 6, 64)).astype(np.float32)
    k_stored, v_stored = codec.encode(jnp.asarray(kp)), codec.encode(jnp.asarray(vp))
    want = kvjax.kv.attention.paged_decode_attention_reference(
        q, codec.decode(k_stored), codec.decode(v_stored), tables, kv_lens)
    pool = lambda x: jnp.stack([jnp.zeros_like(x), x])  # noqa: E731  (layer 1 of 2)
    got = native.paged_decode_attention(
        q, pool(k_stored["codes"]), pool(v_stored["codes"]), 1, tables, kv_lens,
        k_scale=pool(k_stored["scale"]), v_scale=pool(v_stored["scale"]),
        k_zero=pool(k_stored["zero"]), v_zero=pool(v_stored["zero"]), bits=codec.bits,
        group=codec.group)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)


def test_states_the_kernel_does_not_read_say_why():
    model = tiny_model()
    for codec, options, says in (
            ("kivi4", dict(group=4, residual=0), "codec 'kivi4"),
            ("int4", dict(group=4, metadata_dtype="float16"), "codec 'int4-g4-fp16meta' (float16"),
            ("fp8_e4m3", dict(scaling="dynamic"), "codec 'fp8_e4m3")):
        engine = kvjax.Engine(model, kvjax.EngineConfig(
            num_pages=16, page_size=4, max_num_seqs=2, kv_codec=codec, kv_codec_options=options))
        assert f"does not read {says}" in native.reason_for(engine.kv)
    with pytest.raises(ValueError, match="attention_impl=NATIVE reads float pages and int8"):
        kvjax.EngineConfig(kv_codec="kivi4", attention_impl="native")


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_engine_decodes_the_same_tokens_with_the_native_kernel(codec):
    """Greedy tokens and logprobs of the native decode equal the blockwise jnp path's."""
    model = tiny_model()
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4], [8] * 11]
    sampling = kvjax.SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = {}
    for impl in (AttentionImpl.REFERENCE, AttentionImpl.NATIVE):
        engine = kvjax.Engine(model, kvjax.EngineConfig(
            num_pages=32, page_size=4, max_num_seqs=4, kv_codec=codec, attention_impl=impl,
            kv_codec_options=dict(group=4) if codec == "int4" else {}))
        outs[impl] = engine.generate(prompts, sampling)
    for ref, got in zip(outs[AttentionImpl.REFERENCE], outs[AttentionImpl.NATIVE], strict=True):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        np.testing.assert_allclose(got.outputs[0].logprobs, ref.outputs[0].logprobs, atol=1e-4)


@pytest.mark.parametrize("name", ["none", "int8", "int4"])
def test_long_rows_split_over_threads_merge_like_numpy(name):
    """Rows far longer than the kernel's minimum chunk (256 tokens) are cut into chunks read on
    different threads, whose partial softmaxes are merged; with several causal queries per row,
    a query past q_lens and a padded row, the result is numpy's on the decoded pages."""
    rng = np.random.default_rng(3)
    kv_lens, tables, kp, vp, _, _ = make_case(rng, num_seqs=3, max_len=1500, page_size=16,
                                              num_kv_heads=2, group=3, head_dim=64)
    kv_lens[1] = 0
    assert kv_lens.max() > 4 * 256
    q_lens = np.array([3, 0, 2], np.int32)
    q = rng.standard_normal((3, 3, 6, 64)).astype(np.float32)
    pool = lambda x: jnp.stack([jnp.zeros_like(x), x])  # noqa: E731  (layer 1 of 2)
    if name == "none":
        args, dk, dv = dict(k_pages=pool(kp), v_pages=pool(vp)), kp, vp
    else:
        codec = kvjax.kv.codecs.get_codec(name)
        kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
        k_stored, v_stored = codec.encode(jnp.asarray(kp)), codec.encode(jnp.asarray(vp))
        args = dict(k_pages=pool(k_stored["codes"]), v_pages=pool(v_stored["codes"]),
                    k_scale=pool(k_stored["scale"]), v_scale=pool(v_stored["scale"]))
        if "zero" in k_stored:
            args.update(k_zero=pool(k_stored["zero"]), v_zero=pool(v_stored["zero"]),
                        bits=codec.bits, group=codec.group)
        dk, dv = np.asarray(codec.decode(k_stored)), np.asarray(codec.decode(v_stored))
    got = np.asarray(native.paged_decode_attention(q, layer=1, block_tables=tables,
                                                   kv_lens=kv_lens, q_lens=q_lens, **args))
    for b in range(3):
        seq_k = dk[tables[b]].reshape(-1, 2, 64)[:kv_lens[b]]
        seq_v = dv[tables[b]].reshape(-1, 2, 64)[:kv_lens[b]]
        for i in range(3):
            want = (numpy_attention(q[b, i], seq_k, seq_v, kv_lens[b] - q_lens[b] + i)
                    if i < q_lens[b] else np.zeros_like(q[b, i]))
            np.testing.assert_allclose(got[b, i], want, **F32_TOL)


@pytest.mark.parametrize("case", [(16, 3, 3, 64, "float32"), (4, 2, 4, 128, "float32"),
                                  (1, 1, 1, 64, "float32"), (16, 3, 3, 64, "bfloat16")],
                         ids=lambda c: "P{}-K{}-G{}-D{}-{}".format(*c))
def test_prefill_kernel_attends_causally_like_numpy(case):
    """Chunks of a ragged batch: a chunk after earlier context, a whole prompt, a short chunk
    (queries past q_len get zeros) and a padded row; chunks span several key blocks and query
    tiles; other layers and unused pages are NaN, so a stray read shows. bfloat16 pages are
    read exactly: numpy attends over the same bfloat16 values in float32."""
    page_size, k_heads, group, head_dim, dtype = case
    rng = np.random.default_rng(6)
    kv_lens, tables, kp, vp, ks, vs = make_case(
        rng, num_seqs=4, max_len=90, page_size=page_size, num_kv_heads=k_heads, group=group,
        head_dim=head_dim)
    kv_lens[:] = [90, 37, 60, 0]
    for b in range(3):  # make_case drew shorter rows: give them their full length
        ks[b] = rng.standard_normal((kv_lens[b], k_heads, head_dim)).astype(np.float32)
        vs[b] = rng.standard_normal((kv_lens[b], k_heads, head_dim)).astype(np.float32)
        for t in range(kv_lens[b]):
            kp[tables[b, t // page_size], t % page_size] = ks[b][t]
            vp[tables[b, t // page_size], t % page_size] = vs[b][t]
    q_lens = np.array([50, 37, 9, 0], np.int32)
    q = rng.standard_normal((4, 50, k_heads * group, head_dim)).astype(np.float32)
    if dtype == "bfloat16":
        bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
        kp, vp = bf16(kp), bf16(vp)
        ks, vs = [bf16(x) for x in ks], [bf16(x) for x in vs]
    run = jax.jit(native.paged_prefill_attention)
    got = np.asarray(run(q, _layered(kp, 2).astype(dtype), _layered(vp, 2).astype(dtype), 2,
                         tables, kv_lens, q_lens))
    for b in range(4):
        for i in range(50):
            want = (numpy_attention(q[b, i], ks[b], vs[b], kv_lens[b] - q_lens[b] + i)
                    if i < q_lens[b] else np.zeros_like(q[b, i]))
            np.testing.assert_allclose(got[b, i], want, **F32_TOL)


def test_prefill_kernel_says_which_pages_it_does_not_read():
    pages = lambda dtype, d: dict(k_pages=jnp.zeros((1, 2, 4, 1, d), dtype),  # noqa: E731
                                  v_pages=jnp.zeros((1, 2, 4, 1, d), dtype))
    assert native.prefill_reason(pages(jnp.float32, 64)) is None
    assert native.prefill_reason(pages(jnp.bfloat16, 64)) is None
    assert "float32 or bfloat16 pages only" in native.prefill_reason(pages(jnp.float16, 64))
    assert "head_dim in (64, 128), not 32" in native.prefill_reason(pages(jnp.float32, 32))
    int8 = dict(pages(jnp.int8, 64), k_scale=jnp.ones((1, 2, 4, 1)))
    assert "float32 or bfloat16 pages only" in native.prefill_reason(int8)


def test_engine_prefills_chunks_with_the_native_kernel_like_the_jnp_path():
    """A model of head dim 64 (the kernel's): prompts prefilled in 24-token chunks (each after
    the earlier ones' KV) decode the same greedy tokens and logprobs as the blockwise path."""
    model = tiny_model(dataclasses.replace(TINY, head_dim=64))
    prompts = [list(range(3, 73)), [5, 9, 2], [7] * 41]
    sampling = kvjax.SamplingParams(max_new_tokens=6, ignore_eos=True)
    outs = {}
    for impl in (AttentionImpl.REFERENCE, AttentionImpl.NATIVE):
        engine = kvjax.Engine(model, kvjax.EngineConfig(
            num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=24,
            attention_impl=impl))
        assert native.prefill_reason_for(engine.kv) is None
        outs[impl] = engine.generate(prompts, sampling)
    for ref, got in zip(outs[AttentionImpl.REFERENCE], outs[AttentionImpl.NATIVE], strict=True):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        np.testing.assert_allclose(got.outputs[0].logprobs, ref.outputs[0].logprobs, atol=1e-4)


@pytest.mark.parametrize("case", [(16, 3, 3, 64), (4, 2, 5, 8)],
                         ids=lambda c: "P{}-K{}-G{}-D{}".format(*c))
def test_kernels_soft_cap_logits_like_numpy(case):
    """Gemma 2's attention logit soft cap in the decode kernel (specialized and generic
    shapes, float pages and int8 codes) and the prefill kernel, logits well past the cap."""
    page_size, k_heads, group, head_dim = case
    cap = 2.0
    rng = np.random.default_rng(9)
    kv_lens, tables, kp, vp, ks, vs = make_case(
        rng, num_seqs=4, max_len=40, page_size=page_size, num_kv_heads=k_heads, group=group,
        head_dim=head_dim)
    n = k_heads * group
    q = 4 * rng.standard_normal((4, n, head_dim)).astype(np.float32)
    got = np.asarray(jax.jit(native.paged_decode_attention, static_argnames="soft_cap")(
        q, _layered(kp, 1), _layered(vp, 1), 1, tables, kv_lens, soft_cap=cap))
    for b in range(4):
        want = numpy_attention(q[b], ks[b], vs[b], kv_lens[b] - 1, soft_cap=cap)
        np.testing.assert_allclose(got[b], want, **F32_TOL)
    assert not np.allclose(got[0], numpy_attention(q[0], ks[0], vs[0], kv_lens[0] - 1),
                           **F32_TOL)

    codec = kvjax.kv.codecs.get_codec("int8")
    k8, v8 = codec.encode(jnp.asarray(np.nan_to_num(kp))), codec.encode(
        jnp.asarray(np.nan_to_num(vp)))
    want = kvjax.kv.attention.paged_decode_attention_reference(
        q, codec.decode(k8), codec.decode(v8), tables, kv_lens, soft_cap=cap)
    got = native.paged_decode_attention(
        q, k8["codes"][None], v8["codes"][None], 0, tables, kv_lens,
        k_scale=k8["scale"][None], v_scale=v8["scale"][None], soft_cap=cap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)

    if head_dim not in native.PREFILL_HEAD_DIMS:
        return
    q_lens = np.minimum([30, 17, 1, 9], kv_lens).astype(np.int32)
    qc = 4 * rng.standard_normal((4, 30, n, head_dim)).astype(np.float32)
    got = np.asarray(native.paged_prefill_attention(qc, _layered(kp, 0), _layered(vp, 0), 0,
                                                    tables, kv_lens, q_lens, soft_cap=cap))
    for b in range(4):
        for i in range(q_lens[b]):
            want = numpy_attention(qc[b, i], ks[b], vs[b], kv_lens[b] - q_lens[b] + i,
                                   soft_cap=cap)
            np.testing.assert_allclose(got[b, i], want, **F32_TOL)


def _released_before_window(kp, vp, tables, kv_lens, q_lens, page_size, window):
    """NaN in every page wholly before the window of each row's first query (pages a
    sliding-window group gives back to the pool): a read of one shows in the output."""
    kp, vp = kp.copy(), vp.copy()
    for b in range(len(kv_lens)):
        oldest = max(kv_lens[b] - max(q_lens[b], 1) + 1 - window, 0)
        for page in tables[b, :oldest // page_size]:
            kp[page], vp[page] = np.nan, np.nan
    return kp, vp


@pytest.mark.parametrize("window", [1, 5, 16, 23])
@pytest.mark.parametrize("case", [(4, 2, 3, 64), (16, 1, 4, 128), (1, 1, 1, 64)],
                         ids=lambda c: "P{}-K{}-G{}-D{}".format(*c))
def test_windowed_decode_and_prefill_see_the_last_window_tokens_like_numpy(case, window):
    """A traced window (the layer scan's per-layer value): decode rows, verify rows of 3
    queries and prefill chunks see only their last `window` tokens, as the numpy oracle with
    `sliding_window` (Mistral / Gemma: keys t - window + 1 .. t); pages wholly before a row's
    window are NaN and never read; window 0 is global."""
    page_size, k_heads, group, head_dim = case
    rng = np.random.default_rng(7)
    kv_lens, tables, kp, vp, ks, vs = make_case(
        rng, num_seqs=4, max_len=70, page_size=page_size, num_kv_heads=k_heads, group=group,
        head_dim=head_dim)
    kv_lens[2] = min(kv_lens[2], 3)  # shorter than most windows
    kv_lens[3] = 0  # a padded row
    n = k_heads * group
    decode = jax.jit(native.paged_decode_attention)
    prefill = jax.jit(native.paged_prefill_attention)

    q = rng.standard_normal((4, n, head_dim)).astype(np.float32)
    ones = np.ones(4, np.int32)
    wk, wv = _released_before_window(kp, vp, tables, kv_lens, ones, page_size, window)
    got = np.asarray(decode(q, _layered(wk, 1), _layered(wv, 1), 1, tables, kv_lens,
                            window=jnp.int32(window)))
    for b in range(4):
        want = (np.zeros_like(q[b]) if kv_lens[b] == 0 else numpy_attention(
            q[b], ks[b], vs[b], kv_lens[b] - 1, sliding_window=window))
        np.testing.assert_allclose(got[b], want, **F32_TOL)
    got = np.asarray(decode(q, _layered(kp, 1), _layered(vp, 1), 1, tables, kv_lens,
                            window=jnp.int32(0)))
    np.testing.assert_allclose(got[0], numpy_attention(q[0], ks[0], vs[0], kv_lens[0] - 1),
                               **F32_TOL)

    for num_queries, run in ((3, decode), (40, prefill)):
        q_lens = np.minimum([num_queries, 2, 3, 0], kv_lens).astype(np.int32)
        qc = rng.standard_normal((4, num_queries, n, head_dim)).astype(np.float32)
        wk, wv = _released_before_window(kp, vp, tables, kv_lens, q_lens, page_size, window)
        got = np.asarray(run(qc, _layered(wk, 0), _layered(wv, 0), 0, tables, kv_lens,
                             q_lens=q_lens, window=jnp.int32(window)))
        for b in range(4):
            for i in range(num_queries):
                want = (numpy_attention(qc[b, i], ks[b], vs[b], kv_lens[b] - q_lens[b] + i,
                                        sliding_window=window)
                        if i < q_lens[b] else np.zeros_like(qc[b, i]))
                np.testing.assert_allclose(got[b, i], want, **F32_TOL)
