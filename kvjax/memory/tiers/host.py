"""The host tier: pages in host memory (jax memory kind `pinned_host` where the backend has it)."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Hashable, Sequence

import numpy as np

log = logging.getLogger(__name__)


def host_memory_kind(device, *, user: str = "the host tier") -> str | None:
    """`pinned_host`, else `unpinned_host`, else None (numpy), logging any fallback for `user`."""
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            if kind != "pinned_host":
                log.warning("backend %s lacks pinned_host; %s uses %s", device.platform, user,
                            kind)
            return kind
    log.warning("backend %s has no host memory kind; %s uses numpy", device.platform, user)
    return None



@dataclasses.dataclass(eq=False)
class _HostChunk:
    leaves: list  # host arrays, each [L, n, ...]
    nbytes: int
    num_live: int


class HostTier:
    """Pages in host memory under a byte budget, least recently used first out.

    Attributes:
        budget_bytes: the most bytes its live chunks may hold.
        used_bytes: bytes held by chunks with at least one live page.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._entries: collections.OrderedDict[Hashable, tuple[_HostChunk, int, int]] = \
            collections.OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def put(self, keys: Sequence[Hashable], leaves: list, checksums: np.ndarray, nbytes: int
            ) -> list[tuple[Hashable, list[np.ndarray], int]]:
        """Stores a landed chunk of len(keys) pages; returns the pages evicted to make room.

        Evicted pages come back as (key, per-page numpy leaves [L, ...], checksum).
        """
        if nbytes > self.budget_bytes:
            raise ValueError(f"a chunk of {nbytes} bytes exceeds the host budget "
                             f"{self.budget_bytes}")
        for key in keys:
            if key in self._entries:
                self.remove(key)
        evicted = []
        while self.used_bytes + nbytes > self.budget_bytes:
            evicted.append(self._evict_lru())
        chunk = _HostChunk(leaves=leaves, nbytes=nbytes, num_live=len(keys))
        self.used_bytes += nbytes
        for slot, key in enumerate(keys):
            self._entries[key] = (chunk, slot, int(checksums[slot]))
        return evicted

    def _evict_lru(self) -> tuple[Hashable, list[np.ndarray], int]:
        key = next(iter(self._entries))
        page, checksum = self.peek(key), self.checksum(key)
        self.remove(key)
        return key, page, checksum

    def peek(self, key: Hashable) -> list[np.ndarray]:
        """A copy of one page's leaves, each [L, ...], leaving the LRU order alone."""
        chunk, slot, _ = self._entries[key]
        return [np.array(np.asarray(x)[:, slot]) for x in chunk.leaves]

    def remove(self, key: Hashable) -> None:
        chunk, _, _ = self._entries.pop(key)
        chunk.num_live -= 1
        if chunk.num_live == 0:
            self.used_bytes -= chunk.nbytes
            chunk.leaves = []

    def checksum(self, key: Hashable) -> int:
        return self._entries[key][2]

    def gather(self, keys: Sequence[Hashable], out: list[np.ndarray], offset: int) -> None:
        """Copies pages `keys` into out[:, offset + i] (page-first numpy leaves); touches LRU."""
        views: dict[int, list[np.ndarray]] = {}
        for i, key in enumerate(keys):
            chunk, slot, _ = self._entries[key]
            self._entries.move_to_end(key)
            view = views.setdefault(id(chunk), [np.asarray(x) for x in chunk.leaves])
            for dst, src in zip(out, view, strict=True):
                dst[:, offset + i] = src[:, slot]

