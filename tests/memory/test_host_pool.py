"""Host-resident pages: the KV cache manager moves a sequence's leading pages to the host pool
and back, through swaps too, each move checked on both pools' contents."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine.swap import HostSwapSpace
from kvjax.kv.retention import RetentionManager, make_retention
from kvjax.kv.state import PagedKV
from kvjax.memory.block_manager import RELEASED, BlockManager
from kvjax.memory.host_pool import HostPagePool
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.memory.ops import HostKV, KVOpKind

P = 4


def page_filled_pool(num_pages: int) -> PagedKV:
    """Page p holds the value p + 1 everywhere (K) and -(p + 1) (V)."""
    shape = (2, num_pages, P, 1, 4)  # [L, pages, P, K, D]
    k = jnp.broadcast_to(jnp.arange(1, num_pages + 1, dtype=jnp.float32)[None, :, None, None,
                                                                           None], shape)
    return PagedKV(k_pages=k, v_pages=-k)

NUM_PAGES, NUM_HOST = 8, 6


def make_manager(*, scrub: bool = False):
    empty_host = page_filled_pool(NUM_HOST)
    device = HostKV(page_filled_pool(NUM_PAGES),
                    host_kv=empty_host.with_page_leaves([x * 0 for x in empty_host.page_leaves()]))
    manager = KVCacheManager(device, BlockManager(NUM_PAGES, P), HostSwapSpace(),
                             RetentionManager(make_retention("none", None, P)), page_size=P,
                             watermark=0.0, scrub_freed_pages=scrub, stats={},
                             host_pool=HostPagePool(NUM_HOST))
    return manager, device


def _contents(device, seq_pages, host_pages) -> list[np.ndarray]:
    """The K of the sequence's pages in order: host-resident first, then device."""
    return ([np.asarray(device.host_kv.k_pages[:, p]) for p in host_pages]
            + [np.asarray(device.kv.k_pages[:, p]) for p in seq_pages])


def test_to_host_frees_device_pages_and_to_device_brings_the_same_content_back():
    manager, device = make_manager(scrub=True)
    manager.lookup("a", list(range(10)), b"")
    assert manager.allocate("a", 0, 10)  # 3 pages, two full
    before = _contents(device, manager.block_table("a"), [])
    free = manager.allocator.num_free_pages()
    assert manager.to_host("a", 2)
    assert manager.block_table("a")[:2] == [RELEASED, RELEASED]
    assert manager.allocator.num_free_pages() == free + 2
    host = manager.host_table("a").tolist()
    assert len(host) == 2 and manager.num_free_host_pages() == NUM_HOST - 2
    # Freed device pages were scrubbed: no stale copy stays readable there.
    assert [o.kind for o in device.ops][-2:] == [KVOpKind.HOST_OUT, KVOpKind.SCRUB]
    for x, y in zip(_contents(device, manager.block_table("a")[2:], host), before, strict=True):
        np.testing.assert_array_equal(x, y)
    assert manager.to_device("a", 1)  # the second host page comes back
    assert manager.num_host_pages("a") == 1 and manager.block_table("a")[0] == RELEASED
    got = _contents(device, manager.block_table("a")[1:], manager.host_table("a").tolist())
    for x, y in zip(got, before, strict=True):
        np.testing.assert_array_equal(x, y)
    manager.free("a")
    assert manager.num_free_host_pages() == NUM_HOST
    assert manager.allocator.num_used_pages() == 0


def test_swap_of_a_host_resident_sequence_restores_every_page():
    manager, device = make_manager()
    tokens = list(range(11))
    manager.lookup("a", tokens, b"k")
    assert manager.allocate("a", 0, 11)
    before = _contents(device, manager.block_table("a"), [])
    assert manager.to_host("a", 2)
    manager.swap_out("a", 11)
    assert manager.allocator.num_used_pages() == 0
    assert manager.num_host_pages("a") == 2  # host memory already: they wait there
    assert manager.swap_in("a", tokens, 11, b"other-key", "v0")
    assert manager.num_host_pages("a") == 0 and manager.num_free_host_pages() == NUM_HOST
    got = _contents(device, manager.block_table("a"), [])
    for x, y in zip(got, before, strict=True):
        np.testing.assert_array_equal(x, y)


def test_moves_without_room_change_nothing():
    manager, _ = make_manager()
    manager.lookup("a", list(range(30)), b"")
    assert manager.allocate("a", 0, 30)  # 8 pages: the whole pool
    assert not manager.to_host("a", NUM_HOST + 1)
    assert manager.num_host_pages("a") == 0
    assert manager.to_host("a", 4)
    manager.lookup("b", list(range(16)), b"")
    assert manager.allocate("b", 0, 16)  # takes the 4 freed pages
    table = manager.block_table("a")
    assert not manager.to_device("a", 1)
    assert manager.block_table("a") == table and manager.num_host_pages("a") == 4
    with pytest.raises(ValueError, match="'a'"):
        manager.fork("a", "c")
