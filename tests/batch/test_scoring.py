"""Prefill-only scoring, layer by layer, against the dense forward pass."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.batch import PrefillOnlyScorer, run_batch
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.models.scoring import _layer_pass
from kvjax.sampling import SamplingParams
from kvjax.testing import dense_logprobs, tiny_model

# Four 16-token pages of all-layer KV: 64 tokens in the engine, 128 per layer (L = 2).
SMALL_POOL = EngineConfig(num_pages=4, page_size=16, max_num_seqs=1)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def dense_continuation_logprobs(model, prompt, continuation) -> np.ndarray:
    rows = dense_logprobs(model, prompt + continuation)
    return np.array([rows[len(prompt) - 1 + j, t] for j, t in enumerate(continuation)])


def test_scores_equal_the_dense_forward_pass(model):
    scorer = PrefillOnlyScorer(model, kv_budget_bytes=1 << 20, chunk=16)
    rng = np.random.default_rng(0)
    for num_prompt in (5, 37):  # One chunk, and several chunks with the prompt across two.
        prompt, continuation = rng.integers(0, 127, num_prompt).tolist(), [4, 9, 1]
        np.testing.assert_allclose(scorer.score("q", prompt, continuation),
                                   dense_continuation_logprobs(model, prompt, continuation),
                                   atol=1e-5)
    top = scorer.top_next("q", [3, 4, 5], 4)
    expected = dense_logprobs(model, [3, 4, 5])[-1]
    assert [t for t, _ in top] == np.argsort(-expected)[:4].tolist()
    np.testing.assert_allclose([p for _, p in top], np.sort(expected)[::-1][:4], atol=1e-5)


def test_an_input_too_long_for_the_kv_pool_scores_prefill_only(model):
    engine = Engine(model, SMALL_POOL)
    prompt, continuation = np.random.default_rng(1).integers(0, 127, 100).tolist(), [7, 8]
    with pytest.raises(ValueError, match="KV pages"):
        engine.add_request("long", prompt + continuation, SamplingParams(max_new_tokens=1))
    scorer = PrefillOnlyScorer(model, kv_budget_bytes=engine.num_pages * engine.kv_bytes_per_page,
                               chunk=16)
    assert scorer.max_tokens == model.config.num_layers * engine.num_pages * 16
    np.testing.assert_allclose(scorer.score("long", prompt, continuation),
                               dense_continuation_logprobs(model, prompt, continuation),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="'longer'.*prefill-only limit of 128"):
        scorer.score("longer", prompt, list(range(40)))


def test_lengths_in_one_bucket_compile_once(model):
    scorer = PrefillOnlyScorer(model, kv_budget_bytes=1 << 20, chunk=16)
    scorer.score("a", list(range(1, 40)), [5])
    compiled = _layer_pass.num_compiles
    scorer.score("b", list(range(1, 50)), [5, 6])
    assert _layer_pass.num_compiles == compiled


def test_score_lines_in_a_batch_job(model, tmp_path):
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"id": "s", "prompt_ids": [3, 4, 5], "score": [[6, 7], [8]]}) + "\n"
        + json.dumps({"id": "k", "prompt_ids": [3, 4, 5], "next_top_k": 2}) + "\n")
    run_batch(model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine_config=SMALL_POOL)
    line, top = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    expected = dense_continuation_logprobs(model, [3, 4, 5], [6, 7])
    np.testing.assert_allclose(line["scores"][0]["token_logprobs"], expected, atol=1e-5)
    assert line["scores"][0]["logprob"] == pytest.approx(expected.sum(), abs=1e-5)
    assert len(line["scores"][1]["token_logprobs"]) == 1
    assert [t for t, _ in top["top_logprobs"]] == np.argsort(
        -dense_logprobs(model, [3, 4, 5])[-1])[:2].tolist()
