"""Prefix-cache isolation between tenants under a flood: with fair-share eviction, a tenant
flooding the cache with long distinct prompts evicts its own pages first, so another tenant's
cached system prompt survives; LRU (the default) gives it up. Requests naming a cache salt
share pages across tenants; with hide_shared_prefix_hits a tenant hits only pages it paid
for. Tokens are the same either way (greedy, exact KV): the cache only changes what is
recomputed."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import Engine, EngineConfig, SamplingParams
from kvjax.memory.tiers import TierConfig
from kvjax.testing import greedy_reference, tiny_model

SYSTEM = [7, 3, 9, 12, 30, 31, 2, 5]  # two pages of 4 tokens
FLOOD = [[int(t) for t in np.random.default_rng(i).integers(3, 120, 16)] for i in range(8)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _cached_tokens(engine: Engine, request_id: str, prompt, tenant: str,
                   cache_salt: str | None = None) -> int:
    engine.add_request(request_id, prompt, SamplingParams(max_new_tokens=2, ignore_eos=True),
                       tenant=tenant, cache_salt=cache_salt)
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


@pytest.mark.parametrize("hide", [False, True])
def test_a_cache_salt_shares_pages_across_tenants_and_hiding_makes_each_pay_once(model, hide):
    """Tenants naming one cache salt share its pages (no salt: never); with
    hide_shared_prefix_hits each tenant's first request with a prefix runs as a miss, then
    hits, so no hit tells a tenant what another sent; the longer prompt of the other tenant
    hits only the pages this one paid for."""
    engine = Engine(model, EngineConfig(page_size=4, num_pages=32, max_num_seqs=2,
                                        hide_shared_prefix_hits=hide))
    prompt = SYSTEM + [40, 41, 42]  # 2 full pages before the last token
    assert _cached_tokens(engine, "a0", prompt, "a", cache_salt="s") == 0
    assert _cached_tokens(engine, "b0", prompt, "b") == 0  # no salt: b's own pages
    assert _cached_tokens(engine, "b1", prompt, "b", cache_salt="s") == (0 if hide else 8)
    assert _cached_tokens(engine, "b2", prompt, "b", cache_salt="s") == 8
    assert _cached_tokens(engine, "a1", prompt, "a", cache_salt="s") == 8
    longer = SYSTEM + [40, 41, 42, 43, 60, 61, 62, 63, 7]  # 4 full pages; b paid for 2
    assert _cached_tokens(engine, "a2", longer, "a", cache_salt="s") == 8
    assert _cached_tokens(engine, "b3", longer, "b", cache_salt="s") == (8 if hide else 16)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("bad", prompt, cache_salt="\ud800")


@pytest.mark.parametrize("hide", [False, True])
def test_hidden_hits_stay_hidden_when_the_pages_come_back_from_the_host_tier(model, hide):
    """Shared pages evicted to the host tier load back only within what the tenant paid for."""
    engine = Engine(model, EngineConfig(page_size=4, num_pages=16, max_num_seqs=2,
                                        hide_shared_prefix_hits=hide,
                                        tiers=TierConfig(host_bytes=1 << 20)))
    prompt = SYSTEM + [40, 41, 42]
    assert _cached_tokens(engine, "a0", prompt, "a", cache_salt="s") == 0
    for i, flood in enumerate(FLOOD):  # twice the pool: a's pages go to the host tier
        _cached_tokens(engine, f"f{i}", flood, "f")
    assert engine.stats["tier_hit_tokens"] == 0
    assert _cached_tokens(engine, "b0", prompt, "b", cache_salt="s") == (0 if hide else 8)
    assert engine.stats["tier_hit_tokens"] == (0 if hide else 8)
