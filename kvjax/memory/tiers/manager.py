"""The tier manager: moves pages between the device pool, the host tier and the disk tier."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from kvjax.memory.tiers.config import TierConfig, TransferLayout
from kvjax.memory.tiers.disk import DiskTier
from kvjax.memory.tiers.disk_queue import DiskQueue
from kvjax.memory.tiers.host import HostTier, host_memory_kind
from kvjax.memory.tiers.ledger import TransferLedger
from kvjax.memory.tiers.staging import DeviceStaging
from kvjax.memory.transfer import Fault, Transfer, TransferKind, TransferState
from kvjax.shapes import floor_power_of_2
from kvjax.trace import NULL_TRACER, Tracer


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


class TierManager:
    """Moves pages of a page-major KV pool between the device, host and disk tiers.

    Attributes:
        config: the TierConfig.
        page_bytes: bytes of one page over all leaves of the pool.
        memory_kind: the jax memory kind of the host tier (None: numpy).
        host: the HostTier.
        disk: the DiskTier, or None.
        faults: the FaultInjector.
        stats: bytes moved per direction, transfers committed/failed/timed out, pages dropped.
        recent_transfers: the last 4096 transfers, for inspection.
    """

    def __init__(self, config: TierConfig, kv, *, clock: Callable[[], float] = time.perf_counter):
        if not config.enabled:
            raise ValueError(f"TierManager needs host_bytes > 0, got {config.host_bytes}")
        leaves = kv.page_leaves()
        self.config = config
        page_shapes = [(x.shape[0], *x.shape[2:]) for x in leaves]
        page_dtypes = [np.dtype(x.dtype) for x in leaves]
        self.page_bytes = sum(math.prod(s) * d.itemsize
                              for s, d in zip(page_shapes, page_dtypes, strict=True))
        if config.host_bytes < self.page_bytes:
            raise ValueError(f"TierConfig.host_bytes={config.host_bytes} holds no page of "
                             f"{self.page_bytes} bytes")
        self.memory_kind = host_memory_kind(next(iter(leaves[0].devices())))
        self.host = HostTier(config.host_bytes)
        self.disk = (DiskTier(config.disk_bytes, config.disk_dir, page_shapes, page_dtypes,
                              num_threads=config.disk_io_threads, fsync=config.disk_fsync)
                     if config.disk_bytes else None)
        self._ledger = TransferLedger(config.faults, clock)
        self.faults = self._ledger.faults
        self.stats = self._ledger.stats
        self.recent_transfers = self._ledger.recent_transfers
        self.tracer: Tracer = NULL_TRACER
        self._staging = DeviceStaging(leaves, page_shapes, page_dtypes, self.memory_kind,
                                      self._ledger)
        self._disk_queue = DiskQueue(self.disk, self._ledger, page_bytes=self.page_bytes,
                                     timeout_polls=config.timeout_polls)
        self._inflight: list[Transfer] = []  # device transfers
        self._pending_keys: set[Hashable] = set()
        self._discard: set[Hashable] = set()
        self._loads: dict[Hashable, _Load] = {}
        self._swaps: dict[Hashable, tuple[list[Hashable], bytes]] = {}
        self._swap_generation = itertools.count()

    # --------------------------------------------------------------------------- bookkeeping

    def set_tracer(self, tracer: Tracer) -> None:
        """Reports every transfer's states to `tracer` from now on."""
        self.tracer = self._ledger.tracer = tracer

    def num_pages_held(self) -> dict[str, int]:
        """Pages each tier holds now: {'host': n, 'disk': n} (disk 0 without one)."""
        return dict(host=len(self.host), disk=0 if self.disk is None else len(self.disk))

    def host_room_bytes(self) -> int:
        """Bytes the host tier takes before it evicts its least recently used pages."""
        return max(self.host.budget_bytes - self.host.used_bytes, 0)

    @property
    def num_compiles(self) -> int:
        return self._staging.num_compiles

    @property
    def num_inflight(self) -> int:
        """Transfers issued (device and disk) and not yet committed or failed."""
        return len(self._inflight) + len(self._disk_queue.inflight)

    def is_loading(self, owner: Hashable) -> bool:
        return owner in self._loads

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def contains(self, key: Hashable) -> bool:
        """Whether `key` can be loaded: committed in the host or disk tier, or committed in the
        host tier and on its way to disk (a load then takes the write's source, not its file)."""
        return (key in self.host or key in self._disk_queue.writing
                or (self.disk is not None and key in self.disk))

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """How many leading `keys` can be loaded (see `contains`)."""
        count = 0
        for key in keys:
            if not self.contains(key):
                break
            count += 1
        return count

    def _chunk_sizes(self, n: int) -> list[int]:
        """Power-of-two chunk sizes summing to n (one compile per size, no padding moved)."""
        if self.config.transfer_layout is TransferLayout.PER_PAGE:
            return [1] * n
        cap = min(self.config.max_chunk_pages, self.config.host_bytes // self.page_bytes)
        cap = floor_power_of_2(cap)
        sizes = []
        while n:
            sizes.append(min(cap, floor_power_of_2(n)))
            n -= sizes[-1]
        return sizes

    # --------------------------------------------------------------------------- device -> host

    def spill(self, kv, entries: Sequence[tuple[Hashable, int]]) -> int:
        """Copies device pages out to the host tier before they are overwritten.

        Gathers the pages now (so later writes to them cannot leak in) and issues the
        transfers; they become readable when `poll` commits them. Keys already stored or in
        flight are skipped.

        Args:
            kv: the KV pool (page-major leaves [L, num_pages, ...]).
            entries: (key, device page) pairs.

        Returns:
            Bytes issued.
        """
        seen: set[Hashable] = set()
        todo = []
        for key, page in entries:
            if (key in seen or key in self._pending_keys or key in self._disk_queue.writing
                    or self.contains(key)):
                continue
            seen.add(key)
            todo.append((key, page))
        return self._issue_device_to_host(kv, todo)

    def swap_out(self, kv, seq_id: Hashable, pages: Sequence[int], *, cache_key: bytes = b""
                 ) -> int:
        """Copies a preempted sequence's pages (block-table order) out; returns bytes issued.

        `cache_key` (the sequence's prefix-cache key) is kept for when it comes back.
        """
        self.drop(seq_id)
        generation = next(self._swap_generation)
        keys = [("swap", seq_id, generation, i) for i in range(len(pages))]
        self._swaps[seq_id] = (keys, cache_key)
        return self._issue_device_to_host(kv, list(zip(keys, pages, strict=True)))

    def swap_keys(self, seq_id: Hashable) -> list[Hashable]:
        """The keys of a swapped-out sequence's pages, in block-table order."""
        return list(self._swaps[seq_id][0]) if seq_id in self._swaps else []

    def swap_cache_key(self, seq_id: Hashable) -> bytes:
        """The prefix-cache key a swapped-out sequence was registered with."""
        if seq_id not in self._swaps:
            raise ValueError(f"sequence {seq_id!r} has no swapped-out pages")
        return self._swaps[seq_id][1]

    def swap_pending(self, seq_id: Hashable) -> bool:
        """Whether some of the sequence's swap-out transfers are still in flight."""
        return any(key in self._pending_keys for key in self.swap_keys(seq_id))

    def _issue_device_to_host(self, kv, todo: list[tuple[Hashable, int]]) -> int:
        leaves = kv.page_leaves()
        issued, start = 0, 0
        for size in self._chunk_sizes(len(todo)):
            part = todo[start:start + size]
            start += size
            keys = tuple(k for k, _ in part)
            t = self._ledger.track(Transfer(TransferKind.DEVICE_TO_HOST, keys,
                                            size * self.page_bytes))
            if t.fault is Fault.FAIL:
                t.fail("injected failure")
                self._ledger.finished(t)
                continue
            self._staging.send_to_host(t, leaves, np.asarray([p for _, p in part], np.int32))
            self._inflight.append(t)
            self._pending_keys.update(keys)
            self.stats["bytes_device_to_host"] += t.nbytes
            issued += t.nbytes
        return issued

    def _land_device_to_host(self, t: Transfer) -> None:
        landed = self._staging.land_on_host(t)
        self._pending_keys.difference_update(t.keys)
        if landed is None:
            self._discard.difference_update(t.keys)
            return
        host_leaves, checksums = landed
        evicted = self.host.put(t.keys, host_leaves, checksums, t.nbytes)
        for key in t.keys:
            if key in self._discard:
                self._discard.discard(key)
                self.host.remove(key)
        t.payload = None
        t.advance(TransferState.COMMITTED)
        self._disk_queue.spill(evicted)

    # --------------------------------------------------------------------------- host -> device

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
        staged = self._staging.empty_chunk(len(keys))
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
        self._staging.send_to_device(t, staged, expected, pages)
        self._inflight.append(t)
        self.stats["bytes_host_to_device"] += t.nbytes
        return t

    # --------------------------------------------------------------------------- progress

    def warmup(self, kv):
        """Compiles the gather, checksum and scatter programs of every chunk size up front.

        Scatters each gathered chunk back where it came from, so the pool's content is
        unchanged. Returns the new KV pool (its buffers were donated).
        """
        leaves = kv.page_leaves()
        num_pages = leaves[0].shape[1]
        sizes = {1} if self.config.transfer_layout is TransferLayout.PER_PAGE else {
            s for n in range(1, self.config.max_chunk_pages + 1) for s in self._chunk_sizes(n)}
        leaves = self._staging.warmup(leaves, sorted(s for s in sizes if s <= num_pages))
        return kv.with_page_leaves(leaves)

    def block_until_landed(self) -> None:
        """Waits until the data of every transfer in flight is at its destination (and the disk
        workers are done with the writes that were abandoned).

        States do not change: the next `poll` verifies and commits them (injected delays still
        count in polls).
        """
        self._staging.wait(self._inflight)
        self._disk_queue.wait(self._disk_queue.inflight)

    def poll(self, kv, *, owner: Hashable | None = None) -> tuple[object, list[LoadResult]]:
        """Advances every transfer in flight; returns the new KV pool and finished loads.

        A transfer that has landed is verified and committed (host pages and disk files become
        readable, loaded pages are scattered into the pool) or fails; one in flight for more
        than `timeout_polls` polls fails as timed out. Loads whose disk reads are all done go on
        to the device.

        With `owner`, only its load is advanced, each stage once its data is in (disk reads,
        then the transfers to the device): for a load whose sequence is due to run now, which
        then joins this step instead of the next. Injected delays still count in polls.
        """
        if owner is None:
            self._disk_queue.poll(self._disk_queue.inflight)
        else:
            reads = [t for t in self._disk_queue.inflight if t.owner == owner]
            if reads:
                self._disk_queue.wait(reads)
                self._disk_queue.poll(reads)
        for load_owner, load in self._loads.items():
            if (owner in (None, load_owner) and not load.is_issued
                    and all(t.is_done for t in load.reads if isinstance(t, Transfer))):
                self._issue_load(load_owner, load)
        if owner is None:
            todo = list(self._inflight)
        else:
            todo = [t for t in self._inflight if t.owner == owner]
            self._staging.wait(todo)
        leaves = kv.page_leaves()
        for t in todo:
            t.polls += 1
            if not self._staging.has_landed(t):
                if t.polls > self.config.timeout_polls:
                    self._inflight.remove(t)
                    self._pending_keys.difference_update(t.keys)
                    self._discard.difference_update(t.keys)
                    t.fail(f"timed out after {t.polls - 1} polls")
                    self.stats["transfers_timed_out"] += 1
                    self._ledger.finished(t)
                continue
            self._inflight.remove(t)
            if t.kind is TransferKind.DEVICE_TO_HOST:
                self._land_device_to_host(t)
            else:
                leaves = self._staging.land_on_device(t, leaves)
            self._ledger.finished(t)
        return kv.with_page_leaves(leaves), self._finished_loads()

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
                self._ledger.finished(t)

    def drop(self, seq_id: Hashable) -> None:
        """Cancels `seq_id`'s loads and forgets its swapped-out pages in every tier."""
        self.cancel(seq_id)
        keys, _ = self._swaps.pop(seq_id, ([], b""))
        for key in keys:
            if key in self._pending_keys:
                self._discard.add(key)
            elif key in self._disk_queue.writing:
                self._disk_queue.abandon(self._disk_queue.writing[key], "dropped")
            elif key in self.host:
                self.host.remove(key)
            elif self.disk is not None and key in self.disk:
                self.disk.remove(key)

    def close(self) -> None:
        """Cancels every transfer and deletes the disk tier's files."""
        for owner in list(self._loads):
            self.cancel(owner)
        for t in self._inflight:
            t.fail("closed")
        self._inflight.clear()
        for t in list(self._disk_queue.inflight):
            self._disk_queue.abandon(t, "closed")
        if self.disk is not None:
            self.disk.close()

    def measured_bandwidth(self) -> float | None:
        """Bytes per second of device transfers so far (issue to landing), or None."""
        if self.stats["device_transfer_s"] <= 0:
            return None
        return self.stats["device_transfer_bytes"] / self.stats["device_transfer_s"]
