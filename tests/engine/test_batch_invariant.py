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

import kvjax
from kvjax.models import invariant, llama
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
