"""Prefix-cache isolation between tenants under a flood: with fair-share eviction, a tenant
flooding the cache with long distinct prompts evicts its own pages first, so another tenant's
cached system prompt survives; LRU (the default) gives it up. Tokens are the same either way
(greedy, exact KV): eviction only changes what is recomputed."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import Engine, EngineConfig, SamplingParams
from kvjax.testing import greedy_reference, tiny_model

SYSTEM = [7, 3, 9, 12, 30, 31, 2, 5]  # two pages of 4 tokens
FLOOD = [[int(t) for t in np.random.default_rng(i).integers(3, 120, 16)] for i in range(8)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _cached_tokens(engine: Engine, request_id: str, prompt, tenant: str) -> int:
    engine.add_request(request_id, prompt, SamplingParams(max_new_tokens=2, ignore_eos=True),
                       tenant=tenant)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = outs
    assert out.outputs[0].token_ids == greedy_reference(engine.model, prompt, 2)
    return out.num_cached_prompt_tokens


@pytest.mark.parametrize("eviction,survives", [("fair_share", True), ("lru", False)])
def test_a_flooding_tenant_evicts_its_own_pages_first(model, eviction, survives):
    engine = Engine(model, EngineConfig(page_size=4, num_pages=16, max_num_seqs=2,
                                        prefix_cache_eviction=eviction))
    victim = SYSTEM + [40, 41, 42]
    assert _cached_tokens(engine, "b0", victim, "b") == 0
    for i, prompt in enumerate(FLOOD):  # 8 x 4 full pages: twice the pool
        assert _cached_tokens(engine, f"a{i}", prompt, "a") == 0
    assert _cached_tokens(engine, "b1", SYSTEM + [50, 51, 52], "b") == (8 if survives else 0)
