"""Swapping: a preempted sequence's pages copied to host memory (into a host slot, or through
the tiers) and back, with a KIVI window beside them. Where block tables keep retention budgets
of their own (PyramidKV's table groups, AdaKV's (layer, kv head) tables), each table's pages
travel at its own cached length, which the retention record keeps while the sequence is away
(`RetentionManager.group_shifts`)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from kvjax.kv.retention_host import RetentionManager
from kvjax.memory.block_manager import RELEASED
from kvjax.memory.host_moves import HostMoves
from kvjax.memory.op_plan import OpPlan, padded
from kvjax.memory.ops import KVOp, KVOpKind
from kvjax.memory.page_versions import PageVersions
from kvjax.shapes import pages_for


class SwapSlots:
    """The host slots of swapped sequences' copies (`KVOp.host_slot`), the lowest free one
    first, so a replay hands out the same ones."""

    def __init__(self):
        self._held: dict[str, tuple[int, int]] = {}  # sequence -> (slot, the copy's bits)
        self._free: list[int] = []  # a heap of the slots below the most ever held

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._held

    def take(self, seq_id: str, bits: int) -> int:
        """A free slot for the sequence's copy at `bits`."""
        slot = heapq.heappop(self._free) if self._free else len(self._held)
        self._held[seq_id] = (slot, bits)
        return slot

    def release(self, seq_id: str) -> tuple[int, int]:
        """(slot, bits) of the sequence's copy; the slot is free again."""
        slot, bits = self._held.pop(seq_id)
        heapq.heappush(self._free, slot)
        return slot, bits


class SwapMoves:
    """Swaps sequences out to host memory and back for the KV cache manager.

    Attributes:
      swap_space: host copies of swapped-out sequences (through the tiers when enabled).
      tiers: the host/disk TierManager, or None.
      keeps_windows: whether sequences hold state beside their pages (KIVI windows).

    Args:
      free: frees a swapped-out sequence's device pages (`KVCacheManager.free`).
      register_returning: registers a returning sequence (`ReturningSequences.register`).
      spill: spills evicted prefix-cache pages before a copy writes to them.
    """

    def __init__(self, allocator, swap_space, retention: RetentionManager, ops: OpPlan,
                 versions: PageVersions, host: HostMoves, stats: dict, *, tiers, page_size: int,
                 free: Callable[..., None], register_returning: Callable[..., int | None],
                 spill: Callable[[], None]):
        self.allocator = allocator
        self.swap_space = swap_space
        self.retention = retention
        self.ops = ops
        self.versions = versions
        self.host = host
        self.stats = stats
        self.tiers = tiers
        self.page_size = page_size
        self._free_pages = free
        self._register_returning = register_returning
        self._spill = spill
        # swapped sequence -> (block-table entry, layer group) of each page its host copy holds
        self._swapped_entries: dict[str, list[tuple[int, int]]] = {}
        self._swap_slots = SwapSlots()  # without tiers: where each swapped copy is

    def swap_out(self, seq_id: str, num_computed: int, *, demote_bits: int = 0) -> None:
        """Copies a sequence's computed pages (every layer group's, and its window) to host
        memory (int8 or int4 with `demote_bits`: see `kvjax.engine.swap`), then frees them.
        Without tiers the copy is a `KVOpKind.SWAP_OUT` op into a host slot, planned before the
        frees' scrubs and whatever reuses the pages; with tiers on the pages are the tiers'
        spills and a window alone takes such an op.

        A sequence retention compacted keeps its record of which tokens its pages hold (one
        per table group where groups keep budgets of their own: each group's copy is its
        table's pages at its own cached length)."""
        entries = self._entries_to_move(seq_id, num_computed)
        tables = self.allocator.block_tables(seq_id)
        pages = [tables[group][index] for index, group in entries]
        if self.tiers is None:
            nbytes = self._swap_out_op(seq_id, entries, pages, demote_bits)
        else:  # a copy in the tiers comes back as tier loads; a window beside it, from a slot
            nbytes = self.swap_space.swap_out(None, seq_id, pages, demote_bits=demote_bits)
            if self.keeps_windows:
                nbytes += self._swap_out_op(seq_id, [], [], 0)
        self.stats["swaps_out"] += 1
        self.stats["swap_bytes"] += nbytes
        self._free_pages(seq_id, keep_retention=True)

    def swap_out_bytes(self, seq_id: str, num_computed: int) -> int:
        """Bytes `swap_out` (without demotion) would move now: the pages the sequence holds
        in every block table, each up to its own cached length (those retention compacted
        away are back in the pool), and its window."""
        return self._copy_bytes(len(self._entries_to_move(seq_id, num_computed)), 0,
                                (0,) if self.keeps_windows else ())

    def _entries_to_move(self, seq_id: str, num_computed: int) -> list[tuple[int, int]]:
        """(block-table entry, layer group) of each page a swap out copies: every table's
        pages of its cached tokens but the host-resident ones (host memory already: they wait
        in the host pool)."""
        held = num_computed - self.retention.num_evicted(seq_id)
        return self._held_entries(seq_id, self.host.num_host_pages(seq_id), [
            pages_for(held + shift, self.page_size)
            for shift in self.retention.group_shifts(seq_id)
            or [0] * len(self.allocator.block_tables(seq_id))])

    def _swap_out_op(self, seq_id: str, entries: list[tuple[int, int]], pages: list[int],
                     bits: int) -> int:
        """Issues the SWAP_OUT of `pages` into a free host slot; returns the copy's bytes."""
        slot = self._swap_slots.take(seq_id, bits)
        self._swapped_entries[seq_id] = entries
        window = (self.allocator.seq_slot(seq_id),) if self.keeps_windows else ()
        self.ops.issue(KVOp(KVOpKind.SWAP_OUT, tuple(pages), src=padded(pages) if pages else (),
                         seq_slots=window, host_slot=slot, bits=bits))
        return self._copy_bytes(len(pages), bits, window)

    def _copy_bytes(self, num_pages: int, bits: int, window: tuple[int, ...]) -> int:
        """Bytes of a host copy of `num_pages` pages at `bits`, with a window or not."""
        kv = self.ops.device.kv  # its shapes and dtypes only
        return (self.swap_space.page_bytes(kv, bits) * num_pages
                + (self.swap_space.window_bytes(kv) if window else 0))

    def swap_in(self, seq_id: str, token_ids: Sequence[int], num_computed: int,
                cache_key: bytes, version: str) -> bool:
        """Brings a swapped sequence's pages back (prefix-cache hits reused, the rest from host
        memory, as a `KVOpKind.SWAP_IN` op planned before the step whose rows read them);
        False, with nothing changed, when the pool has no room."""
        cached = self._register_returning(seq_id, token_ids, num_computed, cache_key)
        if cached is None:
            return False
        pages = self.allocator.block_table(seq_id)
        first = cached // self.page_size
        num_host = self.host.num_host_pages(seq_id)
        targets, skipped = self._swap_targets(seq_id, first)
        if num_host:  # its host-resident pages come back too (those the prefix cache lacks)
            host = self.host.host_table(seq_id)
            if first < num_host:
                self.versions.to_device(host[first:num_host], pages[first:num_host])
                self._spill()
                self.ops.issue(KVOp(KVOpKind.HOST_IN, tuple(pages[first:num_host]),
                                 src=padded(host[first:num_host].tolist()),
                                 dst=padded(pages[first:num_host])))
                self.stats["host_pages_in"] += num_host - first
            self.host.host_pool.free(seq_id)
        # The copy's pages past the prefix hit, where a window still reads them.
        kept = [i for i in range(skipped, len(targets)) if targets[i] != RELEASED]
        dst = [targets[i] for i in kept]
        slot, bits = self._swap_slots.release(seq_id)
        window = (self.allocator.seq_slot(seq_id),) if self.keeps_windows else ()
        written = [p for table in self.allocator.block_tables(seq_id) for p in table[first:]
                   if p != RELEASED]
        self.ops.issue(KVOp(KVOpKind.SWAP_IN, tuple(written), src=padded(kept) if kept else (),
                         dst=padded(dst) if dst else (), seq_slots=window, host_slot=slot))
        self.versions.mark_written(written, version)
        self.stats["swaps_in"] += 1
        self.stats["swap_bytes"] += self._copy_bytes(len(dst), bits, window)
        return True

    def _held_entries(self, seq_id: str, start: int, stops: list[int]
                      ) -> list[tuple[int, int]]:
        """(block-table entry, layer group) of every page the sequence holds in entries
        [start, stops[group]) of its tables, entry by entry (a window's released entries left
        out)."""
        tables = self.allocator.block_tables(seq_id)
        return [(index, group) for index in range(start, max(stops, default=start))
                for group, table in enumerate(tables)
                if index < stops[group] and table[index] != RELEASED]

    def _swap_targets(self, seq_id: str, first: int) -> tuple[list[int], int]:
        """Where a returning sequence's swapped pages go: the page of each one's entry in its
        group's new table (RELEASED where a window no longer reads it), and how many lead
        entries before `first` the prefix cache supplied (skipped)."""
        entries = self._swapped_entries.pop(seq_id)
        tables = self.allocator.block_tables(seq_id)
        targets = [tables[group][index] for index, group in entries]
        skipped = sum(index < first for index, _ in entries)
        stored = set(entries)
        lost = [(index, group) for group, table in enumerate(tables)
                for index in range(max(first, self.host.num_host_pages(seq_id)), len(table))
                if table[index] != RELEASED and (index, group) not in stored]
        if lost:
            raise RuntimeError(f"sequence {seq_id!r} came back with pages at (entry, group) "
                               f"{lost[:4]} that its swapped copy does not hold")
        return targets, skipped

    @property
    def keeps_windows(self) -> bool:
        """Whether sequences hold state beside their pages (KIVI windows)."""
        return self.swap_space.keeps_windows

    def restore_window(self, seq_id: str) -> None:
        """With tiers on, writes a swapped sequence's window back from its host slot into its
        new slot, once it is registered again (a `KVOpKind.SWAP_IN` of no pages: they come
        back as tier loads)."""
        if not self.keeps_windows:
            return
        self._swapped_entries.pop(seq_id)
        window = (self.allocator.seq_slot(seq_id),)
        self.ops.issue(KVOp(KVOpKind.SWAP_IN, seq_slots=window,
                            host_slot=self._swap_slots.release(seq_id)[0]))
        self.stats["swap_bytes"] += self._copy_bytes(0, 0, window)

    def drop(self, seq_id: str) -> None:
        """Forgets a sequence's host copy (it finished or restarts)."""
        if seq_id in self._swap_slots:
            self.ops.issue(KVOp(KVOpKind.SWAP_DROP, host_slot=self._swap_slots.release(seq_id)[0]))
        if self.tiers is not None:
            self.swap_space.drop(seq_id)
        self._swapped_entries.pop(seq_id, None)
