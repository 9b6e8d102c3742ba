"""Edits of a registered sequence's block table beyond appending: compaction (`retain`),
truncation, and handing pages out to (and back from) another store, such as a host pool.

`BlockManager` delegates these to a `TableEdits` over its `PagePool` and its sequences.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from kvjax.memory.compaction import compact, retain_layout
from kvjax.memory.page_pool import PagePool


class AllocStatus(enum.Enum):
    """Outcome of an allocation; on NO_PAGES nothing changed and the scheduler preempts."""

    OK = "ok"
    NO_PAGES = "no_pages"


RELEASED = -1  # a block-table entry whose page a sliding-window manager gave back


@dataclasses.dataclass
class SeqPages:
    """A registered sequence's pages and what the prefix cache knows of them."""

    # [pages_per_seq] page ids, position p lives in block_table[p // P]; RELEASED entries (a
    # sliding window's pages that fell out of it) hold no page.
    block_table: list[int]
    cache_key: bytes
    page_hashes: list[bytes]  # hash chain of the leading full pages whose content is known
    num_tokens: int  # current length: the cached prefix, then the `end` of the last write
    num_cached_tokens: int  # prompt tokens attached from the prefix cache
    is_indexable: bool = True  # False once `retain` dropped tokens from the pages


class TableEdits:
    """Compacts, truncates, empties and refills block-table entries of registered sequences.

    Args:
        pool: the pages.
        page_size: P, tokens per page.
        get: the sequence of an id (ValueError for an unknown one).
    """

    def __init__(self, pool: PagePool, page_size: int, get: Callable[[Hashable], SeqPages]):
        self.pool = pool
        self.page_size = page_size
        self._get = get

    def writes_in_place(self, seq_id: Hashable, start: int, end: int) -> SeqPages | None:
        """The sequence when [start, end) (start < end) lies in one page it already holds
        alone (no new page, no copy: all `BlockManager.ensure_writable` would do is record
        the write, `record_in_place`); else None. A decode step's common case, checked
        cheaply: a sequence under per-head tables writes into L * K tables each step."""
        seq = self._get(seq_id)
        index = start // self.page_size
        if not 0 <= start < end or (end - 1) // self.page_size != index or \
                index >= len(seq.block_table):
            return None
        page = seq.block_table[index]
        return None if page == RELEASED or self.pool.is_shared(page) else seq

    def record_in_place(self, seq: SeqPages, start: int, end: int) -> None:
        """`BlockManager.ensure_writable(seq_id, start, end)` for a sequence that
        `writes_in_place` returned: only its length and its stale page hashes change."""
        del seq.page_hashes[start // self.page_size:]
        seq.num_tokens = end

    def retain(
        self, seq_id: Hashable, keep: Sequence[int]
    ) -> tuple[AllocStatus, np.ndarray, np.ndarray, list[int]]:
        """Keeps only positions `keep` of `seq_id`, compacted in order to positions 0..S'-1.

        A page of the new layout whose tokens are one old page's tokens at the same offsets is
        that old page, unmoved. Every other page of the new layout gets its tokens by slot moves
        into a private page: one of the sequence's old pages that no other sequence or the
        prefix cache holds and the new layout does not reuse (the one at the same index where
        it can), else a new page, so shared and indexed pages are never written. Old pages the
        new layout does not use are released. From now on the sequence indexes nothing in the
        prefix cache (its pages no longer hold the K/V of its token chain). All-or-nothing: on
        NO_PAGES nothing changed.

        Args:
            seq_id: a registered sequence.
            keep: [S'] strictly increasing positions in [0, length), S' >= 1.

        Returns:
            (status, src, dst, freed): the device copies token slot src[i] (page * P + offset)
            into slot dst[i], every read before any write, before the next write to the
            sequence; `freed` are the pages that went to the free list.
        """
        seq = self._get(seq_id)
        keep = np.asarray(keep, np.int64)  # [S']
        layout = retain_layout(seq.block_table, seq.num_tokens, keep, self.page_size,
                               self.pool.is_shared)
        if layout.num_alloc > self.pool.num_free_pages():
            return AllocStatus.NO_PAGES, np.zeros(0, np.int64), np.zeros(0, np.int64), []
        old = seq.block_table
        table, src, dst = compact(old, keep, self.page_size, layout, self.pool.allocate)
        kept = set(layout.reused.values()) | set(layout.own.values())
        freed = [page for index, page in enumerate(old)
                 if index not in kept and self.pool.release(page)]
        seq.block_table = table
        seq.num_tokens = len(keep)
        seq.page_hashes = []
        seq.is_indexable = False
        return AllocStatus.OK, src, dst, freed

    def pages_to_retain(self, seq_id: Hashable, keep: Sequence[int]) -> int:
        """New pages `retain(seq_id, keep)` would take from the free list."""
        seq = self._get(seq_id)
        return retain_layout(seq.block_table, seq.num_tokens, np.asarray(keep, np.int64),
                             self.page_size, self.pool.is_shared).num_alloc

    def truncate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Shortens a sequence to its first `num_tokens` tokens (rejected speculative drafts):
        pages past them are released and hashes of pages they no longer fill are dropped.

        Returns:
            The pages that went to the free list.
        """
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"truncate of sequence {seq_id!r} to {num_tokens} tokens, but it "
                             f"has {seq.num_tokens}")
        keep = -(-num_tokens // self.page_size)
        tail, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
        del seq.page_hashes[num_tokens // self.page_size:]
        seq.num_tokens = num_tokens
        return [page for page in reversed(tail) if page != RELEASED and self.pool.release(page)]

    def release_pages(self, seq_id: Hashable, first: int, num: int) -> tuple[list[int], list[int]]:
        """Gives back the device pages of block-table entries [first, first + num) (their
        content now lives elsewhere: a host pool); the entries become RELEASED.

        Returns:
            (the pages the entries held, in order; those that went to the free list).
        """
        seq = self._get(seq_id)
        entries = seq.block_table[first:first + num]
        if len(entries) != num or RELEASED in entries:
            raise ValueError(f"sequence {seq_id!r} holds no pages at entries "
                             f"[{first}, {first + num})")
        seq.block_table[first:first + num] = [RELEASED] * num
        return entries, [page for page in entries if self.pool.release(page)]

    def fill_pages(self, seq_id: Hashable, first: int, num: int) -> list[int] | None:
        """Fresh private pages for RELEASED entries [first, first + num) (content coming back
        from elsewhere); None, with nothing changed, when the pool lacks them."""
        seq = self._get(seq_id)
        if seq.block_table[first:first + num] != [RELEASED] * num:
            raise ValueError(f"entries [{first}, {first + num}) of sequence {seq_id!r} are not "
                             "all released")
        if self.pool.num_free_pages() < num:
            return None
        pages = [self.pool.allocate() for _ in range(num)]
        seq.block_table[first:first + num] = pages
        return pages
