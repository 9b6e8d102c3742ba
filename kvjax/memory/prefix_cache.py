"""Hash-chain index of full KV pages, shared between sequences through the block manager.

A full page of P tokens is identified by the hash of its tokens chained to the hash of every page
before it, so a hit on page i implies the whole prefix up to page i matches. The chain is seeded
by a cache key (tenant salt + KV provenance fingerprint): sequences with different keys never
reach the same hash, so they never share a page. Hashes use BLAKE2b over a fixed byte encoding,
so they are equal across processes and machines (unlike Python's salted `hash`).

The index only knows pages and hashes; the block manager owns reference counts and tells the
index when an indexed page loses its last reference (it becomes evictable) or gains one again.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

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


class PrefixCache:
    """Maps hash chains of full pages to page ids; keeps unreferenced indexed pages in LRU order.

    Attributes:
        page_size: P, tokens per page.
    """

    def __init__(self, page_size: int):
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self._page_by_hash: dict[bytes, int] = {}
        self._hash_by_page: dict[int, bytes] = {}
        # Least recently released first: evict_one pops from the front.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

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

    def insert(self, page_hash: bytes, page: int) -> bool:
        """Indexes `page` under `page_hash`; returns False (and changes nothing) when the hash
        already names another page or the page is already indexed."""
        if page_hash in self._page_by_hash or page in self._hash_by_page:
            return False
        self._page_by_hash[page_hash] = page
        self._hash_by_page[page] = page_hash
        return True

    def hash_of(self, page: int) -> bytes:
        """The hash an indexed page is stored under (ValueError when it is not indexed)."""
        if page not in self._hash_by_page:
            raise ValueError(f"page {page} is not in the prefix cache")
        return self._hash_by_page[page]

    def is_indexed(self, page: int) -> bool:
        return page in self._hash_by_page

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def num_indexed(self) -> int:
        return len(self._hash_by_page)

    def num_evictable(self) -> int:
        return len(self._evictable)

    def mark_evictable(self, page: int) -> None:
        """An indexed page lost its last reference: it becomes the most recently released."""
        if page not in self._hash_by_page:
            raise ValueError(f"page {page} is not in the prefix cache")
        if page in self._evictable:
            raise ValueError(f"page {page} is already evictable")
        self._evictable[page] = None

    def mark_in_use(self, page: int) -> None:
        """An evictable page is referenced again (a prefix hit): it must not be evicted."""
        if page not in self._evictable:
            raise ValueError(f"page {page} is not evictable")
        del self._evictable[page]

    def evict_one(self) -> int | None:
        """Drops the least recently released unreferenced page from the index and returns it,
        or None when every indexed page is referenced."""
        if not self._evictable:
            return None
        page, _ = self._evictable.popitem(last=False)
        del self._page_by_hash[self._hash_by_page.pop(page)]
        return page

    def reset(self) -> list[int]:
        """Empties the index; returns the pages that were evictable (nobody references them)."""
        released = list(self._evictable)
        self._page_by_hash.clear()
        self._hash_by_page.clear()
        self._evictable.clear()
        return released
