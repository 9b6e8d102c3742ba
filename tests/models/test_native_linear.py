"""The native CPU matmul (kvjax.models.linear) against numpy, and the engine with it vs XLA's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import cpu_kernels
from kvjax.engine.step import MatmulImpl, layer_linear
from kvjax.models import linear, llama
from kvjax.testing import TINY, tiny_model

pytestmark = pytest.mark.skipif(linear.unavailable_reason() is not None,
                                reason=str(linear.unavailable_reason()))

# (rows T, In, Out): whole strips; column tails past the last vector (Out 19, 8, 200); row
# tiles of 1-4 rows and their remainders (T 5, 33); In not a multiple of a vector, and weight
# rows split over the threads' ranges with a short last block (In 100, 40) or one block (16);
# transposed, whole 4 x 4 tiles summed across lanes together (T 16 with In 64); partials
# of the threads' ranges added by all threads (T x Out >= 16K: T 16, Out 1536); transposed
# panels of weight rows with x's broadcast tiles from 24 rows (T 26 and 64: a short last tile,
# In not a multiple of 16, rows past the last whole panel).
# bfloat16 against bfloat16: a few roundings one ulp (2^-8 relative) apart, carried through the
# layers.
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
SHAPES = [(1, 576, 576), (16, 64, 1536), (3, 40, 19), (5, 16, 8), (33, 100, 70),
          (64, 64, 200), (26, 150, 200)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-In{}-Out{}".format(*s))
def test_reads_one_layer_of_stacked_weights_like_numpy(shape):
    t, k, n = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w = np.full((3, k, n), np.nan, np.float32)  # other layers must not be read
    w[1] = rng.standard_normal((k, n))
    got = jax.jit(linear.native_linear)(x, w, jnp.int32(1))
    np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w[1], rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-In{}-Out{}".format(*s))
def test_transposed_weights_are_dot_products_of_rows(shape):
    t, k, n = shape
    rng = np.random.default_rng(1)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w = np.full((2, n, k), np.nan, np.float32)
    w[0] = rng.standard_normal((n, k))
    got = jax.jit(linear.native_linear, static_argnames="transpose")(x, w, 0, transpose=True)
    np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w[0].T, rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("transpose", [False, True])
def test_invariant_rows_are_bitwise_the_same_alone_and_beside_others(transpose):
    """The invariant order: a row's product is bitwise the same alone and among 1030 rows
    (where the default order takes the packed product or the transposed panels), and is
    x @ w."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1030, 300)).astype(np.float32)
    w = rng.standard_normal((2, 200, 300) if transpose else (2, 300, 200)).astype(np.float32)
    call = jax.jit(linear.invariant_linear, static_argnums=3)
    rows = np.asarray(call(x, w, jnp.int32(1), transpose))
    for t in (0, 517, 1029):
        np.testing.assert_array_equal(np.asarray(call(x[t:t + 1], w, jnp.int32(1), transpose)),
                                      rows[t:t + 1])
    w1 = w[1].T if transpose else w[1]
    np.testing.assert_allclose(rows, x.astype(np.float64) @ w1, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif("avx512_bf16" not in (cpu_kernels.host_flags() or ()),
                    reason="bfloat16 takes the packed pairs product with AVX-512 BF16 only")
@pytest.mark.parametrize("transpose", [False, True])
def test_bfloat16_packed_rows_are_bitwise_the_same_whatever_the_rows_beside(transpose):
    """bfloat16 from 32 rows of x (the packed product, whose sums run over In in one order
    whatever T): a row's float32 sums are bitwise the same among 32, 33 or 100 rows, at any
    place in a tile or a block of rows, as among 1030 (In odd and past one pass of a tile,
    Out past the last strip), and x @ w."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((1030, 301)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 200, 301) if transpose else (2, 301, 200)),
                    jnp.bfloat16)
    call = jax.jit(linear.native_linear, static_argnames=("transpose", "out_dtype"))
    rows = np.asarray(call(x, w, 1, transpose=transpose, out_dtype=jnp.float32))
    for t, before, count in ((0, 0, 32), (517, 2, 33), (517, 66, 100), (1029, 99, 100)):
        got = call(x[t - before:t - before + count], w, 1, transpose=transpose,
                   out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(got)[before], rows[t])
    w1 = np.asarray(w[1], np.float64)
    want = np.asarray(x, np.float64) @ (w1.T if transpose else w1)
    np.testing.assert_allclose(rows, want, rtol=1e-4, atol=1e-4)


def test_bfloat16_goes_to_the_kernel_other_dtypes_to_xla():
    """bfloat16 x and w take the kernel (its paths: tests/test_cpu_kernels.py) and come back
    in bfloat16 like XLA's, or unrounded in float32 (out_dtype); float16 or mixed dtypes go to
    XLA."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((3, 64, 96)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16)
    kernel = jax.jit(linear.native_linear)
    assert "kvjax_linear" in kernel.lower(x, w, 2).as_text()
    got = kernel(x, w, 2)
    assert got.dtype == jnp.bfloat16
    want = np.asarray(x, np.float64) @ np.asarray(w[2], np.float64)  # within half a bfloat16 ulp
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -8, atol=1e-6)
    sums = jax.jit(linear.native_linear, static_argnames="out_dtype")  # the head's logits
    assert "kvjax_linear" in sums.lower(x, w, 2, out_dtype=jnp.float32).as_text()
    got = sums(x, w, 2, out_dtype=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    for xd, wd in ((jnp.float16, jnp.float16), (jnp.bfloat16, jnp.float32)):
        args = (x.astype(xd), w.astype(wd), 2)
        assert "kvjax_linear" not in kernel.lower(*args).as_text()
        np.testing.assert_array_equal(np.asarray(kernel(*args)),
                                      np.asarray(linear.xla_linear(*args)))


def test_auto_uses_the_kernel_up_to_each_dtypes_limit():
    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
    limit = linear.NATIVE_MAX_TOKENS[f32]
    assert layer_linear(MatmulImpl.AUTO, 1) is linear.native_linear
    assert layer_linear(MatmulImpl.AUTO, limit, f32) is linear.native_linear
    assert layer_linear(MatmulImpl.AUTO, limit + 1, f32) is None
    assert layer_linear(MatmulImpl.AUTO, 8192, bf16) is linear.native_linear  # no limit
    assert layer_linear(MatmulImpl.AUTO, 1, jnp.float16) is None  # a dtype it does not take
    assert layer_linear(MatmulImpl.XLA, 1) is None
    assert layer_linear(MatmulImpl.NATIVE, 4096) is linear.native_linear


def test_decoder_logits_match_the_scan_over_layer_slices():
    """decode_body + lm_head reading layers in place equal XLA's scan over sliced layers
    (untied and tied embeddings)."""
    for tied in (False, True):
        config = dataclasses.replace(TINY, tie_word_embeddings=tied)
        model = tiny_model(config)
        tokens = jnp.array([3, 9, 27, 81, 5], jnp.int32)
        logits = {}
        for name, lin in (("xla", None), ("native", linear.native_linear)):
            logits[name] = jax.jit(_logits, static_argnums=(0, 3))(config, model.params,
                                                                  tokens, lin)
        np.testing.assert_allclose(logits["native"], logits["xla"], rtol=1e-5, atol=1e-5)


def test_bfloat16_decoder_logits_match_xla_within_bfloat16_rounding():
    """In bfloat16 each matmul rounds its float32 sums to bfloat16, so the kernel's other
    order of the sums may move a rounding by one ulp: the logits agree within BF16_TOL."""
    for tied in (False, True):
        config = dataclasses.replace(TINY, tie_word_embeddings=tied)
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_model(config).params)
        tokens = jnp.array([3, 9, 27, 81, 5], jnp.int32)
        logits = {name: jax.jit(_logits, static_argnums=(0, 3))(config, params, tokens, lin)
                  for name, lin in (("xla", None), ("native", linear.native_linear))}
        np.testing.assert_allclose(logits["native"], logits["xla"], **BF16_TOL)


def _logits(config, params, tokens, lin):
    h, _ = llama.decode_body(params, config, tokens, jnp.arange(tokens.shape[0]),
                             _no_attention, None, linear=lin)
    return llama.lm_head(params, config, h, lin)


def _no_attention(_, q, k, v, cache):
    return q + jnp.repeat(v, q.shape[1] // v.shape[1], axis=1), cache


def test_engine_decodes_the_same_tokens_with_native_matmuls():
    """Greedy tokens and logprobs with the native matmuls equal XLA's; prefill-sized steps
    keep XLA under AUTO; the choice is per step shape, so no program is added."""
    model = tiny_model()
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4], [8] * 11]
    sampling = kvjax.SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs, compiles = {}, {}
    for impl in (MatmulImpl.XLA, MatmulImpl.AUTO, MatmulImpl.NATIVE):
        engine = kvjax.Engine(model, kvjax.EngineConfig(
            num_pages=32, page_size=4, max_num_seqs=4, matmul_impl=impl))
        outs[impl] = engine.generate(prompts, sampling)
        compiles[impl] = engine.num_compiles
    assert compiles[MatmulImpl.AUTO] == compiles[MatmulImpl.NATIVE] == compiles[MatmulImpl.XLA]
    for impl in (MatmulImpl.AUTO, MatmulImpl.NATIVE):
        for ref, got in zip(outs[MatmulImpl.XLA], outs[impl], strict=True):
            assert got.outputs[0].token_ids == ref.outputs[0].token_ids
            np.testing.assert_allclose(got.outputs[0].logprobs, ref.outputs[0].logprobs,
                                       atol=1e-4)


def test_bfloat16_engine_with_native_matmuls_matches_xla():
    """bfloat16 weights and pages: the native matmul's greedy tokens are XLA's, their logprobs
    within BF16_TOL; the kernel adds no program, and a second run compiles nothing."""
    model = tiny_model()
    model = dataclasses.replace(model, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                           model.params))
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4], [8] * 11]
    sampling = kvjax.SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs, compiles = {}, {}
    for impl in (MatmulImpl.XLA, MatmulImpl.NATIVE):
        engine = kvjax.Engine(model, kvjax.EngineConfig(  # no prefix hits: the same steps again
            num_pages=32, page_size=4, max_num_seqs=4, matmul_impl=impl,
            enable_prefix_cache=False))
        outs[impl] = engine.generate(prompts, sampling)
        compiles[impl] = engine.num_compiles
        engine.generate(prompts, sampling)
        assert engine.num_compiles == compiles[impl], impl
    assert compiles[MatmulImpl.NATIVE] == compiles[MatmulImpl.XLA]
    for ref, got in zip(outs[MatmulImpl.XLA], outs[MatmulImpl.NATIVE], strict=True):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        np.testing.assert_allclose(got.outputs[0].logprobs, ref.outputs[0].logprobs,
                                   **BF16_TOL)
