"""The tier manager: the host-side ledger of pages in the host and disk tiers and of the
transfers that move them. It decides each device transfer as a KV op for its port
(`kvjax.memory.tiers.port`) and verifies what landed; the runner moves the bytes
(`kvjax.memory.tiers.transfers`). It imports no jax."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from kvjax.memory.ops import KVOp, KVOpKind, TierLanded
from kvjax.memory.prefix_cache import page_hash_chain as page_hash_chain  # importable here too
from kvjax.memory.tiers.config import TierConfig, TransferLayout
from kvjax.memory.tiers.disk import DiskTier
from kvjax.memory.tiers.disk_queue import DiskQueue
from kvjax.memory.tiers.host import HostTier
from kvjax.memory.tiers.ledger import TransferLedger
from kvjax.memory.tiers.loads import LoadResult, TierLoads, _Load
from kvjax.memory.tiers.port import LocalTierPort, PlannedTierPort, page_bytes_of
from kvjax.memory.transfer import Fault, Transfer, TransferKind, TransferState, page_checksums_np
from kvjax.shapes import floor_power_of_2
from kvjax.trace import NULL_TRACER, Tracer


class TierManager(TierLoads):
    """Moves pages of a page-major KV pool between the device, host and disk tiers.

    Device transfers are ops for its port: a `LocalTierPort` over `kv` (the pool; then `kv`
    arguments are the pool and `poll` returns it) or, with `port`, a `PlannedTierPort` whose
    ops the runner applies in its step (then `kv` arguments are None and landings come in
    through `receive`). A key whose spill was issued and has not landed reads as in flight.

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

    def __init__(self, config: TierConfig, kv=None, *, port: PlannedTierPort | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        if not config.enabled:
            raise ValueError(f"TierManager needs host_bytes > 0, got {config.host_bytes}")
        self.config = config
        self._port = LocalTierPort(kv) if port is None else port
        page_shapes, page_dtypes = self._port.page_shapes, self._port.page_dtypes
        self.page_bytes = page_bytes_of(page_shapes, page_dtypes)
        if config.host_bytes < self.page_bytes:
            raise ValueError(f"TierConfig.host_bytes={config.host_bytes} holds no page of "
                             f"{self.page_bytes} bytes")
        if port is None:
            self._port.transfers.warm_sizes = self.warm_sizes()
        self.memory_kind = self._port.memory_kind
        self.host = HostTier(config.host_bytes)
        self.disk = (DiskTier(config.disk_bytes, config.disk_dir, page_shapes, page_dtypes,
                              num_threads=config.disk_io_threads, fsync=config.disk_fsync)
                     if config.disk_bytes else None)
        self._ledger = TransferLedger(config.faults, clock)
        self.faults = self._ledger.faults
        self.stats = self._ledger.stats
        self.recent_transfers = self._ledger.recent_transfers
        self.tracer: Tracer = NULL_TRACER
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
        return self._port.num_compiles

    @property
    def port(self):
        return self._port

    def _at(self, kv) -> None:
        """A local port works on `kv` from now on (a planned one is given None)."""
        if kv is not None and isinstance(self._port, LocalTierPort):
            self._port.kv = kv

    def receive(self, landed: Sequence[TierLanded]) -> None:
        """Takes the runner's reports of device transfers that landed (a planned port)."""
        ids = {t.transfer_id for t in self._inflight}
        self._port.receive(landed, ids.__contains__)

    def warm_sizes(self) -> list[int]:
        """The chunk sizes device transfers come in (one program each)."""
        if self.config.transfer_layout is TransferLayout.PER_PAGE:
            return [1]
        return sorted({s for n in range(1, self.config.max_chunk_pages + 1)
                       for s in self._chunk_sizes(n)})

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
        self._at(kv)
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
        self._at(kv)
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
            pages = tuple(int(p) for _, p in part)
            self._port.issue(KVOp(KVOpKind.SPILL, pages, src=pages, transfer=t.transfer_id))
            t.issue_time = self._ledger.clock()
            t.advance(TransferState.IN_FLIGHT)
            self._inflight.append(t)
            self._pending_keys.update(keys)
            self.stats["bytes_device_to_host"] += t.nbytes
            issued += t.nbytes
        return issued

    def _land_device_to_host(self, t: Transfer) -> None:
        """Verifies a landed device -> host chunk and stores it in the host tier, or fails it."""
        landed = self._port.take(t.transfer_id)
        self._pending_keys.difference_update(t.keys)
        t.land_time = self._ledger.clock()
        t.advance(TransferState.LANDED)
        host_leaves = list(landed.leaves)
        arrays = [np.asarray(x) for x in host_leaves]
        if t.fault is Fault.CORRUPT:
            host_leaves = arrays = self._ledger.faults.corrupt(arrays)
        checksums = page_checksums_np(arrays)
        if not np.array_equal(checksums, np.asarray(landed.checksums)):
            t.fail("checksum mismatch after device -> host")
            self._discard.difference_update(t.keys)
            return
        t.advance(TransferState.VERIFIED)
        evicted = self.host.put(t.keys, host_leaves, checksums, t.nbytes)
        for key in t.keys:
            if key in self._discard:
                self._discard.discard(key)
                self.host.remove(key)
        t.payload = None
        t.advance(TransferState.COMMITTED)
        self._disk_queue.spill(evicted)

    # --------------------------------------------------------------------------- progress

    def _release(self, t: Transfer) -> None:
        """The runner forgets a device transfer that will not commit."""
        self._port.forget(t.transfer_id)
        self._port.issue(KVOp(KVOpKind.TIER_RELEASE, transfer=t.transfer_id))

    def _has_landed(self, t: Transfer, *, due: bool = False) -> bool:
        """Whether a transfer's data is in. A load due now counts as in once issued: the
        runner scatters it in the step's dispatch after checking its checksums there (so the
        sequence joins that step); injected delays and corruptions are the ledger's own."""
        if t.fault is Fault.DELAY and t.polls <= self._ledger.faults.config.delay_polls:
            return False
        return (self._port.has_landed(t.transfer_id)
                or (due and t.kind is TransferKind.HOST_TO_DEVICE))

    def warmup(self, kv):
        """Compiles the gather, checksum and scatter programs of every chunk size up front
        (a local port). Scatters each gathered chunk back where it came from, so the pool's
        content is unchanged. Returns the new KV pool (its buffers were donated)."""
        if not isinstance(self._port, LocalTierPort):
            return kv  # the runner warms its own TierTransfers
        return self._port.transfers.warmup(kv)

    def block_until_landed(self) -> None:
        """Waits until the data of every transfer in flight is at its destination (and the disk
        workers are done with the writes that were abandoned).

        States do not change: the next `poll` verifies and commits them (injected delays still
        count in polls).
        """
        self._port.wait([t.transfer_id for t in self._inflight])
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
        self._at(kv)
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
            self._port.wait([t.transfer_id for t in todo])
        for t in todo:
            t.polls += 1
            if not self._has_landed(t, due=owner is not None):
                if t.polls > self.config.timeout_polls:
                    self._inflight.remove(t)
                    self._pending_keys.difference_update(t.keys)
                    self._discard.difference_update(t.keys)
                    t.fail(f"timed out after {t.polls - 1} polls")
                    self._release(t)
                    self.stats["transfers_timed_out"] += 1
                    self._ledger.finished(t)
                continue
            self._inflight.remove(t)
            if t.kind is TransferKind.DEVICE_TO_HOST:
                self._land_device_to_host(t)
            else:
                self._land_on_device(t)
            self._ledger.finished(t)
        return (None if kv is None else self._port.kv), self._finished_loads()

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
