"""Page accounting under a block manager: reference counts, the free pages (a free list, or
a share of a pool several managers draw from), the prefix cache's unreferenced pages, and
their eviction (recorded for the tiers, which copy an evicted page out before its new owner
writes it)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvjax.memory.prefix_cache import CachedPage, PrefixCache
from kvjax.trace import NULL_TRACER, Tracer


class PageSource(Protocol):
    """Where a block manager's free pages come from and go back to.

    An engine's own pool is a `FreeList`; engines that share one arena draw frames from a
    shared `kvjax.memory.frames.FramePool` instead.
    """

    def num_free(self) -> int:
        """Pages `take` can hand out now."""

    def take(self) -> int | None:
        """A free page, or None when there is none."""

    def give(self, page: int) -> None:
        """Returns a page nobody holds any longer."""

    def capacity(self) -> int:
        """The most pages the manager can ever hold at once."""


class FreeList:
    """The free pages of one engine's own pool, handed out in order of release (FIFO)."""

    def __init__(self, num_pages: int):
        self._pages = collections.deque(range(num_pages))
        self._num_pages = num_pages

    def num_free(self) -> int:
        return len(self._pages)

    def take(self) -> int | None:
        return self._pages.popleft() if self._pages else None

    def give(self, page: int) -> None:
        self._pages.append(page)

    def capacity(self) -> int:
        return self._num_pages

    def __len__(self) -> int:
        return len(self._pages)

    def __iter__(self):
        return iter(self._pages)


class PagePool:
    """Which pages are held, by how many block tables, and which are free or evictable.

    Attributes:
        num_pages: pages in the device KV pool.
        prefix_cache: the block manager's index of full pages, or None.
        free_pages: the PageSource pages are taken from and given back to.
        ref_counts: [num_pages] block tables holding each page.
        num_evictions: cached pages evicted to satisfy an allocation.
        tracer: where page allocations, frees and evictions are reported.
        clock: when cached pages are released (`CachedPage.released_at`).
    """

    def __init__(self, num_pages: int, pages: PageSource | None,
                 prefix_cache: PrefixCache | None):
        self.num_pages = num_pages
        self.prefix_cache = prefix_cache
        # Page ids are in [0, num_pages) whatever the source; a shared source hands out only
        # the ids it owns at the time.
        self.free_pages = FreeList(num_pages) if pages is None else pages
        self.tracer: Tracer = NULL_TRACER
        self.clock: Callable[[], float] = time.monotonic
        self.ref_counts = np.zeros([num_pages], np.int32)  # [num_pages]
        self.num_evictions = 0
        # Tier hook: hashes of evictable pages, and (hash, page) of pages evicted since the last
        # drain; None while nobody records evictions.
        self._evictable_hashes: dict[int, bytes] | None = None
        self._evicted: list[tuple[bytes, int]] = []

    def capacity(self) -> int:
        return self.free_pages.capacity()

    def add_ref(self, page: int) -> None:
        """One more block table holds a page some table holds already (a fork)."""
        self.ref_counts[page] += 1

    def num_free_pages(self) -> int:
        """Pages allocatable now: the free list plus unreferenced (evictable) cached pages."""
        num_evictable = 0 if self.prefix_cache is None else self.prefix_cache.num_evictable()
        return self.free_pages.num_free() + num_evictable

    def num_used_pages(self) -> int:
        """Pages referenced by at least one sequence."""
        return int(np.count_nonzero(self.ref_counts))

    def ref_count(self, page: int) -> int:
        """Number of block tables holding `page`."""
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is outside [0, {self.num_pages})")
        return int(self.ref_counts[page])

    def reset_prefix_cache(self) -> None:
        """Empties the prefix cache; its unreferenced pages return to the free list."""
        if self.prefix_cache is not None:
            for page in self.prefix_cache.reset():  # Invalidated (a weights update): freed.
                self.free_pages.give(page)
                self.tracer.emit("invalidate", "page", "pages/device", page=page)
                self.tracer.emit("free", "page", "pages/device", page=page)
        if self._evictable_hashes is not None:
            self._evictable_hashes.clear()

    def record_evictions(self) -> None:
        """Starts recording the cached pages that allocations evict (see drain_evictions).

        Lower tiers use it to copy a page's content out before its new owner overwrites it.
        Call it before any page is cached.
        """
        if self.prefix_cache is None:
            raise ValueError("recording evictions needs the prefix cache (enable_prefix_cache)")
        if self.prefix_cache.num_indexed():
            raise ValueError(f"record_evictions must precede caching; "
                             f"{self.prefix_cache.num_indexed()} pages are already cached")
        self._evictable_hashes = {}

    def drain_evictions(self) -> list[tuple[bytes, int]]:
        """(page hash, page) of every cached page evicted since the last drain, in order.

        The pages already belong to new owners; their old content stays on the device until the
        caller lets anything write to them, so it must copy them out before that.
        """
        evicted, self._evicted = self._evicted, []
        return evicted

    def is_shared(self, page: int) -> bool:
        """Whether a write to the page needs a copy first (another table or the cache holds it)."""
        if self.ref_counts[page] > 1:
            return True
        return self.prefix_cache is not None and self.prefix_cache.is_indexed(page)

    def acquire(self, page: int) -> None:
        """Takes one more reference to a page (a cached one leaves the evictable set)."""
        if self.ref_counts[page] == 0:
            self.prefix_cache.mark_in_use(page)
            if self._evictable_hashes is not None:
                del self._evictable_hashes[page]
        self.ref_counts[page] += 1

    def release(self, page: int) -> bool:
        """Drops one reference; True when the page went to the free list."""
        self.ref_counts[page] -= 1
        if self.ref_counts[page] > 0:
            return False
        if self.prefix_cache is not None and self.prefix_cache.is_indexed(page):
            self.prefix_cache.mark_evictable(page, self.clock())
            if self._evictable_hashes is not None:
                self._evictable_hashes[page] = self.prefix_cache.hash_of(page)
            self.tracer.emit("cache", "page", "pages/device", page=page)
            return False
        self.free_pages.give(page)
        self.tracer.emit("free", "page", "pages/device", page=page)
        return True

    def allocate(self) -> int:
        """Takes a free page, else evicts the least recently released cached page."""
        page = self.free_pages.take()
        if page is None:
            page = self.evict_one()
            if page is None:
                raise RuntimeError("no page left; callers check num_free_pages first")
        self.tracer.emit("allocate", "page", "pages/device", page=page)
        self.ref_counts[page] = 1
        return page

    def evict_one(self) -> int | None:
        """Evicts the least recently released cached page; None when there is none."""
        page = None if self.prefix_cache is None else self.prefix_cache.evict_one()
        if page is None:
            return None
        if self._evictable_hashes is not None:
            self._evicted.append((self._evictable_hashes.pop(page), page))
        self.num_evictions += 1
        self.tracer.emit("evict", "page", "pages/device", page=page)
        return page

    def cached_pages(self) -> list[CachedPage]:
        """The unreferenced cached pages (evicted first when a page is needed), least recently
        released first; none without the prefix cache."""
        return [] if self.prefix_cache is None else self.prefix_cache.cached_pages()

    def keep_cached(self, pages: Sequence[int]) -> None:
        """Cached pages to evict only after every other one, in this order (see
        `PrefixCache.keep`); a no-op without the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.keep(pages)

    def num_givable_pages(self) -> int:
        """Cached pages `give_back_cached` would return now."""
        if self.prefix_cache is None or self._evictable_hashes is not None:
            return 0
        return self.prefix_cache.num_evictable()

    def give_back_cached(self, num_pages: int) -> int:
        """Evicts up to `num_pages` least recently released cached pages back to the page
        source (another engine sharing the source needs them); returns how many. A manager
        recording evictions for a tier gives none: its spill reads an evicted page in its own
        engine's next step, and another engine could overwrite the page before that."""
        if self._evictable_hashes is not None:
            return 0
        given = 0
        while given < num_pages and (page := self.evict_one()) is not None:
            self.free_pages.give(page)
            given += 1
        return given
