"""Budget schemes (kvjax.kv.budgets): per-layer (PyramidKV) and per-head (AdaKV, per_head,
global) kept sets against float64 numpy references computed from a dense forward pass's Q/K/V,
and the pages a grouped allocator holds for them.

The kvjax side scores with `kvjax.bench.budgets.layer_head_scores` (jax, float32) and selects
with `BudgetScheme.select`; the reference scores each (layer, kv head) with the loops of
tests/presses_reference.py in float64 and selects with its own loops.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from presses_reference import (
    adakv_keep,
    head_attention,
    head_expected_attention,
    head_knorm,
    keep,
)

from kvjax.bench import budgets as bench_budgets
from kvjax.kv.budgets import (
    BudgetScheme,
    adakv_head_budgets,
    budget_layer_groups,
    layer_slots,
    pages_held,
    pyramid_budgets,
)
from kvjax.kv.spec import TokenFormat, cache_spec
from kvjax.memory.block_manager import AllocStatus
from kvjax.memory.groups import GroupedBlockManager
from kvjax.models import llama
from kvjax.testing import TINY, tiny_model

P = 4
BUDGET = 16
CONFIG = dataclasses.replace(TINY, num_layers=4)
SCHEMES = ("uniform", "pyramid", "adakv", "pyramid+adakv", "per_head", "global")


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=3)


@pytest.fixture(scope="module")
def captured(model):
    """A 40-token prompt's dense-forward Q/K/V and last logits. No token repeats: a repeated
    token's first-layer keys differ only by RoPE, which keeps their norms exactly tied."""
    tokens = np.random.default_rng(1).permutation(CONFIG.vocab_size - 1)[:40].tolist()
    return tokens, bench_budgets.capture_qkv(model, tokens)


def press_of(name: str) -> bench_budgets.PressSpec:
    return bench_budgets.PressSpec(name, window=4, num_sinks=2, num_future=16)


def reference_scores(name: str, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """[L, K, S] float64 per-(layer, kv head) scores from the loops of presses_reference."""
    s = q.shape[1]
    inv_freq = CONFIG.rope.inv_freq(CONFIG.head_dim)
    per_layer = {
        "snapkv": lambda i: head_attention(q[i], k[i], s - 4),
        "tova": lambda i: head_attention(q[i], k[i], s - 1),
        "h2o": lambda i: head_attention(q[i], k[i], 0),
        "observed_attention": lambda i: head_attention(q[i], k[i], 0),
        "knorm": lambda i: head_knorm(k[i]),
        "expected_attention": lambda i: head_expected_attention(
            q[i], k[i], v[i], inv_freq, num_future=16, num_sinks=2, covariance=True,
            vnorm=True),
    }[name]
    return np.stack([per_layer(i) for i in range(len(q))])


def reference_rank(name: str, row: np.ndarray) -> np.ndarray:
    """SnapKV's max over 5 neighbours (clipped at the ends); observed attention's mean."""
    if name == "snapkv":
        return np.array([row[max(0, i - 2):i + 3].max() for i in range(len(row))])
    if name == "observed_attention":
        return np.array([row[i] / (len(row) - i) for i in range(len(row))])
    return row


def reference_kept(name: str, scheme: str, scores: np.ndarray, first: int, last: int
                   ) -> np.ndarray:
    num_layers, k_heads, s = scores.shape
    budgets = (pyramid_budgets(num_layers, BUDGET, s, window=first + last) if "pyramid" in scheme
               else [BUDGET] * num_layers)
    kept = np.zeros(scores.shape, bool)
    kept[:, :, :first] = kept[:, :, s - last:] = True
    if scheme == "uniform":
        row = reference_rank(name, scores.sum(axis=(0, 1))[first:s - last])
        kept[:, :, np.array(keep(row, BUDGET - first - last), int) + first] = True
        return kept
    if scheme == "global":  # AdaKV over every (layer, kv head) of the model at once
        rows = [reference_rank(name, scores[layer, h, first:s - last])
                for layer in range(num_layers) for h in range(k_heads)]
        for t, chosen in enumerate(adakv_keep(np.stack(rows), BUDGET - first - last, 0.2)):
            kept[t // k_heads, t % k_heads, np.array(chosen, int) + first] = True
        return kept
    for layer, budget in enumerate(budgets):
        count = int(budget) - first - last
        rows = [reference_rank(name, scores[layer, h, first:s - last]) for h in range(k_heads)]
        if "adakv" in scheme:
            for h, chosen in enumerate(adakv_keep(np.stack(rows), count, 0.2)):
                kept[layer, h, np.array(chosen, int) + first] = True
        elif scheme == "per_head":  # each head its own best `count`
            for h, row in enumerate(rows):
                kept[layer, h, np.array(keep(row, count), int) + first] = True
        else:
            row = reference_rank(name, scores[layer].sum(axis=0)[first:s - last])
            kept[layer, :, np.array(keep(row, count), int) + first] = True
    return kept


@pytest.mark.parametrize("name", bench_budgets.PRESSES)
def test_kept_sets_per_layer_and_head_equal_the_float64_reference(captured, name):
    _, (q, k, v, _) = captured
    press = press_of(name)
    first, last = press.protected(BUDGET)
    got_scores = bench_budgets.layer_head_scores(q, k, v, press, CONFIG.rope)
    want_scores = reference_scores(name, q, k, v)
    np.testing.assert_allclose(got_scores, want_scores, rtol=2e-4, atol=1e-6)
    for scheme in SCHEMES:
        got = BudgetScheme.named(scheme).select(got_scores, BUDGET, first=first,
                                                          last=last, rank=press.rank)
        want = reference_kept(name, scheme, want_scores, first, last)
        np.testing.assert_array_equal(got, want, err_msg=f"{name}/{scheme}")
        per_head = got.sum(axis=2)  # [L, K]
        if "pyramid" in scheme or scheme == "global":
            assert len(set(per_head.sum(axis=1).tolist())) > 1, "the layers' shares differ"
        if scheme in ("uniform", "pyramid"):
            assert (got == got[:, :1]).all(), "every head of a layer keeps the same tokens"
        if scheme == "per_head":
            assert (per_head == BUDGET).all(), "every head keeps exactly the budget"
            assert (got != got[:, :1]).any(), "heads rank by their own scores"
        assert per_head.sum() == CONFIG.num_layers * CONFIG.num_kv_heads * BUDGET


def test_adakv_moves_budget_to_the_heads_with_spread_scores():
    rng = np.random.default_rng(0)
    peaked = np.zeros(50)
    peaked[:3] = 1.0
    spread = rng.uniform(0.1, 0.2, 50)
    counts = adakv_head_budgets(np.stack([peaked, spread]), 10, 0.2)
    # Each head first takes its 2 best (the floor, 0.2 * 10); of the 16 pairs left the peaked
    # head's third token (1.0) is the best, and every spread score beats its zeros.
    assert counts.tolist() == [3, 17]
    assert adakv_head_budgets(np.stack([peaked, spread]), 10, 1.0).tolist() == [10, 10]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_grouped_allocator_holds_exactly_the_budget_sum(captured, scheme):
    _, (q, k, v, _) = captured
    press = press_of("snapkv")
    first, last = press.protected(BUDGET)
    scores = bench_budgets.layer_head_scores(q, k, v, press, CONFIG.rope)
    kept = BudgetScheme.named(scheme).select(scores, BUDGET, first=first, last=last,
                                                       rank=press.rank)
    size = kept.shape[2]
    slots = layer_slots(kept)
    spec = cache_spec(budget_layer_groups(slots, TokenFormat.kv_heads(CONFIG.num_kv_heads,
                                                                     CONFIG.head_dim)),
                      codec_name="none", page_size=P, tensor_bytes=lambda h, w: 4 * h * w)
    tables = spec.table_groups()
    num_pages = 2 * len(tables) * -(-size // P)
    manager = GroupedBlockManager(num_pages, P, [t.window for t in tables],
                                  enable_prefix_cache=False)
    manager.add_sequence("s", list(range(size)), indexable=False)
    assert manager.ensure_writable("s", 0, size)[0] is AllocStatus.OK
    assert manager.num_held_pages("s") == len(tables) * -(-size // P)
    per_table = [int(slots[t.layers[0]]) for t in tables]
    status, moves, freed = manager.retain_groups("s", [np.arange(n) for n in per_table])
    assert status is AllocStatus.OK
    want = sum(-(-per // P) for per in per_table)  # pages of one table (its layers)
    assert manager.num_held_pages("s") == want == spec.pages_held(size)
    assert pages_held(kept, P) == sum(-(-per // P) * len(t.layers)
                                      for per, t in zip(per_table, tables, strict=True))
    assert manager.num_free_pages() + manager.num_held_pages("s") == num_pages
    assert len(freed) == len(tables) * -(-size // P) - want
    if scheme == "uniform":
        assert want == len(tables) * -(-BUDGET // P)
    per_head = kept.reshape(-1, 1, size)  # one table per (layer, kv head), pages of one head
    assert bench_budgets.allocator_pages(per_head, P) == sum(
        -(-int(n) // P) for n in kept.sum(axis=2).ravel())
    with pytest.raises(ValueError, match="kept-token lists"):
        manager.retain_groups("s", [np.arange(2)] * (len(tables) + 1))


def test_the_simulated_cache_keeping_everything_is_the_dense_forward(model, captured):
    tokens, (q, k, v, last) = captured
    scores = bench_budgets.layer_head_scores(q, k, v, press_of("snapkv"), CONFIG.rope)
    for scheme in SCHEMES:  # a budget covering the prompt keeps all of it, in every scheme
        every = BudgetScheme.named(scheme).select(scores, len(tokens), last=4)
        assert every.all(), scheme
    cont = [5, 9, 17, 2]
    got = bench_budgets.continuation_logits(model, k, v, every, cont)
    compiles = bench_budgets._continuation.num_compiles
    dense = np.asarray(llama.forward_dense(model.params, CONFIG, np.asarray(tokens + cont)))
    np.testing.assert_allclose(last, dense[len(tokens) - 1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, dense[len(tokens):], rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == dense[len(tokens):].argmax(-1)).all()
    kept = BudgetScheme.named("pyramid+adakv").select(
        np.random.default_rng(0).random(every.shape), BUDGET)
    masked = bench_budgets.continuation_logits(model, k, v, kept, cont)
    assert not np.allclose(masked, got), "keeping fewer tokens changes the logits"
    assert bench_budgets._continuation.num_compiles == compiles, "one program per shape"


def test_budget_schemes_reject_bad_options():
    for kwargs, match in [(dict(schedule="cone"), "budget_schedule"),
                          (dict(head_allocation="snap"), "head_allocation"),
                          (dict(head_floor=1.5), "head_floor"), (dict(beta=0.5), "beta")]:
        with pytest.raises(ValueError, match=match):
            BudgetScheme(**kwargs)
    for name in ("uniform+adakv", "adakv+per_head", "pyramid+pyramid", "per-head"):
        with pytest.raises(ValueError, match="unknown budget scheme"):
            BudgetScheme.named(name)
    with pytest.raises(ValueError, match="cannot keep"):
        BudgetScheme().select(np.zeros((2, 2, 10)), 4, first=3, last=2)
    with pytest.raises(ValueError, match="unknown press"):
        bench_budgets.PressSpec("quest")
    assert BudgetScheme.named("pyramid+adakv").name == "pyramid+adakv"
    with pytest.raises(ValueError, match="sets the layers' shares"):
        BudgetScheme.named("pyramid+global")
