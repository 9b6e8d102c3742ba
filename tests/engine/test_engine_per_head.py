"""The engine at kvpress's own granularity (`retention_schedule='per_head'`): every layer and kv
head keeps exactly the press's budget by its own scores, in head-major pages. Against numpy's
`BudgetScheme('per_head').select` over the simulated cache's scores (`kvjax.bench.budgets`):
the kept tokens of every (layer, kv head) table, the greedy tokens and logits of a cache
holding only them, and the pages the allocator holds (sum of ceil(B / P) one-head pages); with
a budget covering the prompt, exact KV's greedy tokens; no compile for a second request of
the same shapes (after warm-up: tests/engine/test_engine_adakv.py)."""

from __future__ import annotations

import numpy as np
import pytest
import test_engine_pyramid as pyramid_cases
from test_engine_adakv import predicted_pages
from test_engine_pyramid import engine_run, prompt_of

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.step import LogitsMode
from kvjax.testing import dense_logprobs, greedy_reference, tiny_model

P = pyramid_cases.P
BASE = dict(pyramid_cases.BASE, num_pages=256)  # pages of one head: K times as many
PRESSES = pyramid_cases.PRESSES


def per_head_config(press: str, budget: int) -> EngineConfig:
    return EngineConfig(**BASE, retention=press, retention_budget=budget,
                        retention_options=PRESSES[press][0], retention_schedule="per_head")


def kept_per_table(engine, seq_id: str, prompt_len: int) -> np.ndarray:
    """[L * K, S] bool: the prompt tokens each (layer, kv head) table holds, from the
    retention record (table 0's view, then the others')."""
    record = engine.retention.record(seq_id)
    kept = np.zeros((1 + len(record["groups"]), prompt_len), bool)
    for i, view in enumerate([record, *record["groups"]]):
        positions = np.asarray(view["positions"])
        kept[i, positions[positions < prompt_len]] = True
    return kept


@pytest.mark.parametrize("press,length,budget", [("snapkv", 40, 16),
                                                 ("expected_attention", 61, 24)])
def test_per_head_keeps_the_oracles_tokens_in_every_head(press, length, budget):
    model = tiny_model()
    engine = Engine(model, per_head_config(press, budget))
    prompt = prompt_of(length, seed=length)
    kept, k, v, last = pyramid_cases.simulated_kept(model, prompt, press, budget, "per_head")
    num_tables = model.config.num_layers * model.config.num_kv_heads
    assert (kept != kept[:, :1]).any(), "the case must give a layer's heads different tokens"

    engine.add_request("r", prompt, SamplingParams(max_new_tokens=4))
    engine.step()  # the whole prompt, then its compaction
    seq_id = engine.scheduler.running[0].seq_id
    np.testing.assert_array_equal(kept_per_table(engine, seq_id, length),
                                  kept.reshape(num_tables, length))
    held = engine.kv_cache.allocator.num_held_pages(seq_id)
    assert held == num_tables * -(-budget // P) == predicted_pages(
        engine, kept.sum(axis=2), length)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_cache.allocator.num_used_pages() == 0

    tokens, logits, _ = engine_run(engine, prompt, 6, LogitsMode.LAST)
    pyramid_cases.check_decode(model, engine, prompt, (kept, k, v, last), tokens, logits)


def test_per_head_with_a_budget_over_the_prompt_is_exact():
    model = tiny_model()
    prompt = prompt_of(40, seed=7)
    tokens, _, _ = engine_run(Engine(model, per_head_config("knorm", 48)), prompt, 6)
    assert tokens == greedy_reference(model, prompt, 6)


@pytest.mark.parametrize("attention_impl", ["native", "reference"])
def test_per_head_decode_logits_are_the_dense_forward_passes(attention_impl):
    """Decode steps over per-head tables (each (layer, kv head) table a row of its own in one
    attention call per layer) give the cache-free dense forward pass's logits, through the
    native kernel and the jnp reference alike."""
    model = tiny_model()
    prompt = prompt_of(40, seed=3)
    engine = Engine(model, EngineConfig(**BASE, retention="knorm", retention_budget=48,
                                        retention_schedule="per_head",
                                        attention_impl=attention_impl))
    tokens, logits, _ = engine_run(engine, prompt, 5, LogitsMode.LAST)
    expected = dense_logprobs(model, prompt + tokens)[len(prompt) - 1:-1]  # [5, V]
    got = np.stack(logits)
    got = got - np.log(np.exp(got - got.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - got.max(-1, keepdims=True)
    np.testing.assert_allclose(got, expected, atol=2e-4)
