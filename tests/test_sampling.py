"""The sampling rules (`kvjax.sampling`) against NumPy references of each rule on fixed random
logits, over hypothesis-drawn parameters and token histories (`sampling_reference`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_reference import keep_reference, rules_reference

from kvjax.sampling import (
    MAX_LOGIT_BIAS,
    LogitRules,
    SamplingParams,
    _filter_logits,
    apply_rules,
    sample_tokens,
    verify_drafts,
)

V = 64
STOPS = (V - 1, 7)
MAX_ENTRIES = 16
ROWS = 4  # Cases are padded to this many rows (and 4 drafts) so each program compiles once.
GAMMA = 4

# Jitted once per static switch: hypothesis cases of one shape then reuse the program.
_apply_rules = jax.jit(apply_rules)
_sample = jax.jit(sample_tokens, static_argnames=("all_greedy", "needs_filter"))
_verify = jax.jit(verify_drafts, static_argnames=("all_greedy", "needs_filter"))


def padded(rows: list) -> list:
    """`rows` padded with neutral rows (no history, default params) to ROWS."""
    return rows + [([], [], SamplingParams())] * (ROWS - len(rows))


def rules_of(rows: list[tuple[list[int], list[int], SamplingParams]]) -> LogitRules:
    """LogitRules of rows (prompt, output, params), counting with NumPy."""
    rows = padded(rows)
    n = len(rows)
    prompt_mask = np.zeros((n, V), bool)
    counts = np.zeros((n, V), np.int32)
    ids = np.zeros((n, MAX_ENTRIES), np.int32)
    values = np.zeros((n, MAX_ENTRIES), np.float32)
    until = np.zeros((n, MAX_ENTRIES), np.int32)
    for i, (prompt, output, p) in enumerate(rows):
        prompt_mask[i, prompt] = True
        counts[i] = np.bincount(np.asarray(output, np.int64), minlength=V)
        entries = [(t, b, 2**31 - 1) for t, b in p.logit_bias]
        if p.min_tokens:
            entries += [(t, -np.inf, p.min_tokens) for t in p.stop_ids(STOPS[:1])]
        for k, (t, b, u) in enumerate(entries):
            ids[i, k], values[i, k], until[i, k] = t, b, u
    return LogitRules(
        prompt_mask=jnp.asarray(prompt_mask), output_counts=jnp.asarray(counts),
        presence=jnp.asarray([p.presence_penalty for *_, p in rows], jnp.float32),
        frequency=jnp.asarray([p.frequency_penalty for *_, p in rows], jnp.float32),
        repetition=jnp.asarray([p.repetition_penalty for *_, p in rows], jnp.float32),
        bias_ids=jnp.asarray(ids), bias_values=jnp.asarray(values),
        bias_until=jnp.asarray(until))


penalty = st.floats(-2.0, 2.0, allow_nan=False)
params = st.builds(
    lambda pres, freq, rep, bias, min_tokens, stop: SamplingParams(
        max_new_tokens=32, presence_penalty=pres, frequency_penalty=freq,
        repetition_penalty=rep, logit_bias=bias, min_tokens=min_tokens,
        stop_token_ids=stop),
    penalty, penalty, st.sampled_from([1.0, 0.5, 1.2, 2.0]) | st.floats(0.1, 4.0),
    st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100, allow_nan=False),
                    max_size=8),
    st.integers(0, 32), st.lists(st.integers(0, V - 1), max_size=3))
history = st.lists(st.integers(0, V - 1), max_size=40)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(history, history, params), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_rules_equal_the_reference(rows, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, size=(ROWS, V)).astype(np.float32)
    counters = np.asarray([len(out) for _, out, _ in padded(rows)], np.int32)
    got = np.asarray(_apply_rules(jnp.asarray(logits), rules_of(rows), jnp.asarray(counters)))
    for i, (prompt, output, p) in enumerate(rows):
        want = rules_reference(logits[i], prompt, output, p, p.stop_ids(STOPS[:1]))
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[i][finite], want[finite], rtol=1e-5, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), top_k=st.integers(0, V + 4),
       top_p=st.sampled_from([1.0]) | st.floats(0.01, 1.0),
       min_p=st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0),
       temperature=st.floats(0.2, 3.0))
def test_filters_keep_the_reference_set(seed, top_k, top_p, min_p, temperature):
    """min-p, then top-k, then top-p: the sampled support is exactly the reference's, and
    the draw is the engine key's categorical over it."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, size=(3, V)).astype(np.float32)
    n = logits.shape[0]
    full = lambda x, dtype=jnp.float32: jnp.full(n, x, dtype)  # noqa: E731
    seeds, counters = jnp.arange(n, dtype=jnp.uint32) + seed, jnp.arange(n, dtype=jnp.int32)
    tokens, logprobs = _sample(
        jnp.asarray(logits), full(temperature), full(top_k, jnp.int32), full(top_p),
        seeds, counters, full(min_p), all_greedy=False, needs_filter=True)
    support = np.isfinite(np.asarray(_filter_logits(
        jnp.asarray(logits) / temperature, full(top_k, jnp.int32), full(top_p), full(min_p))))
    for i in range(n):
        scaled = logits[i] / np.float32(temperature)
        keep = keep_reference(scaled.astype(np.float64), top_k, top_p, min_p)
        np.testing.assert_array_equal(support[i], keep)
        key = jax.random.fold_in(jax.random.key(int(seeds[i])), int(counters[i]))
        want = jax.random.categorical(key, jnp.where(keep, scaled, -jnp.inf))
        assert int(tokens[i]) == int(want)
        # Reported logprobs are the model's own, before any rule.
        np.testing.assert_allclose(
            float(logprobs[i]), float(jax.nn.log_softmax(logits[i])[int(tokens[i])]),
            rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(history, history, params), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_greedy_rows_take_the_argmax_of_the_processed_logits(rows, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, size=(ROWS, V)).astype(np.float32)
    n = ROWS
    counters = jnp.asarray([len(out) for _, out, _ in padded(rows)], jnp.int32)
    for all_greedy in (True, False):
        tokens, logprobs = _sample(
            jnp.asarray(logits), jnp.zeros(n), jnp.zeros(n, jnp.int32), jnp.ones(n),
            jnp.zeros(n, jnp.uint32), counters, jnp.zeros(n), rules_of(rows),
            all_greedy=all_greedy, needs_filter=not all_greedy)
        for i, (prompt, output, p) in enumerate(rows):
            want = rules_reference(logits[i], prompt, output, p, p.stop_ids(STOPS[:1]))
            assert want[int(tokens[i])] == pytest.approx(want.max(), rel=1e-5, abs=1e-4)
            np.testing.assert_allclose(float(logprobs[i]), float(
                jax.nn.log_softmax(logits[i])[int(tokens[i])]), rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(history, history, params), min_size=1, max_size=3),
       seed=st.integers(0, 2**16), gamma=st.integers(1, GAMMA))
def test_verify_drafts_sees_earlier_drafts_in_the_counts(rows, seed, gamma):
    """Greedy verification under the rules keeps exactly the drafts one-token-at-a-time
    greedy decoding under the same rules would produce, position j counting drafts[:j]."""
    rng = np.random.default_rng(seed)
    rows = padded(rows)
    n, w = ROWS, GAMMA + 1
    logits = rng.normal(0, 2, size=(n, w, V)).astype(np.float32)
    drafts = np.zeros((n, GAMMA), np.int32)
    num_drafts = rng.integers(0, gamma + 1, size=n).astype(np.int32)
    want_accepted, want_token = [], []
    for i, (prompt, output, p) in enumerate(rows):
        out, accepted = list(output), None
        stops = p.stop_ids(STOPS[:1])
        for j in range(w):
            target = int(np.argmax(rules_reference(logits[i, j], prompt, out, p, stops)))
            if j < num_drafts[i]:
                # Mostly the reference's own choice, so drafts get accepted and the later
                # positions' counts matter.
                drafts[i, j] = target if rng.random() < 0.75 else int(rng.integers(V))
            if accepted is None and (j >= num_drafts[i] or drafts[i, j] != target):
                accepted = j
                want_accepted.append(j)
                want_token.append(target)
            out.append(int(drafts[i, j]) if j < GAMMA else 0)
    counters = jnp.asarray([len(out) for _, out, _ in rows], jnp.int32)
    for all_greedy in (True, False):
        num_accepted, token, _ = _verify(
            jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num_drafts), jnp.zeros(n),
            jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros(n, jnp.uint32), counters,
            jnp.zeros(n), rules_of(rows), all_greedy=all_greedy, needs_filter=not all_greedy)
        assert np.asarray(num_accepted).tolist() == want_accepted
        assert np.asarray(token).tolist() == want_token


@pytest.mark.parametrize("kwargs,match", [
    (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in \\[-2, 2\\], got -3"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty.*got nan"),
    (dict(presence_penalty=True), "presence_penalty.*got True"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be finite and > 0, got 0.0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty.*got inf"),
    (dict(min_p=1.5), "min_p must be in \\[0, 1\\], got 1.5"),
    (dict(min_p="0.1"), "min_p.*got '0.1'"),
    (dict(min_tokens=-1), "min_tokens must be an int in \\[0, max_new_tokens=64\\], got -1"),
    (dict(min_tokens=65), "min_tokens.*got 65"),
    (dict(min_tokens=2.0), "min_tokens.*got 2.0"),
    (dict(logit_bias={3: 101}), "logit_bias\\[3\\] must be in \\[-100, 100\\], got 101"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token ids must be ints >= 0, got -1"),
    (dict(logit_bias={"x5": 1.0}), "logit_bias token ids.*got 'x5'"),
    (dict(logit_bias={"-5": 1.0}), "logit_bias token ids.*got '-5'"),
    (dict(logit_bias={5: float("nan")}), "logit_bias\\[5\\].*got nan"),
    (dict(logit_bias="5"), "logit_bias must map token ids to biases, got '5'"),
    (dict(logit_bias=[(1, 2.0), (1, 3.0)]), "logit_bias names token id 1 twice"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "at most 300 entries"),
])
def test_invalid_controls_name_the_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_is_stored_as_sorted_pairs_and_round_trips():
    p = SamplingParams(logit_bias={9: -1, 2: 0.5})
    assert p.logit_bias == ((2, 0.5), (9, -1.0))
    assert SamplingParams(logit_bias=[list(x) for x in p.logit_bias]) == p
    assert SamplingParams(logit_bias={"9": -1, "2": 0.5}) == p  # JSON's string keys
    assert hash(p) == hash(SamplingParams(logit_bias={2: 0.5, 9: -1.0}))
    assert not SamplingParams().needs_rules and SamplingParams(min_tokens=1).needs_rules
    assert SamplingParams(temperature=1.0, min_p=0.1).needs_filter
