"""The KV ops that write pool pages from other pool pages or clear them (copy-on-write copies,
chunk loads, scrubs), and the tier traffic under the pool (spills of evicted prefix-cache pages,
polls of transfers in flight)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvjax.memory.block_manager import CopyOp
from kvjax.memory.op_plan import OpPlan
from kvjax.memory.ops import ChunkLoadPlan, KVOp, KVOpKind
from kvjax.memory.page_versions import PageVersions
from kvjax.shapes import next_power_of_2, pad_repeat_last, pages_for


class PageOps:
    """Issues the page-to-page KV ops of the KV cache manager.

    Args:
      spill: spills evicted prefix-cache pages before a copy writes to them.
      allocate: makes a sequence's cache positions writable (`KVCacheManager.allocate`).
    """

    def __init__(self, allocator, swap_space, ops: OpPlan, versions: PageVersions,
                 stats: dict, *, page_size: int, spill: Callable[[], None],
                 allocate: Callable[[str, int, int], bool]):
        self.allocator = allocator
        self.swap_space = swap_space
        self.ops = ops
        self.versions = versions
        self.stats = stats
        self.page_size = page_size
        self._spill = spill
        self._allocate = allocate

    def load_chunk(self, seq_id: str, chunk_ids: Sequence[int], cache_key: bytes, *,
                   first: int, count: int, start: int, shift: int, key_scale: float,
                   version: str) -> str:
        """Copies tokens [first, first + count) of a cached chunk into the sequence's cache
        positions [start, start + count), keys turned forward by `shift` positions and scaled
        by `key_scale` (`kvjax.kv.reuse`); the chunk's own pages are only read.

        chunk_ids: the chunk's tokens padded to whole pages, as the chunk cache keys them.
        Returns 'loaded'; 'miss' when the prefix cache does not hold every page of the chunk
        (nothing changed); 'full' when the sequence's pages do not fit the pool.
        """
        found = self.allocator.peek_cached_tokens(list(chunk_ids) + [0], cache_key=cache_key)
        if found < len(chunk_ids):
            return "miss"
        pin = f"{seq_id}@chunk"  # Holds the chunk's pages while the sequence allocates.
        self.allocator.add_sequence(pin, list(chunk_ids) + [0], cache_key=cache_key,
                                    record_stats=False)
        try:
            if not self._allocate(seq_id, start, start + count):
                return "full"
            p = self.page_size
            src_pages = self.allocator.block_table(pin)[first // p:pages_for(first + count, p)]
            dst_table = np.asarray(self.allocator.block_table(seq_id), np.int64)
            dst_pos = np.arange(start, start + count)
            dst = dst_table[dst_pos // p] * p + dst_pos % p
            written = sorted(set(dst_table[dst_pos // p].tolist()))
            plan = ChunkLoadPlan.padded(src_pages, first % p, dst.tolist(), shift, key_scale,
                                        page_size=p)
            self.ops.issue(KVOp(KVOpKind.CHUNK_LOAD, tuple(written), plan=plan))
            self.versions.mark_written(written, version)
            return "loaded"
        finally:
            self.allocator.free(pin)

    def copy(self, copies: Sequence[CopyOp]) -> None:
        """Applies copy-on-write copies (after spilling evicted pages they may overwrite)."""
        self._spill()
        if not copies:
            return
        self.versions.copied([c.src for c in copies], [c.dst for c in copies])
        n = next_power_of_2(len(copies))
        # Padding repeats the last copy: idempotent, and keeps shapes bucketed.
        src = pad_repeat_last([c.src for c in copies], n)
        dst = pad_repeat_last([c.dst for c in copies], n)
        self.ops.issue(KVOp(KVOpKind.COPY, tuple(int(c.dst) for c in copies),
                         src=tuple(src.tolist()), dst=tuple(dst.tolist())))

    def scrub(self, pages: Sequence[int]) -> None:
        """Zeroes freed pages (and freed window slots) so no later reader sees their content."""
        slots = self.swap_space.take_released_slots()
        # Padding repeats the last index: zeroing twice is harmless, and shapes stay bucketed.
        self.ops.issue(KVOp(KVOpKind.SCRUB, tuple(pages),
                         dst=tuple(pad_repeat_last(sorted(pages)).tolist()) if pages else (),
                         seq_slots=tuple(pad_repeat_last(slots).tolist()) if slots else ()))
        self.stats["scrubbed_pages"] += len(pages)


class TierTraffic:
    """Spills and polls of the host/disk tiers below the pool (nothing without tiers)."""

    def __init__(self, tiers, allocator, ops: OpPlan, stats: dict):
        self.tiers = tiers
        self.allocator = allocator
        self.ops = ops
        self.stats = stats

    def spill_evictions(self) -> None:
        """Copies cached pages evicted since the last call out to the tiers; runs before anything
        writes to those pages (copies, scrubs, loads, the step)."""
        if self.tiers is None or self.allocator.prefix_cache is None:
            return
        evicted = self.allocator.drain_evictions()
        if evicted:  # SPILL ops, planned before whatever overwrites the pages
            self.tiers.spill(None, evicted)
        self._sync_tier_stats()

    def poll_tiers(self, owner: str | None = None) -> list:
        """Advances tier transfers (only `owner`'s, if given); returns the finished loads."""
        if self.tiers is None:
            return []
        self.spill_evictions()
        _, results = self.tiers.poll(None, owner=owner)
        self._sync_tier_stats()
        return results

    def _sync_tier_stats(self) -> None:
        for key in ("bytes_device_to_host", "bytes_host_to_device", "bytes_host_to_disk",
                    "bytes_disk_to_host"):
            self.stats[key] = self.tiers.stats[key]
