"""Malformed requests through the Python API: each is a ValueError naming the request and the
value, and changes nothing (the HTTP server maps the same refusals to 400s)."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
from strategies import HOSTILE_TEXT

import kvjax
from kvjax import Engine, EngineConfig, SamplingParams
from kvjax.testing import greedy_reference, tiny_model
from kvjax.validation import name_problem


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model(), EngineConfig(page_size=4, num_pages=32, max_num_seqs=2))


@pytest.mark.parametrize("prompt,match", [
    ([1, 2.0], "got float 2.0"), ([1, 2.7], "got float 2.7"), (["1"], "got str '1'"),
    ([True, 2], "got bool True"), ([np.bool_(True)], "got bool"), (None, "got NoneType None"),
    ([[1, 2]], "got list"), ("123", "got str '123'"), (np.array([[1, 2]]), "got ndarray"),
    (5, "got int 5"),
], ids=["float", "float-truncated", "str-id", "bool", "numpy-bool", "none", "nested", "str",
        "2d-array", "int"])
def test_malformed_prompts_are_value_errors_naming_request_and_value(engine, prompt, match):
    with pytest.raises(ValueError, match=f"request 'bad'.*{match}"):
        engine.add_request("bad", prompt, SamplingParams(max_new_tokens=2))
    assert not engine.has_unfinished()


def test_numpy_ids_are_token_ids(engine):
    assert engine.validate_request("ok", np.array([1, 2, 3]), SamplingParams()) == [1, 2, 3]
    assert engine.validate_request("ok", (np.int32(4),), SamplingParams()) == [4]


def test_stop_token_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(ValueError, match="request 'r'.*stop token id 500 is outside"):
        engine.add_request("r", [1, 2], SamplingParams(stop_token_ids=(500,)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=float("inf")), "temperature.*inf"),
    (dict(temperature=float("nan")), "temperature.*nan"),
    (dict(temperature=True), "temperature.*True"), (dict(top_p=float("nan")), "top_p"),
    (dict(max_new_tokens=True), "max_new_tokens.*True"), (dict(n=2.0), "n must.*2.0"),
    (dict(stop_token_ids=(1.5,)), "stop_token_ids.*1.5"),
    (dict(stop_token_ids=("3",)), "stop_token_ids.*'3'"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids.*-1"), (dict(stop_token_ids=7), "stop_token_ids"),
    (dict(seed=1.0), "seed"),
])
def test_bad_sampling_values_are_value_errors_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_generate_returns_malformed_prompts_alone_with_their_error(engine):
    outs = engine.generate([None, [1, 2.5], [[3]]], SamplingParams(max_new_tokens=2))
    assert all(o.finished and o.error for o in outs)
    assert "NoneType" in outs[0].error and "2.5" in outs[1].error and "list" in outs[2].error
    (out,) = kvjax.generate(engine.model, [None], SamplingParams(max_new_tokens=2),
                            engine_config=engine.config)
    assert "NoneType" in out.error


_NOT_TEXT = st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=3),
                      st.lists(st.integers(), max_size=2))
_PRIORITIES = st.one_of(st.integers(-2**33, 2**33), st.booleans(), st.floats(), st.text(max_size=2))
_ARRIVALS = st.one_of(st.none(), st.floats(), st.integers(-5, 5), st.text(max_size=2))


@hypothesis.settings(max_examples=60, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(request_id=st.one_of(HOSTILE_TEXT, _NOT_TEXT),
                  tenant=st.one_of(HOSTILE_TEXT, _NOT_TEXT), priority=_PRIORITIES,
                  arrival_time=_ARRIVALS)
def test_fuzzed_add_request_never_stops_the_engine(engine, request_id, tenant, priority,
                                                   arrival_time):
    """Whatever identity a caller passes, add_request either takes it or raises a ValueError
    naming it, and the engine then serves a normal request to the cache-free reference."""
    prompt = [3, 1, 4, 1, 5]
    try:
        engine.add_request(request_id, prompt, SamplingParams(max_new_tokens=2),
                           tenant=tenant, priority=priority, arrival_time=arrival_time)
        accepted = True
    except ValueError as e:
        assert "request" in str(e)
        accepted = False
    if accepted:  # Only text that goes through UTF-8 without control characters gets in.
        for name in (request_id, tenant):
            assert name is None or name_problem(name) is None
    engine.add_request("normal", prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert outs["normal"].outputs[0].token_ids == _reference(engine.model, tuple(prompt))
    assert set(outs) == ({"normal", request_id} if accepted else {"normal"})


_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def _reference(model, prompt: tuple[int, ...]) -> list[int]:
    if prompt not in _REFERENCE:
        _REFERENCE[prompt] = greedy_reference(model, list(prompt), 3)
    return _REFERENCE[prompt]
