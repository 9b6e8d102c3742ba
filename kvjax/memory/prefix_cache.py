"""Hash-chain index of full KV pages, shared between sequences through the block manager.

A full page of P tokens is identified by the hash of its tokens chained to the hash of every page
before it, so a hit on page i implies the whole prefix up to page i matches. The chain is seeded
by a cache key (tenant salt + KV provenance fingerprint): sequences with different keys never
reach the same hash, so they never share a page. Hashes use BLAKE2b over a fixed byte encoding,
so they are equal across processes and machines (unlike Python's salted `hash`).

The index only knows pages and hashes; the block manager owns reference counts and tells the
index when an indexed page loses its last reference (it becomes evictable) or gains one again.

Eviction takes the least recently released unreferenced page (`PrefixEviction.LRU`), or,
under `PrefixEviction.FAIR_SHARE`, that of the owner holding the most indexed pages: an owner
is a chain's root (one cache key: a tenant's salt with the KV provenance), so a tenant
flooding the cache with long distinct prefixes gives up its own pages before another
tenant's. Either way a caller (a KV controller, through the block manager) may name pages to
keep (`keep`): those go only after every other evictable page, in the order named. Each
indexed page counts its reuses (prefix hits), remembers when it was last released and its
depth in its chain (`CachedPage`), which is what such a caller ranks pages by.
"""

from __future__ import annotations

import collections
import enum
import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

_DIGEST_SIZE = 16


def hash_root(cache_key: bytes) -> bytes:
    """The parent hash of a sequence's first page: the digest of its cache key."""
    if not isinstance(cache_key, bytes):
        raise ValueError(f"cache_key must be bytes, got {type(cache_key).__name__}")
    return hashlib.blake2b(cache_key, digest_size=_DIGEST_SIZE, person=b"kvjax-root").digest()


def hash_page(parent_hash: bytes, page_tokens: Sequence[int]) -> bytes:
    """Hash of one full page chained to the hash of the page before it (or the root)."""
    token_bytes = np.asarray(page_tokens, dtype="<i8").tobytes()  # [P] int64, little endian
    digest = hashlib.blake2b(parent_hash, digest_size=_DIGEST_SIZE, person=b"kvjax-page")
    digest.update(token_bytes)
    return digest.digest()


def page_hash_chain(token_ids: Sequence[int], cache_key: bytes, page_size: int,
                    known: Sequence[bytes] = ()) -> list[bytes]:
    """The prefix-cache hash of every full page of `token_ids` (the chain a prefix cache
    indexes them under); `known`: the chain's first hashes, already computed by an earlier
    call on a prefix of the same tokens and key, which are not hashed again."""
    hashes = list(known)
    parent = hashes[-1] if hashes else hash_root(cache_key)
    for start in range(len(hashes) * page_size, len(token_ids) - page_size + 1, page_size):
        parent = hash_page(parent, token_ids[start:start + page_size])
        hashes.append(parent)
    return hashes


class PrefixEviction(enum.Enum):
    """Which unreferenced page the prefix cache gives up first."""

    LRU = "lru"  # the least recently released
    FAIR_SHARE = "fair_share"  # the least recently released of the owner with the most pages


class CachedPage(NamedTuple):
    """An unreferenced indexed page, as a keep policy sees it.

    Attributes:
      page: the page id.
      hits: times a lookup reused it since it was indexed.
      released_at: when it lost its last reference (the caller's clock).
      depth: its index in its hash chain (0: a sequence's first page); evicting a page strands
        the deeper pages of its chain (lookups stop at the first missing page).
    """

    page: int
    hits: int
    released_at: float
    depth: int


class PrefixCache:
    """Maps hash chains of full pages to page ids; keeps unreferenced indexed pages in LRU order.

    Attributes:
        page_size: P, tokens per page.
        eviction: the PrefixEviction policy.
    """

    def __init__(self, page_size: int, eviction: PrefixEviction = PrefixEviction.LRU):
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.eviction = PrefixEviction(eviction)
        self._page_by_hash: dict[bytes, int] = {}
        self._hash_by_page: dict[int, bytes] = {}
        # Least recently released first (evict_one pops from the front), with release times.
        self._evictable: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._hits: dict[int, int] = {}  # indexed page -> reuses
        self._depth: dict[int, int] = {}  # indexed page -> index in its chain
        self._keep: dict[int, int] = {}  # page -> rank: evicted last, lowest rank first
        self._owner: dict[int, bytes] = {}  # indexed page -> its chain's root hash
        self._owned: collections.Counter[bytes] = collections.Counter()  # root -> pages

    def lookup(self, token_ids: Sequence[int], cache_key: bytes) -> list[int]:
        """Pages holding the longest indexed prefix of full pages of `token_ids`, in order."""
        parent = hash_root(cache_key)
        pages = []
        for start in range(0, len(token_ids) - self.page_size + 1, self.page_size):
            parent = hash_page(parent, token_ids[start : start + self.page_size])
            page = self._page_by_hash.get(parent)
            if page is None:
                break
            pages.append(page)
        return pages

    def chain_hashes(self, token_ids: Sequence[int], cache_key: bytes) -> list[bytes]:
        """The hash chain of the full pages of `token_ids`, whether indexed or not."""
        return page_hash_chain(token_ids, cache_key, self.page_size)

    def lookup_each(self, token_ids: Sequence[int], cache_key: bytes) -> list[int | None]:
        """For each full page of `token_ids`, the indexed page holding it, or None (a chain
        whose older pages were evicted still finds its newer ones: a sliding window's hit)."""
        return [self._page_by_hash.get(h) for h in self.chain_hashes(token_ids, cache_key)]

    def insert(self, page_hash: bytes, page: int, depth: int = 0, owner: bytes = b"") -> bool:
        """Indexes `page` (the `depth`-th page of its chain, whose root hash is `owner`) under
        `page_hash`; returns False (and changes nothing) when the hash already names another
        page or the page is already indexed."""
        if page_hash in self._page_by_hash or page in self._hash_by_page:
            return False
        self._page_by_hash[page_hash] = page
        self._hash_by_page[page] = page_hash
        self._hits[page] = 0
        self._depth[page] = depth
        self._owner[page] = owner
        self._owned[owner] += 1
        return True

    def record_hit(self, page: int) -> None:
        """A lookup's sequence reuses the indexed `page`."""
        if page not in self._hash_by_page:
            raise ValueError(f"page {page} is not in the prefix cache")
        self._hits[page] += 1

    def num_hits(self, page: int) -> int:
        """Times a lookup reused `page` since it was indexed (0 when it is not indexed)."""
        return self._hits.get(page, 0)

    def cached_pages(self) -> list[CachedPage]:
        """The evictable pages, least recently released first."""
        return [CachedPage(page, self._hits[page], released_at, self._depth[page])
                for page, released_at in self._evictable.items()]

    def oldest_release(self) -> float | None:
        """When the least recently released evictable page was released (None: none is)."""
        return next(iter(self._evictable.values()), None)

    def keep(self, pages: Iterable[int]) -> None:
        """From now on the named pages are evicted only after every other evictable page, in
        the order named (replaces the previous call's pages; pages not indexed are ignored)."""
        self._keep = {page: rank for rank, page in enumerate(pages)}

    def hash_of(self, page: int) -> bytes:
        """The hash an indexed page is stored under (ValueError when it is not indexed)."""
        if page not in self._hash_by_page:
            raise ValueError(f"page {page} is not in the prefix cache")
        return self._hash_by_page[page]

    def page_hashes(self) -> list[bytes]:
        """The hash of every indexed page (what a router tests a prompt's chain against)."""
        return list(self._page_by_hash)

    def is_indexed(self, page: int) -> bool:
        return page in self._hash_by_page

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def num_indexed(self) -> int:
        return len(self._hash_by_page)

    def num_evictable(self) -> int:
        return len(self._evictable)

    def mark_evictable(self, page: int, now: float = 0.0) -> None:
        """An indexed page lost its last reference at `now`: it becomes the most recently
        released."""
        if page not in self._hash_by_page:
            raise ValueError(f"page {page} is not in the prefix cache")
        if page in self._evictable:
            raise ValueError(f"page {page} is already evictable")
        self._evictable[page] = now

    def mark_in_use(self, page: int) -> None:
        """An evictable page is referenced again (a prefix hit): it must not be evicted."""
        if page not in self._evictable:
            raise ValueError(f"page {page} is not evictable")
        del self._evictable[page]

    def evict_one(self) -> int | None:
        """Drops an unreferenced page from the index and returns it, or None when every
        indexed page is referenced: the least recently released one not kept, else the first
        kept one (see `keep`)."""
        if not self._evictable:
            return None
        candidates = (p for p in self._evictable if p not in self._keep)
        if self.eviction is PrefixEviction.FAIR_SHARE:
            # Each owner's least recently released page, then the owner with the most pages.
            firsts: dict[bytes, int] = {}
            for p in candidates:
                firsts.setdefault(self._owner[p], p)
            candidates = iter(sorted(firsts.values(), key=lambda p: -self._owned[self._owner[p]]))
        page = next(candidates, None)
        if page is None:
            page = min(self._evictable, key=self._keep.__getitem__)
        del self._evictable[page]
        self._drop(page)
        return page

    def forget(self, page: int) -> bool:
        """Drops a referenced page from the index (its rows no longer hold what its hash
        names: a mixed-precision pool demoted them in place); it goes to the free list when its
        last reference is dropped. False when it was not indexed; ValueError for an evictable
        page (nothing references it, so nothing could free it afterwards)."""
        if page not in self._hash_by_page:
            return False
        if page in self._evictable:
            raise ValueError(f"page {page} is evictable: only a referenced page is forgotten")
        self._drop(page)
        return True

    def _drop(self, page: int) -> None:
        """Removes an indexed page's hash, hits, depth, rank and owner."""
        del self._page_by_hash[self._hash_by_page.pop(page)]
        del self._hits[page], self._depth[page]
        self._keep.pop(page, None)
        owner = self._owner.pop(page)
        self._owned[owner] -= 1
        if not self._owned[owner]:
            del self._owned[owner]

    def reset(self) -> list[int]:
        """Empties the index; returns the pages that were evictable (nobody references them)."""
        released = list(self._evictable)
        for index in (self._page_by_hash, self._hash_by_page, self._evictable, self._hits,
                      self._depth, self._keep, self._owner, self._owned):
            index.clear()
        return released


class HitLedger:
    """Which tenants have paid for which cached pages, for prefix caches shared across tenants.

    Where several tenants share a prefix-cache salt, a hit on a page another tenant computed
    tells the reader (by its speed) that the other sent that prefix. With the ledger, a tenant
    hits a shared page only once it has computed that page's tokens itself: its first request
    with a prefix runs as a miss, so every tenant sees its own timing only. Pages stay shared
    (one copy in the pool) and later requests of each tenant hit them. Entries are kept for the
    `capacity` most recently used (tenant, page hash) pairs; a forgotten pair costs one more
    recompute, never a leak.
    """

    def __init__(self, capacity: int = 1 << 16):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity!r}")
        self.capacity = capacity
        self._paid: collections.OrderedDict[tuple[str | None, bytes], None] = (
            collections.OrderedDict())

    def allowed_pages(self, tenant: str | None, hashes: Sequence[bytes]) -> int:
        """How many leading pages of a chain (`hashes`) the tenant may hit."""
        for n, h in enumerate(hashes):
            if (tenant, h) not in self._paid:
                return n
            self._paid.move_to_end((tenant, h))
        return len(hashes)

    def record(self, tenant: str | None, hashes: Sequence[bytes]) -> None:
        """The tenant has computed (or was allowed to hit) these pages."""
        for h in hashes:
            self._paid[(tenant, h)] = None
            self._paid.move_to_end((tenant, h))
        while len(self._paid) > self.capacity:
            self._paid.popitem(last=False)

    def __len__(self) -> int:
        return len(self._paid)
