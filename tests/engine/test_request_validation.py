"""Malformed requests through the Python API: each is a ValueError naming the request and the
value, and changes nothing (the HTTP server maps the same refusals to 400s)."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax import Engine, EngineConfig, SamplingParams
from kvjax.testing import tiny_model


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
