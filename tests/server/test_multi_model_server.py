"""One server, two models on one shared KV budget: requests are routed by their `model`.

Oracle: each model's cache-free greedy reference, through the official `openai` client.
"""

from __future__ import annotations

import dataclasses

import openai
import pytest

from kvjax import EngineConfig
from kvjax.engine.multi import ModelSpec, MultiModelEngine, PoolConfig
from kvjax.server import BackgroundServer, ServerConfig
from kvjax.testing import TINY, greedy_reference, tiny_model, tiny_tokenizer

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=32,
                      min_chunk_bucket=32, max_prefill_seqs=1, max_model_len=64)


@pytest.fixture(scope="module")
def models():
    other = dataclasses.replace(TINY, num_layers=3, num_kv_heads=1, num_heads=2, name="other")
    return {"tiny-a": dataclasses.replace(tiny_model(), tokenizer=tiny_tokenizer()),
            "tiny-b": dataclasses.replace(tiny_model(other, seed=3), tokenizer=tiny_tokenizer())}


def test_requests_run_on_the_model_they_name(models):
    weights = sum(m.nbytes for m in models.values())
    mm = MultiModelEngine({name: ModelSpec(m, CONFIG) for name, m in models.items()},
                          PoolConfig(budget_bytes=weights + (64 << 10), page_tokens=8))
    with BackgroundServer(mm, ServerConfig(model_name="tiny-a")) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                               max_retries=0, timeout=60)
        assert {m.id for m in client.models.list()} == set(models)
        prompt = [5, 9, 20, 33, 40]
        for name, model in models.items():
            got = client.completions.create(model=name, prompt=prompt, max_tokens=8,
                                            temperature=0)
            want = greedy_reference(model, prompt, 8, stop=(127,))
            assert got.choices[0].text == model.tokenizer.decode(want)
        with pytest.raises(openai.NotFoundError, match="serves `tiny-a`, `tiny-b`"):
            client.completions.create(model="nope", prompt=prompt, max_tokens=2)
