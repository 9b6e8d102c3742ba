"""The engine under PyramidKV's per-layer budgets (`retention_schedule='pyramid'`), against the
simulated cache of `kvjax.bench.budgets`, which decodes with each layer reading only its kept
prompt tokens: the same greedy tokens and logits, the pages the allocator holds equal to the
per-layer budgets' (`budgets.pages_held`), no compile after warm-up; the compatibility
table's refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.bench import budgets as sim
from kvjax.engine.engine import Engine
from kvjax.engine.step import LogitsMode
from kvjax.kv import budgets
from kvjax.testing import TINY, tiny_model

P = 4
BASE = dict(page_size=P, max_num_batched_tokens=64, max_prefill_chunk=64, min_chunk_bucket=16,
            max_num_seqs=2, max_prefill_seqs=1, num_pages=128, max_model_len=128,
            enable_prefix_cache=False)


# Each press's engine options and the simulated cache's `PressSpec` of the same scores.
PRESSES = dict(
    snapkv=(dict(window=4, kernel=3), dict(window=4, kernel=3)),
    knorm=({}, {}),
    observed_attention=({}, {}),
    expected_attention=(dict(num_sinks=2, num_future=16), dict(num_sinks=2, num_future=16)),
)


def pyramid_config(press: str, budget: int, **extra) -> EngineConfig:
    return EngineConfig(**{**BASE, **extra}, retention=press, retention_budget=budget,
                        retention_options=PRESSES[press][0], retention_schedule="pyramid")


def prompt_of(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 120, size=length)]


def simulated_kept(model, prompt, name, budget, scheme="pyramid"):
    """[L, K, S] the tokens each layer's kv head keeps in the simulated cache under `scheme`,
    and its captured K/V."""
    q, k, v, last = sim.capture_qkv(model, prompt)
    press = sim.PressSpec(name, **PRESSES[name][1])
    scores = sim.layer_head_scores(q, k, v, press, model.config.rope)
    first, last_kept = press.protected(budget)
    kept = budgets.BudgetScheme.named(scheme).select(scores, budget, first=first,
                                                     last=last_kept, rank=press.rank)
    return kept, k, v, last


def engine_run(engine, prompt, num_new, logits_mode=LogitsMode.NONE):
    """(tokens, per-step logits, pages held right after the prompt's compaction)."""
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=num_new))
    held, logits, tokens = None, [], None
    while engine.has_unfinished():
        for output in engine.step(logits_mode=logits_mode):
            tokens = output.outputs[0].token_ids
        if logits_mode is LogitsMode.LAST:
            logits.append(np.asarray(engine.last_logits)[0])
        if held is None:
            seq = engine.scheduler.running[0].seq_id
            held = engine.kv_cache.allocator.num_held_pages(seq)
    return tokens, logits, held


def check_against_simulation(model, engine, prompt, name, budget, num_new=6):
    """The engine's greedy tokens and logits are the simulated cache's; its pages after the
    prompt's compaction are the per-layer budgets'; a second run of the same shapes compiles
    nothing."""
    tokens, logits, held = engine_run(engine, prompt, num_new, LogitsMode.LAST)
    kept, k, v, last = simulated_kept(model, prompt, name, budget)
    layer_budgets = kept.sum(axis=2).max(axis=1)
    assert len(set(layer_budgets.tolist())) > 1, "the case must give layers different budgets"
    assert held == budgets.pages_held(kept, P) == sum(-(-int(b) // P) for b in layer_budgets)
    assert held < model.config.num_layers * -(-len(prompt) // P)
    check_decode(model, engine, prompt, (kept, k, v, last), tokens, logits)
    return tokens


def check_decode(model, engine, prompt, simulated, tokens, logits):
    """The engine's greedy `tokens` and `logits` are those of the simulated cache (kept,
    k, v, last: `simulated_kept`); a second run of the same shapes compiles nothing."""
    kept, k, v, last = simulated
    want = np.concatenate([last[None], sim.continuation_logits(model, k, v, kept,
                                                               tokens[:-1])])  # [T, V]
    assert tokens == want.argmax(-1).tolist()
    np.testing.assert_allclose(np.stack(logits), want, rtol=1e-4, atol=1e-4)
    compiles = engine.num_compiles
    again, _, _ = engine_run(engine, prompt, len(tokens), LogitsMode.LAST)
    assert again == tokens
    assert engine.num_compiles == compiles, "a request of the same shapes compiled"


# (press, prompt length, budget) of the engine-against-simulation cases.
CASES = [("snapkv", 40, 16), ("snapkv", 61, 24), ("knorm", 40, 16),
         ("observed_attention", 40, 16), ("expected_attention", 40, 16)]


@pytest.mark.parametrize("press,length,budget", CASES)
def test_pyramid_matches_simulated_cache_and_frees_pages(press, length, budget):
    model = tiny_model()
    engine = Engine(model, pyramid_config(press, budget))
    check_against_simulation(model, engine, prompt_of(length, seed=length), press, budget)


def test_pyramid_compiles_nothing_after_warmup():
    model = tiny_model()
    engine = Engine(model, pyramid_config("snapkv", 16))
    warm = engine.warmup()
    tokens, _, _ = engine_run(engine, prompt_of(40, seed=40), 6)
    assert engine.num_compiles == warm, "a step or a compaction compiled after warm-up"
    assert len(tokens) == 6


@pytest.mark.parametrize("extra,match", [
    (dict(retention="none", retention_budget=None, retention_options={}), "is none"),
    (dict(retention_schedule="cone"), "must be one of"),
])
def test_invalid_schedule_is_refused(extra, match):
    config = dict(BASE, retention="snapkv", retention_budget=16, retention_schedule="pyramid",
                  retention_options=dict(window=4))
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{**config, **extra})


def test_sliding_window_model_refuses_pyramid():
    model = tiny_model(dataclasses.replace(TINY, layer_windows=(8, 0), name="tiny-sw"))
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(model, pyramid_config("snapkv", 16))


def test_admission_counts_the_whole_prompt_in_every_table():
    """Before the press decides, every table group holds the whole prompt: a request whose
    prompt and output need more pages over the tables than the pool has is refused alone."""
    model = tiny_model()
    length, num_new = 40, 6
    need = model.config.num_layers * -(-(length + num_new) // P)  # one-layer tables here
    engine = Engine(model, pyramid_config("snapkv", 16, num_pages=need - 1))
    with pytest.raises(ValueError, match=f"request 'r' needs {need} KV pages"):
        engine.add_request("r", prompt_of(length, seed=0), SamplingParams(max_new_tokens=num_new))
    fits = Engine(model, pyramid_config("snapkv", 16, num_pages=need))
    fits.add_request("r", prompt_of(length, seed=0), SamplingParams(max_new_tokens=num_new))
