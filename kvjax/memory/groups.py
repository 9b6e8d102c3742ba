"""Pages of several KV layer groups drawn from one pool: one `BlockManager` per group, one
free list.

A model whose layers need different tokens (global layers every token, sliding-window layers
the last `window`) keeps one block table per group (`kvjax.kv.spec.KVCacheSpec.table_groups`).
Every page of the pool holds the same bytes (one group's `layers_per_group` layers of P tokens),
so the groups share one free list of page ids and one byte budget: a page a window gives back
is the next page any group allocates. Each group keeps its own prefix cache; when the free list
is empty a group evicts the least recently released cached page of whichever group holds the
oldest one.

`GroupedBlockManager` presents the `BlockManager` surface the KV cache manager uses, over all
groups at once: a registration attaches the longest prefix every group can take (a global group
every page of it, a sliding-window group the pages of its last window), an allocation first
gives back the pages that fell out of each window, then extends every group's table
all-or-nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np

from kvjax.memory.block_manager import (
    RELEASED,
    AllocStatus,
    BlockManager,
    BlockManagerStats,
    CopyOp,
    FreeList,
    hit_limit,
)
from kvjax.memory.prefix_cache import CachedPage, PrefixEviction
from kvjax.trace import NULL_TRACER, Tracer


class _GroupPages:
    """One group's view of the shared free list: when it runs dry, a page comes from another
    group's prefix cache if that holds an older released page than this group's own."""

    def __init__(self, free: FreeList, managers: list[BlockManager], index: int, *,
                 caching: bool = True):
        self._free, self._managers, self._index = free, managers, index
        # Without prefix caches no group holds a page to give: the free list is all there is
        # (not asking G - 1 groups on every allocation matters at G = L * K head tables).
        self._caching = caching

    def _others(self) -> list[BlockManager]:
        return [m for i, m in enumerate(self._managers) if i != self._index]

    def num_free(self) -> int:
        if not self._caching:
            return self._free.num_free()
        return self._free.num_free() + sum(_num_evictable(m) for m in self._others())

    def take(self) -> int | None:
        page = self._free.take()
        if page is not None:
            return page
        own = _oldest_release(self._managers[self._index])
        donors = [m for m in self._others() if _num_evictable(m)]
        if not donors:
            return None
        donor = min(donors, key=_oldest_release)
        if own is not None and own <= _oldest_release(donor):
            return None  # this group's own cached page is the oldest: it evicts that one
        donor.give_back_cached(1)
        return self._free.take()

    def give(self, page: int) -> None:
        self._free.give(page)

    def capacity(self) -> int:
        return self._free.capacity()


def _num_evictable(manager: BlockManager) -> int:
    return 0 if manager.prefix_cache is None else manager.prefix_cache.num_evictable()


def _oldest_release(manager: BlockManager) -> float | None:
    return None if manager.prefix_cache is None else manager.prefix_cache.oldest_release()


class GroupedBlockManager:
    """Block tables of G layer groups over one pool of `num_pages` pages.

    Attributes:
      num_pages: pages in the pool (every group's pages together).
      page_size: P.
      windows: per group, its sliding window in tokens (0: every token).
      groups: the per-group `BlockManager`s (group 0 first).
    """

    def __init__(self, num_pages: int, page_size: int, windows: Sequence[int], *,
                 enable_prefix_cache: bool = True,
                 prefix_eviction: PrefixEviction = PrefixEviction.LRU):
        if not windows:
            raise ValueError("a grouped block manager needs at least one group")
        self.num_pages = num_pages
        self.page_size = page_size
        self.windows = tuple(windows)
        self._free = FreeList(num_pages)
        self.groups: list[BlockManager] = []
        for index, window in enumerate(self.windows):
            self.groups.append(BlockManager(
                num_pages, page_size, enable_prefix_cache=enable_prefix_cache,
                pages=_GroupPages(self._free, self.groups, index,
                                  caching=enable_prefix_cache),
                prefix_eviction=prefix_eviction, window=window))
        self._released: list[int] = []
        self._tracer: Tracer = NULL_TRACER
        # Per sequence that `retain_groups` compacted: each group's cached length less group
        # 0's (groups keeping budgets of their own hold different numbers of tokens). Callers
        # address a sequence by group 0's cache positions; group g's are these plus its offset.
        self._offsets: dict[Hashable, list[int]] = {}
        # Per sequence, `block_table_array`'s array until one of its tables changes: a decode
        # step that writes within the pages it holds changes none, so most steps reuse it.
        self._arrays: dict[Hashable, np.ndarray] = {}

    # ----------------------------------------------------------------------------- views

    @property
    def prefix_cache(self):
        """Group 0's prefix cache (None when prefix caching is off): whether there is one."""
        return self.groups[0].prefix_cache

    @property
    def stats(self) -> BlockManagerStats:
        """Group 0's counters: a hit counts the tokens every group attached."""
        return self.groups[0].stats

    @property
    def capacity(self) -> int:
        return self._free.capacity()

    @property
    def tracer(self) -> Tracer:
        return self._tracer

    @tracer.setter
    def tracer(self, tracer: Tracer) -> None:
        self._tracer = tracer
        for m in self.groups:
            m.tracer = tracer

    @property
    def clock(self):
        return self.groups[0].clock

    @clock.setter
    def clock(self, clock) -> None:
        for m in self.groups:
            m.clock = clock

    def num_free_pages(self) -> int:
        return self._free.num_free() + sum(_num_evictable(m) for m in self.groups)

    def num_used_pages(self) -> int:
        if self.prefix_cache is None:
            # Without prefix caches a page off the shared free list is held by one group's
            # tables: one count, not a scan of every group's reference counts.
            return self.num_pages - self._free.num_free()
        return sum(m.num_used_pages() for m in self.groups)

    def page_hash(self, seq_id: Hashable, page: int) -> bytes | None:
        """Group 0's hash of the sequence's committed `page` (`BlockManager.page_hash`)."""
        return self.groups[0].page_hash(seq_id, page)

    def has_sequence(self, seq_id: Hashable) -> bool:
        return self.groups[0].has_sequence(seq_id)

    def seq_slot(self, seq_id: Hashable) -> int:
        return 0

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Group 0's table."""
        return self.groups[0].block_table(seq_id)

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """Every group's table, group 0 first (RELEASED entries hold no page)."""
        return [m.block_table(seq_id) for m in self.groups]

    def block_table_array(self, seq_id: Hashable) -> np.ndarray:
        """[G, n] int32, read-only: every group's table, group 0 first, a shorter one padded
        with RELEASED to the longest's n pages. Built once per change of the sequence's
        tables (L * K of them under per-head budgets), not on every step."""
        tables = self._arrays.get(seq_id)
        if tables is None:
            rows = self.block_tables(seq_id)
            lengths = np.fromiter(map(len, rows), np.int64, len(rows))
            tables = np.full((len(rows), lengths.max()), RELEASED, np.int32)
            tables[np.arange(tables.shape[1]) < lengths[:, None]] = np.fromiter(
                itertools.chain.from_iterable(rows), np.int32, lengths.sum())
            tables.flags.writeable = False
            self._arrays[seq_id] = tables
        return tables

    def num_held_pages(self, seq_id: Hashable) -> int:
        """Pages the sequence holds over every group."""
        return int(np.count_nonzero(self.block_table_array(seq_id) != RELEASED))

    def num_tokens_cached(self, seq_id: Hashable) -> int:
        return self.groups[0].num_tokens_cached(seq_id)

    def cache_key_of(self, seq_id: Hashable) -> bytes:
        return self.groups[0].cache_key_of(seq_id)

    def last_page_hash(self, seq_id: Hashable, token_ids: Sequence[int]) -> bytes | None:
        return self.groups[0].last_page_hash(seq_id, token_ids)

    # ----------------------------------------------------------------------------- prefix

    def _common_hit(self, token_ids: Sequence[int], cache_key: bytes,
                    max_hit: int | None = None) -> int:
        """The longest prefix (leaving the last token; at most `max_hit`) that every group can
        attach."""
        hit = hit_limit(token_ids, max_hit)
        while True:  # each group's best hit within the others' shrinks it to a common one
            new = min(m.best_hit(token_ids, cache_key, hit) for m in self.groups)
            if new == hit:
                return hit
            hit = new

    def peek_cached_tokens(self, token_ids: Sequence[int], *, cache_key: bytes = b"",
                           max_hit: int | None = None) -> int:
        if self.prefix_cache is None or len(token_ids) == 0:
            return 0
        return self._common_hit(token_ids, cache_key, max_hit)

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int], *,
                     cache_key: bytes = b"", indexable: bool = True,
                     record_stats: bool = True, max_hit: int | None = None) -> int:
        """Registers the sequence in every group with the prefix every group holds (group 0
        validates the id and the prompt before any group registers it)."""
        hit = (self._common_hit(token_ids, cache_key, max_hit)
               if self.prefix_cache is not None and indexable else None)
        self._arrays.pop(seq_id, None)
        for m in self.groups:
            m.add_sequence(seq_id, token_ids, cache_key=cache_key, indexable=indexable,
                           record_stats=record_stats, num_cached=hit)
        return self.groups[0].num_tokens_cached(seq_id)

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        for m in self.groups:
            m.commit(seq_id, token_ids)

    def cached_pages(self) -> list[CachedPage]:
        return sorted((c for m in self.groups for c in m.cached_pages()),
                      key=lambda c: c.released_at)

    def keep_cached(self, pages: Sequence[int]) -> None:
        for m in self.groups:
            m.keep_cached(pages)

    def reset_prefix_cache(self) -> None:
        for m in self.groups:
            m.reset_prefix_cache()

    def num_givable_pages(self) -> int:
        return sum(m.num_givable_pages() for m in self.groups)

    def give_back_cached(self, num_pages: int) -> int:
        given = 0
        for m in self.groups:
            given += m.give_back_cached(num_pages - given)
        return given

    def record_evictions(self) -> None:
        raise ValueError("lower tiers hold the pages of one layer group; a model with several "
                         "(sliding-window layers) keeps its KV on the device")

    # ----------------------------------------------------------------------------- pages

    def _shifts(self, seq_id: Hashable) -> list[int]:
        """Each group's cache position of group 0's position 0 (`_offsets`)."""
        return self._offsets.get(seq_id, [0] * len(self.groups))

    def pages_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        return sum(m.pages_needed(seq_id, num_tokens + d)
                   for m, d in zip(self.groups, self._shifts(seq_id), strict=True))

    def ensure_writable(self, seq_id: Hashable, start: int, end: int
                        ) -> tuple[AllocStatus, list[CopyOp]]:
        """Gives back each window's pages no query from `start` on reads, then makes [start,
        end) writable in every group, all-or-nothing."""
        shifts = self._shifts(seq_id)
        if not any(self.windows):
            return self._write_without_windows(seq_id, start, end, shifts)
        self._arrays.pop(seq_id, None)
        for m, d in zip(self.groups, shifts, strict=True):
            self._released += m.release_before(seq_id, start + d)
        needed = sum(m.pages_to_write(seq_id, start + d, end + d)
                     for m, d in zip(self.groups, shifts, strict=True))
        if needed > self.num_free_pages():
            return AllocStatus.NO_PAGES, []
        copies = []
        for m, d in zip(self.groups, shifts, strict=True):
            status, group_copies = m.ensure_writable(seq_id, start + d, end + d)
            assert status is AllocStatus.OK, "pages counted free above must be allocatable"
            copies += group_copies
        return AllocStatus.OK, copies

    def _write_without_windows(self, seq_id: Hashable, start: int, end: int,
                               shifts: list[int]) -> tuple[AllocStatus, list[CopyOp]]:
        """`ensure_writable` when no group has a window (no page is given back first). A
        decode step's write mostly lands in a page the table already holds alone: such a
        group only records it (`BlockManager.writes_in_place`); the others (tables that
        cross a page boundary at this step, a budget of their own apart) take their pages,
        and only their rows of the kept `block_table_array` change."""
        seqs = [m.writes_in_place(seq_id, start + d, end + d)
                for m, d in zip(self.groups, shifts, strict=True)]
        moving = [g for g, seq in enumerate(seqs) if seq is None]
        needed = sum(self.groups[g].pages_to_write(seq_id, start + shifts[g], end + shifts[g])
                     for g in moving)
        if needed > self.num_free_pages():
            return AllocStatus.NO_PAGES, []
        copies = []
        for m, seq, d in zip(self.groups, seqs, shifts, strict=True):
            if seq is not None:
                m.record_in_place(seq, start + d, end + d)
                continue
            status, group_copies = m.ensure_writable(seq_id, start + d, end + d)
            assert status is AllocStatus.OK, "pages counted free above must be allocatable"
            copies += group_copies
        if moving:
            self._update_arrays(seq_id, moving)
        return AllocStatus.OK, copies

    def _update_arrays(self, seq_id: Hashable, groups: list[int]) -> None:
        """The kept `block_table_array` of `seq_id` with the tables of `groups` read afresh
        (a copy: arrays handed out before stay as they were); dropped when one outgrew it."""
        tables = self._arrays.pop(seq_id, None)
        if tables is None:
            return
        rows = [self.groups[g].block_table(seq_id) for g in groups]
        if max(map(len, rows)) > tables.shape[1]:
            return
        tables = tables.copy()
        for g, row in zip(groups, rows, strict=True):
            tables[g] = RELEASED
            tables[g, :len(row)] = row
        tables.flags.writeable = False
        self._arrays[seq_id] = tables

    def ensure_restored(self, seq_id: Hashable, start: int, end: int
                        ) -> tuple[AllocStatus, list[CopyOp]]:
        """Makes a returning sequence's positions [start, end) writable, its next query at
        `end` (its KV comes back from host memory or a snapshot): every group's pages from
        `start`, a window's only from the first page that query reads, all-or-nothing but for
        the window pages before it, which are given back either way."""
        shifts = self._shifts(seq_id)  # a sequence that comes back with its groups' lengths
        self._arrays.pop(seq_id, None)
        ends = [end + d for d in shifts]
        for m, e in zip(self.groups, ends, strict=True):
            self._released += m.release_returning(seq_id, e)
        # Shifted groups hold tokens retention kept, which no prefix hit supplies (start 0).
        starts = [m.restored_start(start and start + d, e)
                  for m, d, e in zip(self.groups, shifts, ends, strict=True)]
        needed = sum(m.pages_to_write(seq_id, s, e)
                     for m, s, e in zip(self.groups, starts, ends, strict=True))
        if needed > self.num_free_pages():
            return AllocStatus.NO_PAGES, []
        copies = []
        for m, s, e in zip(self.groups, starts, ends, strict=True):
            status, group_copies = m.ensure_writable(seq_id, s, e)
            assert status is AllocStatus.OK, "pages counted free above must be allocatable"
            copies += group_copies
        return AllocStatus.OK, copies

    def shift_groups(self, seq_id: Hashable, shifts: Sequence[int]) -> None:
        """Group g of a registered sequence holds its cache positions plus shifts[g] (a
        sequence coming back to the lengths `retain_groups` left its groups at)."""
        if len(shifts) != len(self.groups):
            raise ValueError(f"sequence {seq_id!r}: {len(shifts)} shifts for "
                             f"{len(self.groups)} layer groups")
        self._offsets[seq_id] = list(shifts)

    def take_released(self) -> list[int]:
        """Pages windows gave back (to the free list) since the last call: to scrub."""
        released, self._released = self._released, []
        return released

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        self._arrays.pop(child_id, None)
        for m in self.groups:
            m.fork(parent_id, child_id)
        if parent_id in self._offsets:
            self._offsets[child_id] = list(self._offsets[parent_id])

    def truncate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        self._arrays.pop(seq_id, None)
        return [page for m, d in zip(self.groups, self._shifts(seq_id), strict=True)
                for page in m.truncate(seq_id, num_tokens + d)]

    def free(self, seq_id: Hashable) -> list[int]:
        self._offsets.pop(seq_id, None)
        self._arrays.pop(seq_id, None)
        return [page for m in self.groups for page in m.free(seq_id)]

    def retain(self, seq_id: Hashable, keep: Sequence[int]):
        raise ValueError("retention compacts one block table; a model with several layer "
                         "groups keeps every group's tokens")

    def retain_groups(self, seq_id: Hashable, keeps: Sequence[Sequence[int]]
                      ) -> tuple[AllocStatus, list[tuple[np.ndarray, np.ndarray]], list[int]]:
        """Keeps positions keeps[g] of `seq_id` in group g's table, compacted in order
        (`BlockManager.retain` per group): groups with budgets of their own (per-layer budgets,
        `kvjax.kv.budgets`) keep different tokens and give back different pages.

        All-or-nothing: before any group changes, the free pages must cover the new pages of
        every group's retain (`BlockManager.pages_to_retain`, counting none that an earlier
        group's retain gives back), so no group's retain can run short.
        Returns (status, per group its slot moves (src, dst), the freed pages).
        """
        if len(keeps) != len(self.groups):
            raise ValueError(f"sequence {seq_id!r}: {len(keeps)} kept-token lists for "
                             f"{len(self.groups)} layer groups")
        needed = sum(m.pages_to_retain(seq_id, keep)
                     for m, keep in zip(self.groups, keeps, strict=True))
        if needed > self.num_free_pages():
            return AllocStatus.NO_PAGES, [], []
        moves, freed = [], []
        self._arrays.pop(seq_id, None)
        for m, keep in zip(self.groups, keeps, strict=True):
            status, src, dst, group_freed = m.retain(seq_id, keep)
            assert status is AllocStatus.OK, "pages counted free above must be allocatable"
            moves.append((src, dst))
            freed += group_freed
        self._offsets[seq_id] = [len(keep) - len(keeps[0]) for keep in keeps]
        return AllocStatus.OK, moves, freed


__all__ = ["GroupedBlockManager", "RELEASED"]
