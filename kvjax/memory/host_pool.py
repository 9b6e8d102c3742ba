"""The host pool's bookkeeping: which host pages hold which sequence's leading pages.

A sequence with host-resident rows keeps its first h full pages (positions [0, h * P)) in the
host pool, where its decode attention reads them (`kvjax.engine.host_rows`); its device block
table's entries for them are RELEASED. Host pages are private to one sequence (a page shared
on the device is copied out, its device reference dropped), so they need no reference counts.
Plain Python: the runner owns the pool's arrays.
"""

from __future__ import annotations

from kvjax.memory.page_pool import FreeList


class HostPagePool:
    """Host pages of `num_pages`, and each sequence's host table.

    Attributes:
      num_pages: pages in the host pool.
    """

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_host_pages must be an int >= 0, got {num_pages!r}")
        self.num_pages = num_pages
        self._free = FreeList(num_pages)
        self._tables: dict[str, list[int]] = {}

    def num_free(self) -> int:
        return self._free.num_free()

    def table(self, seq_id: str) -> list[int]:
        """The host pages of the sequence's first pages, in order (empty: none)."""
        return list(self._tables.get(seq_id, ()))

    def num_held(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def take(self, seq_id: str, num: int) -> list[int]:
        """`num` free host pages appended to the sequence's host table (the caller checks
        `num_free` first)."""
        if num > self.num_free():
            raise ValueError(f"sequence {seq_id!r} asks {num} host pages, "
                             f"{self.num_free()} free")
        pages = [self._free.take() for _ in range(num)]
        self._tables.setdefault(seq_id, []).extend(pages)
        return pages

    def give_last(self, seq_id: str, num: int) -> list[int]:
        """Drops the last `num` pages of the sequence's host table; returns them."""
        table = self._tables.get(seq_id, [])
        if num > len(table):
            raise ValueError(f"sequence {seq_id!r} holds {len(table)} host pages, not {num}")
        pages = table[len(table) - num:]
        del table[len(table) - num:]
        for page in pages:
            self._free.give(page)
        if not table:
            self._tables.pop(seq_id, None)
        return pages

    def free(self, seq_id: str) -> None:
        """Returns every host page of the sequence."""
        self.give_last(seq_id, self.num_held(seq_id))
