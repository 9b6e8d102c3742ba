"""Host-resident pages of decode rows: a row's first pages moved to the host pool and back
(`HostSplitPolicy`), and ECHO's host-authoritative pages (`kvjax.scheduler.echo`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvjax.memory.echo_pages import EchoPages
from kvjax.memory.host_pool import HostPagePool
from kvjax.memory.op_plan import OpPlan, padded
from kvjax.memory.ops import KVOp, KVOpKind
from kvjax.memory.page_versions import PageVersions


class HostMoves(EchoPages):
    """Moves sequences' pages between the device pool and the host pool.

    Attributes:
      host_pool: the host pool's bookkeeping, or None (then nothing is host-resident).
      allocator: the device page allocator.
      ops: the OpPlan the HOST_OUT / HOST_IN copies go through.
      versions: the PageVersions ledger, which follows each copy.

    Args:
      spill: spills evicted prefix-cache pages before a copy or scrub writes to them.
      scrub: zeroes freed device pages (with `scrub_freed_pages`).
    """

    def __init__(self, host_pool: HostPagePool | None, allocator, ops: OpPlan,
                 versions: PageVersions, stats: dict, *, scrub_freed_pages: bool,
                 spill: Callable[[], None], scrub: Callable[[Sequence[int]], None]):
        self.host_pool = host_pool
        self.allocator = allocator
        self.ops = ops
        self.versions = versions
        self.stats = stats
        self.scrub_freed_pages = scrub_freed_pages
        self._spill = spill
        self._scrub = scrub

    def num_host_pages(self, seq_id: str) -> int:
        """How many of the sequence's first pages live in the host pool (0 without one)."""
        return 0 if self.host_pool is None else self.host_pool.num_held(seq_id)

    def host_table(self, seq_id: str) -> np.ndarray:
        """[h] int32, the host-pool pages of the sequence's first h pages."""
        return np.asarray([] if self.host_pool is None else self.host_pool.table(seq_id),
                          np.int32)

    def num_free_host_pages(self) -> int:
        return 0 if self.host_pool is None else self.host_pool.num_free()

    def to_host(self, seq_id: str, num: int) -> bool:
        """Moves the sequence's next `num` device pages after its host-resident ones to the
        host pool (full pages only: the caller checks) and gives the device pages back;
        False, with nothing changed, when the host pool lacks room."""
        if num <= 0:
            return True
        if self.host_pool is None or self.host_pool.num_free() < num:
            return False
        first = self.host_pool.num_held(seq_id)
        src, freed = self.allocator.release_pages(seq_id, first, num)
        dst = self.host_pool.take(seq_id, num)
        self.versions.to_host(src, dst)
        self.ops.issue(KVOp(KVOpKind.HOST_OUT, tuple(src), src=padded(src), dst=padded(dst)))
        self.stats["host_pages_out"] += num
        if self.scrub_freed_pages and freed:
            self._spill()
            self._scrub(freed)
        return True

    def to_device(self, seq_id: str, num: int) -> bool:
        """Brings the sequence's last `num` host-resident pages back into fresh device pages;
        False, with nothing changed, when the device pool lacks room."""
        if num <= 0:
            return True
        first = self.num_host_pages(seq_id) - num
        if first < 0:
            raise ValueError(f"sequence {seq_id!r} holds {first + num} host pages, not {num}")
        dst = self.allocator.fill_pages(seq_id, first, num)
        if dst is None:
            return False
        self._spill()  # Before the copy overwrites pages evicted for it.
        src = self.host_pool.give_last(seq_id, num)
        self.versions.to_device(src, dst)
        self.ops.issue(KVOp(KVOpKind.HOST_IN, tuple(dst), src=padded(src), dst=padded(dst)))
        self.stats["host_pages_in"] += num
        return True

