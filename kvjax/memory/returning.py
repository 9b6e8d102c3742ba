"""Sequences that come back to the pool with the KV they kept while away: a swapped one (whose
pages `SwapMoves.swap_in` or the tiers' loads then write back) and one restored from a snapshot
(`place`). Each is registered with pages for the tokens its cache holds: the prefix cache's hits
are shared unless retention dropped some of its tokens, and block tables that kept retention
budgets of their own (PyramidKV's table groups, AdaKV's (layer, kv head) tables) come back at
their own cached lengths (`RetentionManager.group_shifts`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvjax.kv.retention_host import RetentionManager
from kvjax.memory.block_manager import RELEASED
from kvjax.memory.floors import WindowFloors
from kvjax.memory.op_plan import OpPlan
from kvjax.memory.ops import KVOp, KVOpKind
from kvjax.memory.page_versions import PageVersions
from kvjax.memory.precision import RoundedPages


class ReturningSequences:
    """Registers returning sequences for the KV cache manager.

    Args:
      lookup: registers a sequence, attaching its prefix-cache hits (`KVCacheManager.lookup`).
      allocate: makes a sequence's cache positions writable (`KVCacheManager.allocate`).
      commit: publishes a sequence's full pages to the prefix cache (`KVCacheManager.commit`).
    """

    def __init__(self, allocator, retention: RetentionManager, ops: OpPlan,
                 versions: PageVersions, floors: WindowFloors, rounded: RoundedPages, *,
                 page_size: int, lookup: Callable[..., int], allocate: Callable[..., bool],
                 commit: Callable[[str, Sequence[int]], None]):
        self.allocator = allocator
        self.retention = retention
        self.ops = ops
        self.versions = versions
        self.floors = floors
        self.rounded = rounded
        self.page_size = page_size
        self._lookup = lookup
        self._allocate = allocate
        self._commit = commit

    def register(self, seq_id: str, token_ids: Sequence[int], num_computed: int,
                 cache_key: bytes) -> int | None:
        """Registers a returning (swapped or restored) sequence with pages for the tokens its
        cache holds (prefix hits shared unless retention dropped some); the number of leading
        cached tokens the prefix cache supplied, or None, with nothing changed, when the pool
        has no room."""
        held = num_computed - self.retention.num_evicted(seq_id)
        floor = self.floors.saved(seq_id)
        # Pages that hold a subset of its tokens (in any block table) index nothing.
        keeps_all = held == num_computed and not any(self.retention.group_evicted(seq_id))
        cached = self._lookup(seq_id, token_ids[:num_computed + 1], cache_key,
                              indexable=keeps_all and self.rounded.indexable(seq_id))
        shifts = self.retention.group_shifts(seq_id)
        if shifts:  # table groups that kept budgets of their own come back at their lengths
            self.allocator.shift_groups(seq_id, shifts)
        if not self._allocate(seq_id, cached, held, returning=True):
            self.allocator.free(seq_id)  # nothing written: its prefix hits go back to the cache
            self.floors.restore(seq_id, floor)  # it stays away, with the floor it had
            return None
        return cached

    def place(self, seq_id: str, token_ids: Sequence[int], num_computed: int, cache_key: bytes,
              version: str, num_pages: int | Sequence[int], scatter,
              retention: dict | None = None, kv_floor: int = 0) -> bool:
        """Registers a sequence whose first `num_pages` block-table entries of KV (per layer
        group where groups keep budgets of their own) come from outside the pool (a
        snapshot): prefix-cache hits are shared, the rest written by
        `scatter(kv, tables, first) -> kv` (tables: [G][num_pages - first], every layer group's
        pool pages for entries first.., RELEASED where a window no longer reads the entry; the
        sequence's slot is `seq_slot(seq_id)` by then). `retention`: the retention record
        saved with the pages (`RetentionManager.record`), if any; `kv_floor`: the sequence's
        `kv_floor` when it was saved. False, with nothing changed, when the pool has no room."""
        self.retention.restore(seq_id, retention)
        self.floors.attach_loaded(seq_id, kv_floor)
        cached = self.register(seq_id, token_ids, num_computed, cache_key)
        if cached is None:
            self.retention.drop(seq_id)
            self.floors.pop(seq_id)
            return False
        first = cached // self.page_size
        tables = self.allocator.block_tables(seq_id)
        counts = [num_pages] * len(tables) if isinstance(num_pages, int) else num_pages
        tables = [t[first:n] for t, n in zip(tables, counts, strict=True)]
        written = [p for t in tables for p in t if p != RELEASED]
        self.ops.apply(KVOp(KVOpKind.SCATTER, tuple(written)),
                       lambda kv: scatter(kv, tables, first))
        self.versions.mark_written(written, version)
        self._commit(seq_id, token_ids[:num_computed])
        return True
