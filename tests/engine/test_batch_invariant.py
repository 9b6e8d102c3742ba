"""EngineConfig.batch_invariant: probe sequences' tokens and logprobs bitwise the same whatever
the batch beside them, the prefill chunk size, prefix-cache hits and preemption.

Oracle: the probes run alone in a batch-invariant engine (and the default mode's divergence
from its own probes-alone run is measured beside it, bounded and reported).
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from sampling_reference import keep_reference

import kvjax
from kvjax.models import invariant, llama
from kvjax.sampling import _filter_logits, sample_tokens
from kvjax.testing import tiny_model

pytestmark = pytest.mark.skipif(invariant.unavailable_reason() is not None,
                                reason=str(invariant.unavailable_reason()))

PAGE = 4
PROBES = [[1, 5, 9, 13, 2, 7, 3, 3, 8, 11, 4, 6, 10], [20, 21, 22, 23, 24, 25, 26]]
SAMPLING = kvjax.SamplingParams(max_new_tokens=6, ignore_eos=True)
DIVERGENCE = {"default": 0.0}  # the default mode's largest logprob difference seen


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _engine(model, batch_invariant, num_pages=64, chunk=32, prefix_cache=True):
    return kvjax.Engine(model, kvjax.EngineConfig(
        num_pages=num_pages, page_size=PAGE, max_num_seqs=6, max_prefill_chunk=chunk,
        max_num_batched_tokens=max(chunk, 16), enable_prefix_cache=prefix_cache,
        batch_invariant=batch_invariant))


def _probe_outputs(engine, warm, companions):
    """The probes' (tokens, logprobs) after `warm` prompts ran (prefix-cache entries) and
    with `companions` in the same batch."""
    if warm:
        engine.generate(warm, SAMPLING)
    outs = engine.generate(PROBES + companions, SAMPLING)
    return [(o.outputs[0].token_ids, np.asarray(o.outputs[0].logprobs)) for o in outs[:2]]


@pytest.fixture(scope="module")
def alone(model):
    return {mode: _probe_outputs(_engine(model, mode), [], []) for mode in (True, False)}


SCENARIOS = st.fixed_dictionaries(dict(
    companions=st.lists(st.lists(st.integers(0, 126), min_size=1, max_size=30), max_size=4),
    warm_prefix=st.sampled_from([0, 4, 9, 13]),  # tokens of probe 0 already cached
    chunk=st.sampled_from([8, 16, 32]),
    num_pages=st.sampled_from([14, 64]),  # 14: the batch cannot all fit, sequences preempted
))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=SCENARIOS)
def test_probe_logprobs_are_bitwise_independent_of_the_batch(model, alone, scenario):
    warm = [PROBES[0][:scenario["warm_prefix"]] + [126]] if scenario["warm_prefix"] else []
    for mode in (True, False):
        engine = _engine(model, mode, scenario["num_pages"], scenario["chunk"])
        got = _probe_outputs(engine, warm, scenario["companions"])
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, alone[mode],
                                                                    strict=True):
            assert tokens == want_tokens
            if mode:
                np.testing.assert_array_equal(logprobs, want_logprobs)
            else:  # the default mode: close, and how far it drifts is reported
                difference = float(np.abs(logprobs - want_logprobs).max())
                assert difference < 1e-3
                DIVERGENCE["default"] = max(DIVERGENCE["default"], difference)
    print(f"default mode's largest logprob divergence so far: {DIVERGENCE['default']:.3g}")


def test_probes_are_bitwise_the_same_through_preemption_and_prefix_hits(model, alone):
    """A scenario that surely preempts (four long companions in 14 pages) and hits the prefix
    cache (9 tokens of probe 0 cached), in 8-token chunks."""
    engine = _engine(model, True, num_pages=14, chunk=8)
    companions = [[(7 * i + j) % 120 + 1 for j in range(30)] for i in range(4)]
    got = _probe_outputs(engine, [PROBES[0][:9] + [126]], companions)
    assert engine.stats["preemptions"] > 0
    assert engine.prefix_cache_stats()["prefix_hit_tokens"] > 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, alone[True], strict=True):
        assert tokens == want_tokens
        np.testing.assert_array_equal(logprobs, want_logprobs)


def test_default_mode_diverges_where_the_invariant_mode_does_not(model, alone):
    """One batch where the default mode's logprobs move (a step past the native matmul's
    size, long companions sharing the step): what batch_invariant exists for."""
    companions = [list(range(1, 100)), list(range(3, 90))]
    got = {mode: _probe_outputs(_engine(model, mode, chunk=256), [], companions)
           for mode in (True, False)}
    for (_, logprobs), (_, want) in zip(got[True], alone[True], strict=True):
        np.testing.assert_array_equal(logprobs, want)
    drift = max(float(np.abs(lp - want).max())
                for (_, lp), (_, want) in zip(got[False], alone[False], strict=True))
    print(f"default mode's logprob divergence in a 256-token step: {drift:.3g}")
    assert drift > 0


def test_engine_logits_equal_the_invariant_forward(model):
    """Teacher-forced logits of every prompt token (LogitsMode ALL through score) and the
    sampled tokens' logprobs equal `forward_invariant`'s over the same tokens, bitwise."""
    engine = _engine(model, True)
    out = engine.generate([PROBES[0]], SAMPLING)[0].outputs[0]
    tokens = jnp.asarray(PROBES[0] + out.token_ids, jnp.int32)
    logprobs = jax.jit(lambda params, tokens: invariant.log_softmax(
        invariant.forward_invariant(params, model.config, tokens, PAGE)))(model.params, tokens)
    picked = np.asarray(logprobs)[np.arange(len(PROBES[0]) - 1, tokens.shape[0] - 1),
                                  out.token_ids]
    np.testing.assert_array_equal(picked, np.asarray(out.logprobs, np.float32))
    dense = llama.forward_dense(model.params, model.config, tokens)
    np.testing.assert_allclose(invariant.forward_invariant(model.params, model.config, tokens,
                                                           PAGE), dense, atol=1e-4)


def test_refused_where_it_cannot_hold(model):
    with pytest.raises(ValueError, match="batch_invariant"):
        kvjax.EngineConfig(batch_invariant=True, attention_impl="pallas")
    bf16 = dataclasses.replace(model, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                          model.params))
    with pytest.raises(ValueError, match="float32 parameters"):
        kvjax.Engine(bf16, kvjax.EngineConfig(num_pages=16, page_size=PAGE,
                                              batch_invariant=True))
    windowed = tiny_model(dataclasses.replace(model.config, layer_windows=(8, 0)))
    with pytest.raises(ValueError, match="sliding-window layers"):
        kvjax.Engine(windowed, kvjax.EngineConfig(num_pages=16, page_size=PAGE,
                                                  batch_invariant=True))


def test_row_cumsum_is_the_running_sum_whatever_the_rows_beside():
    """`invariant.row_cumsum` against NumPy's float64 running sum, over a length that is not a
    multiple of its block; a row's bits are the same alone and among 160 rows."""
    x = np.random.default_rng(0).random((160, 300), np.float32)
    many = np.asarray(jax.jit(invariant.row_cumsum)(x))
    np.testing.assert_allclose(many, np.cumsum(x.astype(np.float64), axis=-1), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(jax.jit(invariant.row_cumsum)(x[7:8])), many[7:8])


SAMPLED = kvjax.SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.3, top_p=0.8,
                               min_p=0.05, top_k=0, seed=5)


def test_top_p_and_min_p_sampler_rows_are_bitwise_independent_of_the_batch():
    """The sampler with the fixed-order sums: each row keeps exactly the reference's min-p and
    top-p set, and a row's token and logprob are the same bits alone and among 160 rows
    (past the 128 rows from which XLA's CPU reductions change their order)."""
    vocab, rows = 300, 160
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    top_p = rng.uniform(0.3, 1.0, rows).astype(np.float32)
    min_p = rng.uniform(0.0, 0.2, rows).astype(np.float32)
    temperature = rng.uniform(0.5, 2.0, rows).astype(np.float32)
    seeds, counters = np.arange(rows, dtype=np.uint32), np.arange(rows, dtype=np.int32)
    top_k = np.zeros(rows, np.int32)

    @jax.jit
    def sample(logits, temperature, top_p, min_p, seeds, counters, top_k):
        return sample_tokens(logits, temperature, top_k, top_p, seeds, counters, min_p,
                             all_greedy=False, needs_filter=True, row_sums=invariant.ROW_SUMS)

    args = (logits, temperature, top_p, min_p, seeds, counters, top_k)
    tokens, logprobs = (np.asarray(a) for a in sample(*args))
    support = np.isfinite(np.asarray(jax.jit(
        lambda x, k, p, m: _filter_logits(x, k, p, m, invariant.ROW_SUMS))(
            logits / temperature[:, None], top_k, top_p, min_p)))
    for i in (0, 7, 100, 159):
        keep = keep_reference((logits[i] / temperature[i]).astype(np.float64), 0,
                              float(top_p[i]), float(min_p[i]))
        np.testing.assert_array_equal(support[i], keep)
        assert keep[tokens[i]]
        alone = [np.asarray(a) for a in sample(*(a[i:i + 1] for a in args))]
        assert alone[0][0] == tokens[i]
        assert alone[1].tobytes() == logprobs[i:i + 1].tobytes()


def test_sampled_top_p_min_p_probes_are_bitwise_the_same_in_any_batch(model):
    """Seeded probes under temperature, top-p and min-p: tokens and logprobs bitwise equal
    alone and beside long companions in 8-token chunks with preemption."""
    def run(companions, num_pages, chunk):
        engine = _engine(model, True, num_pages=num_pages, chunk=chunk)
        outs = engine.generate(PROBES + companions, SAMPLED)
        return engine, [(o.outputs[0].token_ids, np.asarray(o.outputs[0].logprobs))
                        for o in outs[:2]]

    _, alone = run([], 64, 32)
    companions = [[(5 * i + j) % 120 + 1 for j in range(30)] for i in range(4)]
    engine, got = run(companions, 14, 8)
    assert engine.stats["preemptions"] > 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, alone, strict=True):
        assert tokens == want_tokens
        np.testing.assert_array_equal(logprobs, want_logprobs)
