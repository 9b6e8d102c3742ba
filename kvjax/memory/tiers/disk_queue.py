"""The disk tier's traffic: host-tier evictions written to page files, page files read for loads."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from kvjax.memory.tiers.disk import DiskTier
from kvjax.memory.tiers.ledger import TransferLedger
from kvjax.memory.transfer import Fault, Transfer, TransferKind, TransferState


class DiskQueue:
    """Hands page writes and reads to the disk tier's workers and lands them when they are done.

    Attributes:
        disk: the DiskTier, or None (pages the host tier evicts are then dropped).
        inflight: disk reads and writes on the workers.
        writing: key -> its write in flight.
    """

    def __init__(self, disk: DiskTier | None, ledger: TransferLedger, *, page_bytes: int,
                 timeout_polls: int):
        self.disk = disk
        self._ledger = ledger
        self._page_bytes = page_bytes
        self._timeout_polls = timeout_polls
        self.inflight: list[Transfer] = []
        self.writing: dict[Hashable, Transfer] = {}

    def spill(self, evicted: list[tuple[Hashable, list[np.ndarray], int]]) -> None:
        """Hands the pages the host tier evicted to the disk workers (dropped without a disk)."""
        stats = self._ledger.stats
        for key, page, checksum in evicted:
            if self.disk is None:
                stats["pages_dropped"] += 1
                continue
            t = self._ledger.track(Transfer(TransferKind.HOST_TO_DISK, (key,), self._page_bytes))
            if t.fault is Fault.FAIL:
                t.fail("injected failure")
            else:
                flip = (self._ledger.faults.flip_position(self._page_bytes)
                        if t.fault is Fault.CORRUPT else None)
                stats["pages_dropped"] += self.disk.start_write(t, key, page, checksum, flip)
            if t.state is TransferState.FAILED:
                self._ledger.finished(t)
                stats["pages_dropped"] += 1
                continue
            t.issue_time = self._ledger.clock()
            stats["bytes_host_to_disk"] += t.nbytes
            self.inflight.append(t)
            self.writing[key] = t

    def write_source(self, key: Hashable) -> tuple[list[np.ndarray], int]:
        """The page leaves [L, ...] and checksum that `key`'s write in flight was handed, as the
        host tier held them."""
        io = self.writing[key].payload
        return io.source, io.checksum

    def start_read(self, owner: Hashable, key: Hashable) -> Transfer:
        """Hands the read of `key`'s page file to a worker; the transfer is FAILED when an
        injected fault failed it."""
        t = self._ledger.track(Transfer(TransferKind.DISK_TO_HOST, (key,), self._page_bytes,
                                        owner=owner))
        if t.fault is Fault.FAIL:
            t.fail("injected failure")
            self._ledger.finished(t)
            return t
        flip = (self._ledger.faults.flip_position(self.disk.file_bytes)
                if t.fault is Fault.CORRUPT else None)
        self.disk.start_read(t, key, flip)
        t.issue_time = self._ledger.clock()
        self._ledger.stats["bytes_disk_to_host"] += t.nbytes
        self.inflight.append(t)
        return t

    def abandon(self, t: Transfer, reason: str) -> None:
        """Fails a disk transfer in flight (an abandoned write's page counts as dropped)."""
        self.inflight.remove(t)
        if t.kind is TransferKind.HOST_TO_DISK:
            self.writing.pop(t.keys[0], None)
            self._ledger.stats["pages_dropped"] += 1
        self.disk.abandon(t, reason)
        self._ledger.finished(t)

    def poll(self, transfers: Sequence[Transfer]) -> None:
        """Commits (or fails) the disk `transfers` whose workers finished; times out the rest."""
        for t in list(transfers):
            t.polls += 1
            delayed = t.fault is Fault.DELAY and t.polls <= self._ledger.faults.config.delay_polls
            if delayed or not t.payload.future.done():
                if t.polls > self._timeout_polls:
                    self.abandon(t, f"timed out after {t.polls - 1} polls")
                    self._ledger.stats["transfers_timed_out"] += 1
                continue
            self.inflight.remove(t)
            t.land_time = self._ledger.clock()
            if t.kind is TransferKind.HOST_TO_DISK:
                del self.writing[t.keys[0]]
                self.disk.land_write(t, t.keys[0])
                if t.state is TransferState.FAILED:
                    self._ledger.stats["pages_dropped"] += 1
            else:
                self.disk.land_read(t, t.keys[0])
            self._ledger.finished(t)

    def wait(self, transfers: Sequence[Transfer]) -> None:
        """Blocks until the workers finished `transfers` and every abandoned write."""
        if self.disk is not None:
            self.disk.wait(transfers)
