"""Tier loads: pages from the host and disk tiers back into device pages, as checked
transfers the `TierManager` decides (a mixin of it: it supplies the ledger, the tiers, the
port and the transfers in flight)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from kvjax.memory.ops import KVOp, KVOpKind, TierLoadPlan
from kvjax.memory.transfer import Fault, Transfer, TransferKind, TransferState


@dataclasses.dataclass
class _Load:
    keys: list[Hashable]
    pages: list[int]  # the device page of each key
    # Each key's source until issued: None (a host page), its disk read, or (page leaves,
    # checksum) from the source of its disk write in flight.
    reads: list[Transfer | tuple[list[np.ndarray], int] | None]
    is_issued: bool = False  # whether its host -> device transfers were issued
    transfers: list[Transfer] = dataclasses.field(default_factory=list)
    num_pages: list[int] = dataclasses.field(default_factory=list)  # pages of each transfer


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """A finished load: `num_loaded` leading pages of `num_issued` are committed in the pool."""

    owner: Hashable
    num_issued: int
    num_loaded: int


class TierLoads:
    """Loads of the TierManager: issued, verified on landing, scattered, cancelled."""

    def load(self, owner: Hashable, keys: Sequence[Hashable], pages: Sequence[int]) -> int:
        """Issues loads of `keys` into the device `pages` (same order) for `owner`.

        Pages on disk are first read by the disk workers (a page whose disk write is in flight
        is taken from the write's source); once every read of the load has committed or failed
        (`poll`), the leading pages that are at hand travel to the device
        asynchronously, and `poll` scatters each verified chunk into the pool. A load of host
        pages only goes to the device at once. Stops at the first key that is missing.

        Returns:
            The number of leading keys issued (0: nothing to wait for).
        """
        if owner in self._loads:
            raise ValueError(f"owner {owner!r} already has a load in flight")
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        reads: list[Transfer | tuple[list[np.ndarray], int] | None] = []
        for key in keys:
            if key in self.host:
                reads.append(None)
            elif key in self._disk_queue.writing:
                reads.append(self._disk_queue.write_source(key))
            elif self.disk is not None and key in self.disk:
                t = self._disk_queue.start_read(owner, key)
                if t.state is TransferState.FAILED:
                    break
                reads.append(t)
            else:
                break
        if not reads:
            return 0
        load = _Load(keys=list(keys[:len(reads)]), pages=list(pages[:len(reads)]), reads=reads)
        self._loads[owner] = load
        if not any(isinstance(t, Transfer) for t in reads):
            self._issue_load(owner, load)
        return len(reads)

    def _issue_load(self, owner: Hashable, load: _Load) -> None:
        """Sends a load's leading pages at hand (host pages still there, disk reads committed)
        to the device in chunks."""
        part: list[tuple[Hashable, tuple[list[np.ndarray], int] | None]] = []
        for key, read in zip(load.keys, load.reads, strict=True):
            if read is None and key in self.host:
                part.append((key, None))
            elif isinstance(read, tuple):
                part.append((key, read))
            elif isinstance(read, Transfer) and read.state is TransferState.COMMITTED:
                part.append((key, read.result()))
            else:
                break
        load.reads = []
        load.is_issued = True
        start = 0
        for size in self._chunk_sizes(len(part)):
            load.transfers.append(self._issue_host_to_device(
                owner, part[start:start + size],
                np.asarray(load.pages[start:start + size], np.int32)))
            load.num_pages.append(size)
            start += size

    def _issue_host_to_device(self, owner: Hashable, part, pages: np.ndarray) -> Transfer:
        keys = tuple(k for k, _ in part)
        t = self._ledger.track(Transfer(TransferKind.HOST_TO_DEVICE, keys,
                                        len(keys) * self.page_bytes, owner=owner))
        if t.fault is Fault.FAIL:
            t.fail("injected failure")
            self._ledger.finished(t)
            return t
        staged = [np.empty((s[0], len(keys), *s[1:]), d)
                  for s, d in zip(self._port.page_shapes, self._port.page_dtypes, strict=True)]
        expected = np.empty([len(keys)], np.uint32)
        host_run: list[Hashable] = []
        for i, (key, read) in enumerate(part):
            if read is None:
                host_run.append(key)
                expected[i] = self.host.checksum(key)
                continue
            self.host.gather(host_run, staged, i - len(host_run))
            host_run = []
            page, expected[i] = read
            for dst, src in zip(staged, page, strict=True):
                dst[:, i] = src
        self.host.gather(host_run, staged, len(part) - len(host_run))
        if t.fault is Fault.CORRUPT:
            staged = self._ledger.faults.corrupt(staged)
        t.payload = (expected, pages)
        self._port.issue(KVOp(
            KVOpKind.TIER_LOAD, tuple(pages.tolist()), dst=tuple(pages.tolist()),
            transfer=t.transfer_id, plan=TierLoadPlan(tuple(expected.tolist()), tuple(staged))))
        t.issue_time = self._ledger.clock()
        t.advance(TransferState.IN_FLIGHT)
        self._inflight.append(t)
        self.stats["bytes_host_to_device"] += t.nbytes
        return t

    def _land_on_device(self, t: Transfer) -> None:
        """Verifies a landed host -> device chunk and has it scattered into its pages
        (COMMITTED), or fails it."""
        expected, pages = t.payload
        if self._port.has_landed(t.transfer_id):
            sums = np.asarray(self._port.take(t.transfer_id).checksums)
        else:  # a due load (`poll(owner=...)`): the runner checks it before the scatter
            sums = None if t.fault is Fault.CORRUPT else expected
        t.land_time = self._ledger.clock()
        t.advance(TransferState.LANDED)
        if sums is None or not np.array_equal(sums, expected):
            t.fail("checksum mismatch after host -> device")
            self._release(t)
            return
        t.advance(TransferState.VERIFIED)
        self._port.issue(KVOp(KVOpKind.TIER_SCATTER, tuple(pages.tolist()),
                              dst=tuple(pages.tolist()), transfer=t.transfer_id))
        t.payload = None
        t.advance(TransferState.COMMITTED)
        self.stats["pages_loaded"] += len(pages)

    def _finished_loads(self) -> list[LoadResult]:
        results = []
        for owner, load in list(self._loads.items()):
            if not load.is_issued or not all(t.is_done for t in load.transfers):
                continue
            loaded = 0
            for t, n in zip(load.transfers, load.num_pages, strict=True):
                if t.state is not TransferState.COMMITTED:
                    break
                loaded += n
            results.append(LoadResult(owner, len(load.keys), loaded))
            del self._loads[owner]
        return results

    def cancel(self, owner: Hashable) -> None:
        """Fails `owner`'s loads still in flight: nothing more is scattered for it."""
        load = self._loads.pop(owner, None)
        if load is None:
            return
        for t in load.reads:
            if isinstance(t, Transfer) and not t.is_done:
                self._disk_queue.abandon(t, "cancelled")
        for t in load.transfers:
            if not t.is_done:
                self._inflight.remove(t)
                t.fail("cancelled")
                self._release(t)
                self._ledger.finished(t)
