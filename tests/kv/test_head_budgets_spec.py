"""Per-head budgets in the KV spec (head-major pages, one block table per (layer run, kv head)):
bytes against the buffers of a head-major pool, pages held against brute-force page counts and
against a grouped block manager that compacts each head's table to its budget."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.config import ModelConfig
from kvjax.kv import spec as kv_spec
from kvjax.kv.state import exact_cache_spec, init_paged_kv
from kvjax.memory.block_manager import AllocStatus
from kvjax.memory.groups import GroupedBlockManager

CONFIG = ModelConfig(vocab_size=16, hidden_size=48, intermediate_size=32, num_layers=3,
                     num_heads=6, num_kv_heads=3, head_dim=16, name="head-spec-test")


def head_groups(num_layers, num_kv_heads, head_budgets, *, run=1, head_dim=4):
    """One head-major budget group per run of `run` layers, each head keeping head_budgets[i]
    (a list per group)."""
    fmt = kv_spec.TokenFormat.kv_heads(num_kv_heads, head_dim)
    return [kv_spec.LayerGroup(tuple(range(i * run, (i + 1) * run)), fmt, kv_spec.TokenKeep.BUDGET,
                               max(b), head_major=True, head_budgets=tuple(b))
            for i, b in enumerate(head_budgets)]


def brute_force_pages(tables_tokens, page_size):
    """Pages block tables hold whose table t keeps tokens in slots 0..n_t-1: distinct slot
    pages, counted slot by slot."""
    return sum(len({slot // page_size for slot in range(n)}) for n in tables_tokens)


def test_head_major_pool_bytes_match_its_buffers():
    """A head-major pool's page holds P tokens of one kv head: the spec's bytes for N pages
    are the bytes of a pool of N one-head pages."""
    groups = head_groups(3, 3, [[5, 9, 2], [4, 4, 4], [1, 8, 3]], head_dim=16)
    spec = exact_cache_spec(CONFIG, 8, np.float32, groups)
    kv = init_paged_kv(CONFIG, 7, 8, np.float32, num_layers=spec.layers_per_table,
                       num_kv_heads=1)
    assert spec.nbytes(7) == kv.k_pages.nbytes + kv.v_pages.nbytes
    assert spec.page_bytes * CONFIG.num_kv_heads == exact_cache_spec(CONFIG, 8, np.float32
                                                                     ).page_bytes / 3
    assert len(spec.table_groups()) == 9
    assert [t.head for t in spec.table_groups()] == [0, 1, 2] * 3


@pytest.mark.parametrize("budgets,num_tokens,page_size", [
    ([[5, 9, 2], [4, 4, 4]], 20, 4), ([[1, 30, 7]], 12, 8), ([[16, 16], [3, 17]], 40, 16)])
def test_pages_held_match_brute_force(budgets, num_tokens, page_size):
    groups = head_groups(len(budgets), len(budgets[0]), budgets)
    spec = kv_spec.cache_spec(groups, codec_name="none", page_size=page_size,
                              tensor_bytes=lambda h, w: 4.0 * h * w)
    kept = [min(num_tokens, b) for per_layer in budgets for b in per_layer]
    assert spec.pages_held(num_tokens) == brute_force_pages(kept, page_size)
    assert spec.pages_held(num_tokens) == kv_spec.pages_for_tokens(kept, page_size)
    token_bytes = spec.groups[0].spec.token_bytes / len(budgets[0])  # one head, one layer
    assert spec.bytes_held(num_tokens) == pytest.approx(token_bytes * sum(kept))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_compacting_each_head_holds_the_predicted_pages_and_leaks_none(data):
    """A sequence written into every (run, head) table, then compacted to random per-head
    budgets (random kept tokens), holds sum over tables of ceil(budget / P) pages, as the
    spec predicts; tables share no page; freeing it returns every page."""
    num_runs = data.draw(st.integers(1, 3))
    run = data.draw(st.integers(1, 2))
    num_heads = data.draw(st.integers(1, 4))
    page_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    num_tokens = data.draw(st.integers(1, 40))
    budgets = data.draw(st.lists(st.lists(st.integers(1, 48), min_size=num_heads,
                                          max_size=num_heads),
                                 min_size=num_runs, max_size=num_runs))
    spec = kv_spec.cache_spec(head_groups(num_runs * run, num_heads, budgets, run=run),
                              codec_name="none", page_size=page_size,
                              tensor_bytes=lambda h, w: 2.0 * h * w)
    tables = spec.table_groups()
    assert len(tables) == num_runs * num_heads
    num_pages = 2 * len(tables) * math.ceil(num_tokens / page_size)
    alloc = GroupedBlockManager(num_pages, page_size, [t.window for t in tables],
                                enable_prefix_cache=False)
    alloc.add_sequence("s", list(range(num_tokens)), indexable=False)
    assert alloc.ensure_writable("s", 0, num_tokens)[0] is AllocStatus.OK
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    keeps = [np.sort(rng.choice(num_tokens, min(num_tokens, t.budget), replace=False))
             for t in tables]
    status, _, freed = alloc.retain_groups("s", keeps)
    assert status is AllocStatus.OK
    assert alloc.num_held_pages("s") == spec.pages_held(num_tokens)
    pages = [p for table in alloc.block_tables("s") for p in table]
    assert len(pages) == len(set(pages)) == spec.pages_held(num_tokens)
    assert alloc.num_free_pages() == num_pages - spec.pages_held(num_tokens)
    alloc.free("s")
    assert alloc.num_free_pages() == num_pages


@pytest.mark.parametrize("kwargs,match", [
    (dict(keep=kv_spec.TokenKeep.ALL, num_keep_tokens=0, head_major=True), "retention budget"),
    (dict(head_budgets=(4, 4, 4)), "need head-major pages"),
    (dict(head_major=True, head_budgets=(4, 4)), "one budget per kv head"),
    (dict(head_major=True, head_budgets=(4, 0, 4)), "positive int"),
])
def test_invalid_head_budgets_are_refused(kwargs, match):
    fmt = kv_spec.TokenFormat.kv_heads(3, 4)
    args = dict(keep=kv_spec.TokenKeep.BUDGET, num_keep_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        kv_spec.LayerGroup((0,), fmt, **args)


def test_head_major_and_shared_pages_do_not_mix_in_one_pool():
    fmt = kv_spec.TokenFormat.kv_heads(2, 4)
    groups = [kv_spec.LayerGroup((0,), fmt, kv_spec.TokenKeep.BUDGET, 4, head_major=True),
              kv_spec.LayerGroup((1,), fmt, kv_spec.TokenKeep.BUDGET, 4)]
    spec = kv_spec.cache_spec(groups, codec_name="none", page_size=4,
                              tensor_bytes=lambda h, w: 4.0 * h * w)
    with pytest.raises(ValueError, match="share a page format"):
        spec.check_servable()


@pytest.mark.parametrize("name,options", [("int8", {}), ("int4", {"group": 8}),
                                          ("fp8_e4m3", {})])
def test_quantized_head_major_pool_bytes_match_its_buffers(name, options):
    """A quantized head-major pool: the spec's bytes for N pages are the bytes of the codes
    and scales of a pool of N one-head pages."""
    import jax

    from kvjax.kv import quantized

    groups = head_groups(3, 3, [[5, 9, 2], [4, 4, 4], [1, 8, 3]], head_dim=16)
    spec = quantized.cache_spec(CONFIG, 8, name, groups, **options)
    kv = quantized.init_quantized_kv(CONFIG, 7, 8, name, num_layers=spec.layers_per_table,
                                     num_kv_heads=1, **options)
    assert spec.nbytes(7) == sum(x.nbytes for x in jax.tree.leaves(kv))
