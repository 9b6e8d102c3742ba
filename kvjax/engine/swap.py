"""Swapping a preempted sequence's KV pages to host memory and back, through jax memory kinds.

Pages travel page-first: a sequence's pages are gathered from every page leaf of the KV state
(`kvjax.kv.pages`) into one contiguous buffer per leaf, `[L, n, P, K, D]` for exact K and V,
then moved in a single transfer to `pinned_host` memory (`unpinned_host` where the backend
lacks it). Page counts are padded to powers of two so the gather and scatter programs compile
once per bucket. On a mesh each buffer keeps its sharding (the kv-head axis split over the
`tp` devices), in host memory and back: every device swaps its own heads.
"""

from __future__ import annotations

import jax
import numpy as np

from kvjax.kv import pages as kv_pages
from kvjax.memory.tiers.host import host_memory_kind
from kvjax.shapes import pad_repeat_last, powers_of_2_up_to


class HostSwapSpace:
    """Host-memory copies of swapped-out sequences' pages, keyed by sequence id."""

    keeps_windows = False  # Pages are all a sequence's KV (see kvjax.engine.residual).

    def __init__(self):
        self._stored: dict[str, tuple[object, int]] = {}
        # Per-instance programs, so each engine counts its own compilations.
        self._gather = jax.jit(kv_pages.gather_pages)
        self._scatter = jax.jit(kv_pages.scatter_pages, donate_argnums=0)
        self._zero = jax.jit(kv_pages.zero_pages, donate_argnums=0)
        self.memory_kind = host_memory_kind(jax.devices()[0], user="swapping")

    @property
    def num_compiles(self) -> int:
        return sum(f._cache_size() for f in (self._gather, self._scatter, self._zero))

    def _to_host(self, x: jax.Array) -> tuple[object, jax.sharding.Sharding]:
        """x in host memory (numpy where the backend has no host memory kind), with the
        sharding it goes back to."""
        if self.memory_kind is not None:
            return jax.device_put(x, x.sharding.with_memory_kind(self.memory_kind)), x.sharding
        if x.is_fully_addressable:
            return np.asarray(x), x.sharding
        return x, x.sharding  # Shards of other processes: host memory is device memory here.

    @staticmethod
    def _to_device(stored: tuple[object, jax.sharding.Sharding]) -> jax.Array:
        x, sharding = stored
        return jax.device_put(x, sharding.with_memory_kind("device"))

    def swap_out(self, kv, seq_id: str, pages: list[int]) -> int:
        """Copies `pages` (in block-table order) to host memory; returns bytes moved."""
        padded = pad_repeat_last(pages)
        stored = self._gather(kv, padded)
        self._stored[seq_id] = ([self._to_host(x) for x in stored], len(pages))
        return kv_pages.blob_bytes_per_page(stored) * len(pages)

    def swap_in(self, kv, seq_id: str, pages: list[int], first: int) -> tuple[object, int]:
        """Writes stored pages [first:] into the sequence's new `pages[first:]`; frees the copy."""
        stored, n = self._stored.pop(seq_id)
        targets = pages[first:n]
        if not targets:
            return kv, 0
        idx = pad_repeat_last(list(range(first, n)))
        on_device = kv_pages.take([self._to_device(x) for x in stored], idx)
        kv = self._scatter(kv, pad_repeat_last(targets), on_device)
        return kv, kv_pages.blob_bytes_per_page(on_device) * len(targets)

    def drop(self, seq_id: str) -> None:
        self._stored.pop(seq_id, None)

    def scrub(self, kv, pages: list[int]):
        """Zeroes freed pages so no later reader could ever see their old content."""
        if not pages:
            return kv
        return self._zero(kv, pad_repeat_last(sorted(pages)))

    def warmup(self, kv, max_pages: int, *, swap: bool, scrub: bool):
        """Compiles the swap and scrub programs for every padded count up to `max_pages` pages.

        Their writes go to a page past the pool, which scatters drop: the state is unchanged.
        """
        for n in powers_of_2_up_to(max_pages):
            past = np.full(n, kv.num_pages, np.int32)
            if swap:
                gathered = self._gather(kv, np.zeros(n, np.int32))
                stored = [self._to_device((x, x.sharding)) for x in gathered]
                kv = self._scatter(kv, past, stored)
            if scrub:
                kv = self._zero(kv, past)
        return kv
