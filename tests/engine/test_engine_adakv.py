"""The engine under AdaKV's head-wise split (`retention_schedule='adakv'`), against the
simulated cache of `kvjax.bench.budgets`, which decodes with each layer's kv head reading only
its kept prompt tokens: the same greedy tokens and logits, the pages the allocator holds equal
to what the KV spec predicts for the heads' budgets (head-major pages), no compile after
warm-up; the compatibility table's refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import test_engine_pyramid as pyramid_cases
from test_engine_pyramid import engine_run, prompt_of

from kvjax import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.step import LogitsMode
from kvjax.kv import budgets
from kvjax.kv.spec import KVCacheSpec
from kvjax.testing import TINY, tiny_model

P = pyramid_cases.P
BASE = dict(pyramid_cases.BASE, num_pages=256)  # pages of one head: K times as many
PRESSES = pyramid_cases.PRESSES


def adakv_config(press: str, budget: int, **extra) -> EngineConfig:
    return EngineConfig(**{**BASE, **extra}, retention=press, retention_budget=budget,
                        retention_options=PRESSES[press][0], retention_schedule="adakv")


def predicted_pages(engine, head_tokens: np.ndarray, num_tokens: int) -> int:
    """The engine's KV spec with each (layer, head) keeping head_tokens [L, K]: its pages."""
    spec = engine.kv_spec
    return KVCacheSpec(tuple(
        dataclasses.replace(g, spec=dataclasses.replace(
            g.spec, head_budgets=tuple(int(n) for n in head_tokens[g.layers[0]])))
        for g in spec.groups)).pages_held(num_tokens)


def check_against_simulation(model, engine, prompt, name, budget, num_new=6):
    """The engine's greedy tokens and logits are the simulated cache's; its pages after the
    prompt's compaction are the spec's for the heads' budgets; a second run of the same shapes
    compiles nothing."""
    tokens, logits, held = engine_run(engine, prompt, num_new, LogitsMode.LAST)
    kept, k, v, last = pyramid_cases.simulated_kept(model, prompt, name, budget, "adakv")
    head_tokens = kept.sum(axis=2)  # [L, K]
    assert (head_tokens.min(axis=1) < head_tokens.max(axis=1)).any(), \
        "the case must give a layer's heads different budgets"
    np.testing.assert_array_equal(head_tokens.sum(axis=1), model.config.num_kv_heads * budget)
    assert held == predicted_pages(engine, head_tokens, len(prompt)) == sum(
        -(-int(n) // P) for n in head_tokens.ravel())
    pyramid_cases.check_decode(model, engine, prompt, (kept, k, v, last), tokens, logits)


@pytest.mark.parametrize("press,length,budget", pyramid_cases.CASES)
def test_adakv_matches_simulated_cache_and_frees_pages(press, length, budget):
    model = tiny_model()
    engine = Engine(model, adakv_config(press, budget))
    check_against_simulation(model, engine, prompt_of(length, seed=length), press, budget)


@pytest.mark.parametrize("schedule", ["adakv", "per_head"])
def test_adakv_compiles_nothing_after_warmup(schedule):
    """Head-major tables, split by AdaKV or evenly (per_head), compile nothing once warm."""
    model = tiny_model()
    engine = Engine(model, EngineConfig(**BASE, retention="snapkv", retention_budget=16,
                                        retention_options=PRESSES["snapkv"][0],
                                        retention_schedule=schedule))
    warm = engine.warmup()
    tokens, _, _ = engine_run(engine, prompt_of(40, seed=40), 6)
    assert engine.num_compiles == warm, "a step or a compaction compiled after warm-up"
    assert len(tokens) == 6


@pytest.mark.parametrize("extra,match", [
    (dict(retention="h2o", retention_options=dict(num_recent=3)), "h2o"),
    (dict(kv_codec="kivi4", kv_codec_options=dict(group=4)), "one cached length"),
    (dict(fused_kv_write=True), "head-major page"),
])
def test_invalid_adakv_is_refused(extra, match):
    config = dict(BASE, retention="snapkv", retention_budget=16, retention_schedule="adakv",
                  retention_options=dict(window=4))
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{**config, **extra})


def test_sliding_window_model_refuses_adakv():
    model = tiny_model(dataclasses.replace(TINY, layer_windows=(8, 0), name="tiny-sw"))
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(model, adakv_config("snapkv", 16))


@pytest.mark.parametrize("press,length,budget", [("snapkv", 40, 16),
                                                 ("expected_attention", 61, 24)])
def test_pyramid_adakv_splits_each_layers_pyramid_budget_over_its_heads(press, length, budget):
    """retention_schedule='pyramid_adakv': each layer keeps its PyramidKV budget (more in
    lower layers) split over its kv heads by AdaKV; the kept tokens are numpy's selection over
    the same scores (`BudgetScheme.select`), so the greedy tokens and logits are the simulated
    cache's, and the pages held are the heads' budgets'."""
    model = tiny_model()
    engine = Engine(model, EngineConfig(**BASE, retention=press, retention_budget=budget,
                                        retention_options=PRESSES[press][0],
                                        retention_schedule="pyramid_adakv"))
    prompt = prompt_of(length, seed=length)
    tokens, logits, held = engine_run(engine, prompt, 6, LogitsMode.LAST)
    kept, k, v, last = pyramid_cases.simulated_kept(model, prompt, press, budget,
                                                    "pyramid+adakv")
    head_tokens = kept.sum(axis=2)  # [L, K]
    first, last_kept = engine.retention.policy.protected_tokens()
    layer_budgets = budgets.pyramid_budgets(model.config.num_layers, budget, length,
                                            window=first + last_kept)
    assert len(set(layer_budgets.tolist())) > 1, "the case must give layers different budgets"
    np.testing.assert_array_equal(head_tokens.sum(axis=1),
                                  model.config.num_kv_heads * layer_budgets)
    assert (head_tokens.min(axis=1) < head_tokens.max(axis=1)).any(), \
        "the case must give a layer's heads different budgets"
    assert held == predicted_pages(engine, head_tokens, len(prompt)) == sum(
        -(-int(n) // P) for n in head_tokens.ravel())
    pyramid_cases.check_decode(model, engine, prompt, (kept, k, v, last), tokens, logits)


@pytest.mark.parametrize("press,length,budget,head_floor", [("snapkv", 40, 16, None),
                                                            ("expected_attention", 61, 24, 0.0)])
def test_global_ranks_every_layers_heads_together(press, length, budget, head_floor):
    """retention_schedule='global' (KVzip's default): the model's L * K * B pairs are split
    over every (layer, kv head) table at once, so layers keep different totals; the kept
    tokens are numpy's selection over the same scores (`BudgetScheme.select`, with the
    engine's `retention_head_floor`), so the greedy tokens and logits are the simulated
    cache's, and the pages held are the heads' budgets'."""
    model = tiny_model()
    engine = Engine(model, EngineConfig(**BASE, retention=press, retention_budget=budget,
                                        retention_options=PRESSES[press][0],
                                        retention_schedule="global",
                                        retention_head_floor=head_floor))
    prompt = prompt_of(length, seed=length)
    tokens, logits, held = engine_run(engine, prompt, 6, LogitsMode.LAST)
    q, k, v, last = pyramid_cases.sim.capture_qkv(model, prompt)
    spec = pyramid_cases.sim.PressSpec(press, **PRESSES[press][1])
    first, last_kept = spec.protected(budget)
    options = {} if head_floor is None else dict(head_floor=head_floor)
    kept = budgets.BudgetScheme.named("global", **options).select(
        pyramid_cases.sim.layer_head_scores(q, k, v, spec, model.config.rope), budget,
        first=first, last=last_kept, rank=spec.rank)
    head_tokens = kept.sum(axis=2)  # [L, K]
    assert head_tokens.sum() == model.config.num_layers * model.config.num_kv_heads * budget
    assert len(set(head_tokens.sum(axis=1).tolist())) > 1, \
        "the case must give layers different totals"
    assert held == predicted_pages(engine, head_tokens, len(prompt)) == sum(
        -(-int(n) // P) for n in head_tokens.ravel())
    pyramid_cases.check_decode(model, engine, prompt, (kept, k, v, last), tokens, logits)


@pytest.mark.parametrize("schedule,head_floor,match", [
    ("per_head", 0.0, "splits none"), ("uniform", 0.5, "splits none"),
    ("adakv", 1.5, r"in \[0, 1\]"), ("global", True, r"in \[0, 1\]")])
def test_a_head_floor_needs_a_split_by_scores(schedule, head_floor, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**BASE, retention="snapkv", retention_budget=16,
                     retention_options=dict(window=4), retention_schedule=schedule,
                     retention_head_floor=head_floor)
