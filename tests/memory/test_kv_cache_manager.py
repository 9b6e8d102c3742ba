"""The KV cache manager over a small real page pool: allocation, sharing, copies, scrubbing,
swapping and the page-version ledger, each checked on the pool's contents."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import ModelConfig
from kvjax.engine.swap import HostSwapSpace
from kvjax.kv.retention import RetentionManager, make_retention
from kvjax.kv.state import PagedKV
from kvjax.memory.block_manager import BlockManager
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.memory.ops import HostKV, KVOpKind

P = 4
CONFIG = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=16, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=64,
                     name="fake")


def page_filled_pool(num_pages: int) -> PagedKV:
    """Page p holds the value p + 1 everywhere (K) and -(p + 1) (V)."""
    shape = (CONFIG.num_layers, num_pages, P, CONFIG.num_kv_heads, CONFIG.head_dim)
    k = jnp.broadcast_to(jnp.arange(1, num_pages + 1, dtype=jnp.float32)[None, :, None, None,
                                                                           None], shape)
    return PagedKV(k_pages=k, v_pages=-k)


def make_manager(num_pages: int = 8, *, scrub: bool = False, watermark: float = 0.0):
    device = HostKV(page_filled_pool(num_pages))
    manager = KVCacheManager(device, BlockManager(num_pages, P), HostSwapSpace(),
                             RetentionManager(make_retention("none", None, P)), page_size=P,
                             watermark=watermark, scrub_freed_pages=scrub, stats={})
    return manager, device


def page(device: HostKV, p: int) -> np.ndarray:
    return np.asarray(device.kv.k_pages[:, p])


def test_fork_then_write_copies_the_shared_partial_page():
    manager, device = make_manager()
    manager.lookup("a", [1, 2, 3, 4, 5, 6], b"")
    assert manager.allocate("a", 0, 6)
    manager.commit("a", [1, 2, 3, 4, 5, 6])
    assert manager.fork("a", "b")
    shared = manager.block_table("a")
    assert manager.block_table("b") == shared
    device.ops.clear()
    assert manager.allocate("b", 6, 7)  # b writes into the shared partial page: copy-on-write
    (op,) = [o for o in device.ops if o.kind is KVOpKind.COPY]
    new = manager.block_table("b")[1]
    assert op.pages == (new,) and new != shared[1]
    np.testing.assert_array_equal(page(device, new), page(device, shared[1]))
    assert manager.block_table("b")[0] == shared[0]  # the full page stays shared


def test_free_with_scrubbing_zeroes_the_freed_pages():
    manager, device = make_manager(scrub=True)
    manager.lookup("a", [1, 2, 3, 4, 5], b"")
    assert manager.allocate("a", 0, 5)
    table = manager.block_table("a")
    manager.free("a")  # nothing committed: both pages return to the free list
    assert [o.kind for o in device.ops][-1] is KVOpKind.SCRUB
    for p in table:
        assert not page(device, p).any()
    assert manager.stats["scrubbed_pages"] == 2


def test_swap_out_and_in_restores_page_contents_bit_exactly():
    manager, device = make_manager(num_pages=6)
    tokens = list(range(1, 10))
    manager.lookup("a", tokens, b"k")
    assert manager.allocate("a", 0, 9)
    before = [page(device, p).copy() for p in manager.block_table("a")]
    manager.swap_out("a", 9)
    assert not manager.has_sequence("a")
    manager.lookup("x", list(range(50, 62)), b"")  # someone else takes pages meanwhile
    assert manager.allocate("x", 0, 12)
    assert manager.swap_in("a", tokens, 9, b"other-key", "v0")  # no prefix hit: all from host
    after = [page(device, p) for p in manager.block_table("a")]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert manager.stats["swaps_out"] == manager.stats["swaps_in"] == 1


def test_swap_in_without_room_changes_nothing():
    manager, _ = make_manager(num_pages=3)
    manager.lookup("a", list(range(1, 9)), b"")
    assert manager.allocate("a", 0, 8)
    manager.swap_out("a", 8)
    manager.lookup("x", list(range(20, 29)), b"")
    assert manager.allocate("x", 0, 9)  # all three pages
    assert not manager.swap_in("a", list(range(1, 9)), 8, b"", "v0")
    assert not manager.has_sequence("a")
    assert manager.allocator.num_free_pages() == 0


def test_page_versions_flag_stale_reads():
    manager, _ = make_manager()
    manager.lookup("a", [1, 2, 3, 4, 5], b"")
    assert manager.allocate("a", 0, 5)
    table = manager.block_table("a")
    manager.mark_written(table, "v0")
    assert manager.stale_pages("a", 5, "v0") == []
    manager.mark_written(table[1:], "v1")
    assert manager.stale_pages("a", 5, "v0") == [table[1]]
    assert manager.stale_pages("a", 4, "v0") == []  # the stale page is past what is read
    with pytest.raises(RuntimeError, match="stale KV"):
        manager.check_fresh("a", 5, "v0")
    assert manager.stats["stale_kv_reads"] == 1


def test_can_admit_keeps_the_watermark_free():
    manager, _ = make_manager(num_pages=10, watermark=0.2)
    assert manager.can_admit(8) and not manager.can_admit(9)
    assert manager.can_admit(10, reserve=False) and not manager.can_admit(11, reserve=False)


def test_place_shares_cached_pages_and_scatters_the_rest():
    manager, device = make_manager()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    manager.lookup("a", tokens, b"k")
    assert manager.allocate("a", 0, 9)
    manager.commit("a", tokens)  # two full pages cached under b"k"
    a_table = manager.block_table("a")
    saved = np.full((CONFIG.num_layers, 3, P, 1, CONFIG.head_dim), 42.0, np.float32)

    def scatter(kv, tables, first):
        (pages,) = np.asarray(tables, np.int32)  # One layer group: one table.
        return kv.replace(k_pages=kv.k_pages.at[:, pages].set(saved[:, first:]))

    assert manager.returning.place("b", tokens, 9, b"k", "v0", 3, scatter)
    b_table = manager.block_table("b")
    assert b_table[:2] == a_table[:2]  # shared through the prefix cache, not rewritten
    assert (page(device, b_table[2]) == 42.0).all()
    assert manager.page_versions[b_table[2]] == "v0"
