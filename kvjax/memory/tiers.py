"""Tiered KV: device pages, a host tier (jax memory kinds) and a disk tier, with checked transfers.

The device tier is the engine's page pool. Below it:

  * `HostTier`: pages in host memory, as jax arrays of memory kind `pinned_host`
    (`unpinned_host` where the backend lacks it, numpy where it has neither; logged). Pages
    arrive in chunks of one transfer; a chunk's bytes count against the budget until its last
    page leaves.
  * `DiskTier`: one file per page under a private directory: a magic tag, a BLAKE2b digest of
    the payload, the payload. Worker threads write and read the files, off the engine's step.
    A write goes to a temporary name and is renamed into place only when it commits (its
    checksum taken from the bytes it wrote), so a half-written file is never indexed; every
    read checks the digest and the page checksum before the page may be loaded.

Both keep pages in LRU order under a byte budget: the host spills its least recently used pages
to disk, the disk drops its least recently used files. Pages are keyed by prefix-cache hash
(hash chains start from the tenant salt and KV provenance, so the tiers inherit isolation) or,
for a swapped-out sequence, by (`"swap"`, sequence id, generation, index).

`TierManager` moves pages: device -> host when the block manager evicts a cached page or the
engine swaps a sequence out, host -> device when a later request continues a hash chain past the
device's prefix hit or a swapped sequence comes back, host <-> disk as budgets demand. Pages travel
in the transfer layout, not the compute layout: n pages are gathered on the device into one
contiguous page-first buffer `[L, n, ...]` (per leaf) and moved in a single transfer
(`TransferLayout.PAGE_FIRST`, in power-of-two chunks), or one page per transfer
(`TransferLayout.PER_PAGE`). Device transfers are issued asynchronously (`jax.device_put` returns
at once), disk transfers run on the disk workers, and `poll` advances both; each is a
`kvjax.memory.transfer.Transfer` whose data is read only once COMMITTED. A load is scattered into
the KV pool only after its checksum verifies; a load from disk goes to the device only after its
file reads verified.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import hashlib
import itertools
import logging
import math
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np

from kvjax.memory.prefix_cache import hash_page, hash_root
from kvjax.memory.transfer import (
    Fault,
    FaultConfig,
    FaultInjector,
    Transfer,
    TransferKind,
    TransferState,
    flip_byte,
    page_checksums,
    page_checksums_np,
)

# The cost model lives in kvjax.scheduler.preemption; kvjax.engine.engine still imports it from
# here, so it stays re-exported until that import moves.
from kvjax.scheduler.preemption import PreemptionDecision, decide_preemption  # noqa: F401

log = logging.getLogger(__name__)


class TransferLayout(enum.Enum):
    """How pages travel between tiers."""

    PAGE_FIRST = "page_first"  # n pages gathered into one [L, n, ...] buffer: one transfer.
    PER_PAGE = "per_page"  # one [L, 1, ...] transfer per page.


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """Host and disk tiers below the device page pool (host_bytes=0: off, the default).

    Attributes:
        host_bytes: host-tier budget in bytes; 0 turns tiers off (swaps then use the engine's
            plain host swap space).
        disk_bytes: disk-tier budget in bytes; 0: pages leaving the host tier are dropped.
        disk_dir: where the disk tier makes its private directory; None: the system temp dir.
        disk_io_threads: worker threads doing the disk tier's file I/O, so writes and reads
            overlap the engine's steps; 0: inline, inside the step (the synchronous baseline).
        disk_fsync: fsync each page file before it is renamed into place. Off by default: the
            directory is private to one process and deleted with it, and a torn file fails its
            digest anyway, so durability across a power loss buys nothing for a cache.
        transfer_layout: PAGE_FIRST (chunks of pages per transfer) or PER_PAGE.
        max_chunk_pages: most pages in one page-first transfer (rounded down to a power of 2).
        timeout_polls: polls (engine steps) a transfer may stay in flight before it fails as
            timed out.
        max_inflight_loads: most sequences with tier loads in flight (prefetch depth).
        swap_bandwidth_bytes_per_s: host link bandwidth for the swap-vs-recompute cost model;
            None: measured once by a calibration transfer.
        recompute_tokens_per_s: prefill rate for the cost model; None: measured from the
            engine's step times (tokens computed per second of step time).
        faults: fault injection into every tier transfer (off by default).
    """

    host_bytes: int = 0
    disk_bytes: int = 0
    disk_dir: str | None = None
    disk_io_threads: int = 2
    disk_fsync: bool = False
    transfer_layout: TransferLayout = TransferLayout.PAGE_FIRST
    max_chunk_pages: int = 64
    timeout_polls: int = 64
    max_inflight_loads: int = 4
    swap_bandwidth_bytes_per_s: float | None = None
    recompute_tokens_per_s: float | None = None
    faults: FaultConfig = FaultConfig()

    def __post_init__(self):
        for name in ("host_bytes", "disk_bytes", "disk_io_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"TierConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("max_chunk_pages", "timeout_polls", "max_inflight_loads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TierConfig.{name} must be a positive int, got {value!r}")
        for name in ("swap_bandwidth_bytes_per_s", "recompute_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"TierConfig.{name} must be > 0 or None, got {value!r}")
        if self.disk_bytes and not self.host_bytes:
            raise ValueError(f"TierConfig.disk_bytes={self.disk_bytes} needs a host tier "
                             f"(host_bytes > 0): pages reach the disk through the host")
        if not isinstance(self.faults, FaultConfig):
            raise ValueError(f"TierConfig.faults must be a FaultConfig, got {self.faults!r}")
        object.__setattr__(self, "transfer_layout", TransferLayout(self.transfer_layout))

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0


def host_memory_kind(device) -> str | None:
    """`pinned_host`, else `unpinned_host`, else None (numpy), logging any fallback."""
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            if kind != "pinned_host":
                log.warning("backend %s lacks pinned_host; the host tier uses %s",
                            device.platform, kind)
            return kind
    log.warning("backend %s has no host memory kind; the host tier uses numpy", device.platform)
    return None


def _leaves_ready(leaves) -> bool:
    return all(not isinstance(x, jax.Array) or x.is_ready() for x in leaves)


# Device programs over page-major leaves [L, num_pages, ...]; one compile per chunk size. Each
# TierManager jits its own, so its compile count is its own engine's.


def _gather(leaves, pages: jax.Array):
    return [x[:, pages] for x in leaves]  # each [L, n, ...]


def _scatter(leaves, pages: jax.Array, staged):
    return [x.at[:, pages].set(s.astype(x.dtype)) for x, s in zip(leaves, staged, strict=True)]


# ----------------------------------------------------------------------------- host tier


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


# ----------------------------------------------------------------------------- disk tier

_MAGIC = b"KVJXPG01"
_DIGEST = 32


def _payload_leaves(payload: bytes, shapes, dtypes) -> list[np.ndarray]:
    """Views of a page's leaves, each [L, ...], in its serialized payload."""
    leaves, offset = [], 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        leaves.append(np.frombuffer(payload, dtype, math.prod(shape), offset).reshape(shape))
        offset += math.prod(shape) * dtype.itemsize
    return leaves


def _page_checksum(leaves: Sequence[np.ndarray]) -> int:
    return int(page_checksums_np([x[:, None] for x in leaves])[0])


def _write_page_file(tmp: str, payload: bytes, shapes, dtypes, flip: int | None,
                     fsync: bool) -> int:
    """Worker: writes a page file to `tmp`; returns the checksum of the bytes it wrote.

    The checksum comes from the in-memory bytes (after an injected flip), not from reading the
    file back: what a write can corrupt is the buffer it was handed.
    """
    if flip is not None:
        payload = flip_byte(payload, flip)
    checksum = _page_checksum(_payload_leaves(payload, shapes, dtypes))
    digest = hashlib.blake2b(payload, digest_size=_DIGEST).digest()
    with open(tmp, "wb") as f:
        f.write(_MAGIC + digest)
        f.write(payload)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return checksum


def _read_page_file(path: str, file_bytes: int, shapes, dtypes, flip: int | None
                    ) -> tuple[list[np.ndarray], int] | None:
    """Worker: a page file's leaves and their checksum, or None when its header or digest is
    wrong (a torn, truncated or corrupted file)."""
    with open(path, "rb") as f:
        data = f.read()
    if flip is not None and data:
        data = flip_byte(data, flip % len(data))
    header = len(_MAGIC) + _DIGEST
    if len(data) != file_bytes or not data.startswith(_MAGIC):
        return None
    payload = data[header:]
    if hashlib.blake2b(payload, digest_size=_DIGEST).digest() != data[len(_MAGIC):header]:
        return None
    leaves = _payload_leaves(payload, shapes, dtypes)
    return leaves, _page_checksum(leaves)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _close_disk(pool: concurrent.futures.Executor | None, directory: str) -> None:
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(directory, True)


@dataclasses.dataclass(eq=False)
class _DiskIO:
    """A disk transfer's work on the worker, and what its landing is checked against."""

    future: concurrent.futures.Future
    path: str  # the temporary file of a write, the page file of a read
    checksum: int  # the source's page checksum
    nbytes: int  # budget bytes a write holds reserved until it lands
    source: list[np.ndarray] | None = None  # a write's page leaves [L, ...], as the host held it


class DiskTier:
    """One checksummed file per page in a private directory, under a byte budget (LRU).

    Writes and reads run on `num_threads` worker threads (0: inline, on the caller's thread):
    `start_write`/`start_read` hand the work over and return at once, `land_write`/`land_read`
    check and commit what the worker did. A page is written to a temporary name and renamed to
    its page file only when its write commits, so a file that a crash or a failure left half
    written is never indexed, and a page file that went bad on disk fails the digest and
    checksum checks of every read.

    Attributes:
        directory: the private directory (removed when the tier is garbage collected).
        budget_bytes: the most bytes its files, and the writes in flight, may take.
        used_bytes: bytes its indexed (committed) files take.
        reserved_bytes: bytes held for writes in flight.
    """

    def __init__(self, budget_bytes: int, parent_dir: str | None,
                 page_shapes: Sequence[tuple[int, ...]], page_dtypes: Sequence[np.dtype], *,
                 num_threads: int = 1, fsync: bool = False):
        if parent_dir is not None:
            os.makedirs(parent_dir, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix="kvjax-tier-", dir=parent_dir)
        self._pool = (concurrent.futures.ThreadPoolExecutor(
            num_threads, thread_name_prefix="kvjax-disk") if num_threads else None)
        self._cleanup = weakref.finalize(self, _close_disk, self._pool, self.directory)
        self._fsync = fsync
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.reserved_bytes = 0
        self._shapes = list(page_shapes)
        self._dtypes = list(page_dtypes)
        self._payload_bytes = sum(math.prod(s) * d.itemsize
                                  for s, d in zip(self._shapes, self._dtypes, strict=True))
        self._entries: collections.OrderedDict[Hashable, tuple[str, int, int]] = \
            collections.OrderedDict()
        # Writes failed while on a worker: their temporary files go once the worker is done.
        self._abandoned: list[tuple[concurrent.futures.Future, str]] = []

    @property
    def file_bytes(self) -> int:
        """Size of one page file (header + payload)."""
        return len(_MAGIC) + _DIGEST + self._payload_bytes

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def path_of(self, key: Hashable) -> str:
        name = hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()
        return os.path.join(self.directory, name + ".kvpage")

    def close(self) -> None:
        """Waits for the workers, then deletes every file and the directory."""
        self._entries.clear()
        self.used_bytes = self.reserved_bytes = 0
        self._cleanup()

    def remove(self, key: Hashable) -> None:
        path, nbytes, _ = self._entries.pop(key)
        self.used_bytes -= nbytes
        _remove_quietly(path)

    def inspect(self, key: Hashable) -> list[np.ndarray] | None:
        """The leaves [L, ...] an indexed page file holds now, or None when it fails its checks;
        reads on the caller's thread (for tests and tools, not for loads)."""
        page = _read_page_file(self._entries[key][0], self.file_bytes, self._shapes,
                               self._dtypes, None)
        return None if page is None else page[0]

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except OSError as e:
            future.set_exception(e)
        return future

    def wait(self, transfers: Sequence[Transfer]) -> None:
        """Blocks until the workers finished `transfers` and every abandoned write."""
        concurrent.futures.wait([t.payload.future for t in transfers]
                                + [f for f, _ in self._abandoned])
        self._reap()

    def _reap(self) -> None:
        """Deletes the temporary files of abandoned writes whose workers are done."""
        for future, path in [a for a in self._abandoned if a[0].done()]:
            _remove_quietly(path)
            self._abandoned.remove((future, path))

    def start_write(self, t: Transfer, key: Hashable, page: Sequence[np.ndarray], checksum: int,
                    flip: int | None) -> int:
        """Reserves room for one page file and hands its write to a worker (IN_FLIGHT), or
        fails `t` when the budget cannot hold it.

        Returns:
            How many least recently used files were deleted to make room.
        """
        self._reap()
        size = self.file_bytes
        if size > self.budget_bytes:
            t.fail(f"a page file of {size} bytes exceeds the disk budget {self.budget_bytes}")
            return 0
        num_evicted = 0
        while self.used_bytes + self.reserved_bytes + size > self.budget_bytes and self._entries:
            self.remove(next(iter(self._entries)))
            num_evicted += 1
        if self.used_bytes + self.reserved_bytes + size > self.budget_bytes:
            t.fail("the disk budget is held by writes in flight")
            return num_evicted
        self.reserved_bytes += size
        tmp = f"{self.path_of(key)}.{t.transfer_id}.tmp"
        payload = b"".join(np.ascontiguousarray(x).tobytes() for x in page)
        future = self._submit(_write_page_file, tmp, payload, self._shapes, self._dtypes, flip,
                              self._fsync)
        t.payload = _DiskIO(future, tmp, checksum, size, source=list(page))
        t.advance(TransferState.IN_FLIGHT)
        return num_evicted

    def start_read(self, t: Transfer, key: Hashable, flip: int | None) -> None:
        """Hands the read of one indexed page file to a worker (IN_FLIGHT)."""
        path, _, checksum = self._entries[key]
        future = self._submit(_read_page_file, path, self.file_bytes, self._shapes, self._dtypes,
                              flip)
        t.payload = _DiskIO(future, path, checksum, 0)
        t.advance(TransferState.IN_FLIGHT)

    def abandon(self, t: Transfer, reason: str) -> None:
        """Fails a transfer in flight; a write's temporary file goes once its worker is done."""
        io: _DiskIO = t.payload
        self.reserved_bytes -= io.nbytes
        if t.kind is TransferKind.HOST_TO_DISK:
            self._abandoned.append((io.future, io.path))
            self._reap()
        t.fail(reason)

    def land_write(self, t: Transfer, key: Hashable) -> None:
        """Checks a finished write and commits it (renames and indexes the file), or fails it."""
        io: _DiskIO = t.payload
        self.reserved_bytes -= io.nbytes
        try:
            checksum = io.future.result()
        except OSError as e:
            _remove_quietly(io.path)
            t.fail(f"write failed: {e}")
            return
        t.advance(TransferState.LANDED)
        if checksum != io.checksum:
            _remove_quietly(io.path)
            t.fail("checksum mismatch in the bytes written")
            return
        t.advance(TransferState.VERIFIED)
        if key in self._entries:
            self.remove(key)
        path = self.path_of(key)
        os.replace(io.path, path)
        self._entries[key] = (path, io.nbytes, io.checksum)
        self.used_bytes += io.nbytes
        t.payload = None
        t.advance(TransferState.COMMITTED)

    def land_read(self, t: Transfer, key: Hashable) -> None:
        """Checks a finished read and commits it (payload: the page's leaves [L, ...] and its
        checksum), or fails it and deletes the bad file."""
        io: _DiskIO = t.payload
        try:
            page = io.future.result()
        except OSError as e:
            t.fail(f"read failed: {e}")
            return
        t.advance(TransferState.LANDED)
        if page is None or page[1] != io.checksum:
            if key in self._entries:
                self.remove(key)
            t.fail("checksum mismatch on read")
            return
        t.advance(TransferState.VERIFIED)
        if key in self._entries:
            self._entries.move_to_end(key)
        t.payload = page
        t.advance(TransferState.COMMITTED)


# ----------------------------------------------------------------------------- manager


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
        leaves = jax.tree.leaves(kv)
        self.config = config
        self.clock = clock
        self._page_shapes = [(x.shape[0], *x.shape[2:]) for x in leaves]
        self._page_dtypes = [np.dtype(x.dtype) for x in leaves]
        self._shardings = [x.sharding for x in leaves]
        # Staged pages match the pool's committedness: jit caches committed and uncommitted
        # inputs apart, so a committed page scattered into an uncommitted pool would make every
        # step program compile again.
        self._committed = leaves[0].committed
        self.page_bytes = sum(math.prod(s) * d.itemsize
                              for s, d in zip(self._page_shapes, self._page_dtypes, strict=True))
        if config.host_bytes < self.page_bytes:
            raise ValueError(f"TierConfig.host_bytes={config.host_bytes} holds no page of "
                             f"{self.page_bytes} bytes")
        self.memory_kind = host_memory_kind(next(iter(leaves[0].devices())))
        self.host = HostTier(config.host_bytes)
        self.disk = (DiskTier(config.disk_bytes, config.disk_dir, self._page_shapes,
                              self._page_dtypes, num_threads=config.disk_io_threads,
                              fsync=config.disk_fsync) if config.disk_bytes else None)
        self.faults = FaultInjector(config.faults)
        self._gather = jax.jit(_gather)
        self._scatter = jax.jit(_scatter, donate_argnums=0)
        # Kept apart from the gather: XLA:CPU fused the two into a program twice as slow.
        self._checksums = jax.jit(page_checksums)  # [n] uint32
        self._inflight: list[Transfer] = []  # device transfers
        self._disk_inflight: list[Transfer] = []  # disk reads and writes on the workers
        self._disk_writing: dict[Hashable, Transfer] = {}  # key -> its write in flight
        self._pending_keys: set[Hashable] = set()
        self._discard: set[Hashable] = set()
        self._loads: dict[Hashable, _Load] = {}
        self._swaps: dict[Hashable, tuple[list[Hashable], bytes]] = {}
        self._swap_generation = itertools.count()
        self.recent_transfers: collections.deque[Transfer] = collections.deque(maxlen=4096)
        self.stats = dict(bytes_device_to_host=0, bytes_host_to_device=0, bytes_host_to_disk=0,
                          bytes_disk_to_host=0, transfers_committed=0, transfers_failed=0,
                          transfers_timed_out=0, pages_dropped=0, pages_loaded=0,
                          device_transfer_s=0.0, device_transfer_bytes=0)

    # --------------------------------------------------------------------------- bookkeeping

    @property
    def num_compiles(self) -> int:
        return sum(f._cache_size() for f in (self._gather, self._scatter, self._checksums))

    @property
    def num_inflight(self) -> int:
        """Transfers issued (device and disk) and not yet committed or failed."""
        return len(self._inflight) + len(self._disk_inflight)

    def is_loading(self, owner: Hashable) -> bool:
        return owner in self._loads

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def contains(self, key: Hashable) -> bool:
        """Whether `key` can be loaded: committed in the host or disk tier, or committed in the
        host tier and on its way to disk (a load then takes the write's source, not its file)."""
        return (key in self.host or key in self._disk_writing
                or (self.disk is not None and key in self.disk))

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """How many leading `keys` can be loaded (see `contains`)."""
        count = 0
        for key in keys:
            if not self.contains(key):
                break
            count += 1
        return count

    def _track(self, t: Transfer) -> Transfer:
        t.fault = self.faults.draw(t.kind)
        self.recent_transfers.append(t)
        return t

    def _finished(self, t: Transfer) -> None:
        self.stats["transfers_committed" if t.state is TransferState.COMMITTED
                   else "transfers_failed"] += 1
        if t.kind in (TransferKind.DEVICE_TO_HOST, TransferKind.HOST_TO_DEVICE) and t.land_time:
            self.stats["device_transfer_s"] += t.land_time - t.issue_time
            self.stats["device_transfer_bytes"] += t.nbytes

    def _chunk_sizes(self, n: int) -> list[int]:
        """Power-of-two chunk sizes summing to n (one compile per size, no padding moved)."""
        if self.config.transfer_layout is TransferLayout.PER_PAGE:
            return [1] * n
        cap = min(self.config.max_chunk_pages, self.config.host_bytes // self.page_bytes)
        cap = 1 << (cap.bit_length() - 1)
        sizes = []
        while n:
            sizes.append(min(cap, 1 << (n.bit_length() - 1)))
            n -= sizes[-1]
        return sizes

    def _to_host(self, x: jax.Array):
        if self.memory_kind is None:
            return np.asarray(x)
        return jax.device_put(x, x.sharding.with_memory_kind(self.memory_kind))

    def _to_device(self, x: np.ndarray, sharding) -> jax.Array:
        if not self._committed:
            return jax.device_put(x)
        return jax.device_put(x, sharding.with_memory_kind("device"))

    def _host_from_numpy(self, x: np.ndarray, sharding):
        if self.memory_kind is None:
            return x
        return jax.device_put(x, sharding.with_memory_kind(self.memory_kind))

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
            if (key in seen or key in self._pending_keys or key in self._disk_writing
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
        leaves = jax.tree.leaves(kv)
        issued, start = 0, 0
        for size in self._chunk_sizes(len(todo)):
            part = todo[start:start + size]
            start += size
            keys = tuple(k for k, _ in part)
            t = self._track(Transfer(TransferKind.DEVICE_TO_HOST, keys, size * self.page_bytes))
            if t.fault is Fault.FAIL:
                t.fail("injected failure")
                self._finished(t)
                continue
            gathered = self._gather(leaves, np.asarray([p for _, p in part], np.int32))
            t.payload = ([self._to_host(x) for x in gathered], self._checksums(gathered))
            t.issue_time = self.clock()
            t.advance(TransferState.IN_FLIGHT)
            self._inflight.append(t)
            self._pending_keys.update(keys)
            self.stats["bytes_device_to_host"] += t.nbytes
            issued += t.nbytes
        return issued

    def _land_device_to_host(self, t: Transfer) -> None:
        host_leaves, sums = t.payload
        t.land_time = self.clock()
        t.advance(TransferState.LANDED)
        landed = [np.asarray(x) for x in host_leaves]
        if t.fault is Fault.CORRUPT:
            landed = self.faults.corrupt(landed)
            host_leaves = [self._host_from_numpy(x, s)
                           for x, s in zip(landed, self._shardings, strict=True)]
        checksums = page_checksums_np(landed)
        self._pending_keys.difference_update(t.keys)
        if not np.array_equal(checksums, np.asarray(sums)):
            self._discard.difference_update(t.keys)
            t.fail("checksum mismatch after device -> host")
            return
        t.advance(TransferState.VERIFIED)
        evicted = self.host.put(t.keys, host_leaves, checksums, t.nbytes)
        for key in t.keys:
            if key in self._discard:
                self._discard.discard(key)
                self.host.remove(key)
        t.payload = None
        t.advance(TransferState.COMMITTED)
        self._spill_to_disk(evicted)

    # --------------------------------------------------------------------------- host <-> disk

    def _spill_to_disk(self, evicted: list[tuple[Hashable, list[np.ndarray], int]]) -> None:
        """Hands the pages the host tier evicted to the disk workers (dropped without a disk)."""
        for key, page, checksum in evicted:
            if self.disk is None:
                self.stats["pages_dropped"] += 1
                continue
            t = self._track(Transfer(TransferKind.HOST_TO_DISK, (key,), self.page_bytes))
            if t.fault is Fault.FAIL:
                t.fail("injected failure")
            else:
                flip = (self.faults.flip_position(self.page_bytes) if t.fault is Fault.CORRUPT
                        else None)
                self.stats["pages_dropped"] += self.disk.start_write(t, key, page, checksum, flip)
            if t.state is TransferState.FAILED:
                self._finished(t)
                self.stats["pages_dropped"] += 1
                continue
            t.issue_time = self.clock()
            self.stats["bytes_host_to_disk"] += t.nbytes
            self._disk_inflight.append(t)
            self._disk_writing[key] = t

    def _start_disk_read(self, owner: Hashable, key: Hashable) -> Transfer:
        t = self._track(Transfer(TransferKind.DISK_TO_HOST, (key,), self.page_bytes, owner=owner))
        if t.fault is Fault.FAIL:
            t.fail("injected failure")
            self._finished(t)
            return t
        flip = (self.faults.flip_position(self.disk.file_bytes) if t.fault is Fault.CORRUPT
                else None)
        self.disk.start_read(t, key, flip)
        t.issue_time = self.clock()
        self.stats["bytes_disk_to_host"] += t.nbytes
        self._disk_inflight.append(t)
        return t

    def _abandon_disk(self, t: Transfer, reason: str) -> None:
        self._disk_inflight.remove(t)
        if t.kind is TransferKind.HOST_TO_DISK:
            self._disk_writing.pop(t.keys[0], None)
            self.stats["pages_dropped"] += 1
        self.disk.abandon(t, reason)
        self._finished(t)

    def _poll_disk(self, transfers: Sequence[Transfer]) -> None:
        """Commits (or fails) the disk `transfers` whose workers finished; times out the rest."""
        for t in list(transfers):
            t.polls += 1
            delayed = t.fault is Fault.DELAY and t.polls <= self.faults.config.delay_polls
            if delayed or not t.payload.future.done():
                if t.polls > self.config.timeout_polls:
                    self._abandon_disk(t, f"timed out after {t.polls - 1} polls")
                    self.stats["transfers_timed_out"] += 1
                continue
            self._disk_inflight.remove(t)
            t.land_time = self.clock()
            if t.kind is TransferKind.HOST_TO_DISK:
                del self._disk_writing[t.keys[0]]
                self.disk.land_write(t, t.keys[0])
                if t.state is TransferState.FAILED:
                    self.stats["pages_dropped"] += 1
            else:
                self.disk.land_read(t, t.keys[0])
            self._finished(t)

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
            elif key in self._disk_writing:
                io = self._disk_writing[key].payload
                reads.append((io.source, io.checksum))
            elif self.disk is not None and key in self.disk:
                t = self._start_disk_read(owner, key)
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
        t = self._track(Transfer(TransferKind.HOST_TO_DEVICE, keys, len(keys) * self.page_bytes,
                                 owner=owner))
        if t.fault is Fault.FAIL:
            t.fail("injected failure")
            self._finished(t)
            return t
        staged = [np.empty((s[0], len(keys), *s[1:]), d)
                  for s, d in zip(self._page_shapes, self._page_dtypes, strict=True)]
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
            staged = self.faults.corrupt(staged)
        on_device = [self._to_device(x, s) for x, s in zip(staged, self._shardings, strict=True)]
        t.payload = (on_device, self._checksums(on_device), expected, pages)
        t.issue_time = self.clock()
        t.advance(TransferState.IN_FLIGHT)
        self._inflight.append(t)
        self.stats["bytes_host_to_device"] += t.nbytes
        return t

    def _land_host_to_device(self, t: Transfer, leaves: list) -> list:
        on_device, sums, expected, pages = t.payload
        t.land_time = self.clock()
        t.advance(TransferState.LANDED)
        if not np.array_equal(np.asarray(sums), expected):
            t.fail("checksum mismatch after host -> device")
            return leaves
        t.advance(TransferState.VERIFIED)
        leaves = self._scatter(leaves, pages, on_device)
        t.payload = None
        t.advance(TransferState.COMMITTED)
        self.stats["pages_loaded"] += len(pages)
        return leaves

    # --------------------------------------------------------------------------- progress

    def _has_landed(self, t: Transfer) -> bool:
        if t.fault is Fault.DELAY and t.polls <= self.faults.config.delay_polls:
            return False
        if t.kind is TransferKind.DEVICE_TO_HOST:
            return _leaves_ready(t.payload[0])
        return _leaves_ready([t.payload[1]])

    def warmup(self, kv):
        """Compiles the gather, checksum and scatter programs of every chunk size up front.

        Scatters each gathered chunk back where it came from, so the pool's content is
        unchanged. Returns the new KV pool (its buffers were donated).
        """
        leaves, treedef = jax.tree.flatten(kv)
        num_pages = leaves[0].shape[1]
        sizes = {1} if self.config.transfer_layout is TransferLayout.PER_PAGE else {
            s for n in range(1, self.config.max_chunk_pages + 1) for s in self._chunk_sizes(n)}
        for size in sorted(s for s in sizes if s <= num_pages):
            pages = np.arange(size, dtype=np.int32)
            gathered = self._gather(leaves, pages)
            self._checksums(gathered)
            # Staged like a load (from host arrays), so the compiled programs are the same ones.
            staged = [self._to_device(np.asarray(x), s)
                      for x, s in zip(gathered, self._shardings, strict=True)]
            self._checksums(staged)
            leaves = self._scatter(leaves, pages, staged)
        jax.block_until_ready(leaves)
        return jax.tree.unflatten(treedef, leaves)

    def block_until_landed(self) -> None:
        """Waits until the data of every transfer in flight is at its destination (and the disk
        workers are done with the writes that were abandoned).

        States do not change: the next `poll` verifies and commits them (injected delays still
        count in polls).
        """
        for t in self._inflight:
            jax.block_until_ready(t.payload[0] if t.kind is TransferKind.DEVICE_TO_HOST
                                  else t.payload[1])
        if self.disk is not None:
            self.disk.wait(self._disk_inflight)

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
            self._poll_disk(self._disk_inflight)
        else:
            reads = [t for t in self._disk_inflight if t.owner == owner]
            if reads:
                self.disk.wait(reads)
                self._poll_disk(reads)
        for load_owner, load in self._loads.items():
            if (owner in (None, load_owner) and not load.is_issued
                    and all(t.is_done for t in load.reads if isinstance(t, Transfer))):
                self._issue_load(load_owner, load)
        if owner is None:
            todo = list(self._inflight)
        else:
            todo = [t for t in self._inflight if t.owner == owner]
            jax.block_until_ready([t.payload[1] for t in todo])
        leaves, treedef = jax.tree.flatten(kv)
        for t in todo:
            t.polls += 1
            if not self._has_landed(t):
                if t.polls > self.config.timeout_polls:
                    self._inflight.remove(t)
                    self._pending_keys.difference_update(t.keys)
                    self._discard.difference_update(t.keys)
                    t.fail(f"timed out after {t.polls - 1} polls")
                    self.stats["transfers_timed_out"] += 1
                    self._finished(t)
                continue
            self._inflight.remove(t)
            if t.kind is TransferKind.DEVICE_TO_HOST:
                self._land_device_to_host(t)
            else:
                leaves = self._land_host_to_device(t, leaves)
            self._finished(t)
        return jax.tree.unflatten(treedef, leaves), self._finished_loads()

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
                self._abandon_disk(t, "cancelled")
        for t in load.transfers:
            if not t.is_done:
                self._inflight.remove(t)
                t.fail("cancelled")
                self._finished(t)

    def drop(self, seq_id: Hashable) -> None:
        """Cancels `seq_id`'s loads and forgets its swapped-out pages in every tier."""
        self.cancel(seq_id)
        keys, _ = self._swaps.pop(seq_id, ([], b""))
        for key in keys:
            if key in self._pending_keys:
                self._discard.add(key)
            elif key in self._disk_writing:
                self._abandon_disk(self._disk_writing[key], "dropped")
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
        for t in list(self._disk_inflight):
            self._abandon_disk(t, "closed")
        if self.disk is not None:
            self.disk.close()

    def measured_bandwidth(self) -> float | None:
        """Bytes per second of device transfers so far (issue to landing), or None."""
        if self.stats["device_transfer_s"] <= 0:
            return None
        return self.stats["device_transfer_bytes"] / self.stats["device_transfer_s"]


def page_hash_chain(token_ids: Sequence[int], cache_key: bytes, page_size: int) -> list[bytes]:
    """Prefix-cache hashes of every full page of `token_ids` (the block manager's chain)."""
    parent, hashes = hash_root(cache_key), []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hash_page(parent, token_ids[start:start + page_size])
        hashes.append(parent)
    return hashes


class TieredSwapSpace:
    """The engine's swap space with tiers on: swapped pages go through checked tier transfers.

    It keeps the interface of kvjax.engine.swap.HostSwapSpace that the engine calls on
    preemption and on finishing (`swap_out`, `drop`, `scrub`, `num_compiles`); swapping back in
    is asynchronous, through `TierManager.load`.

    Attributes:
        tiers: the TierManager.
    """

    def __init__(self, tiers: TierManager, plain, allocator):
        self.tiers = tiers
        self._plain = plain
        self._allocator = allocator

    @property
    def memory_kind(self) -> str | None:
        return self.tiers.memory_kind

    @property
    def num_compiles(self) -> int:
        return self._plain.num_compiles + self.tiers.num_compiles

    def swap_out(self, kv, seq_id: Hashable, pages: list[int]) -> int:
        """Issues the copy of a registered sequence's `pages` to the tiers; returns bytes."""
        return self.tiers.swap_out(kv, seq_id, pages,
                                   cache_key=self._allocator.cache_key_of(seq_id))

    def drop(self, seq_id: Hashable) -> None:
        self.tiers.drop(seq_id)
        self._plain.drop(seq_id)

    def scrub(self, kv, pages: list[int]):
        return self._plain.scrub(kv, pages)

    def warmup(self, kv, max_pages: int, *, swap: bool, scrub: bool):
        """The scrub programs (swaps go through the tiers, which warm up their own)."""
        del swap
        return self._plain.warmup(kv, max_pages, swap=False, scrub=scrub)


def measure_transfer_bandwidth(kv, num_pages: int, layout: TransferLayout, *,
                               repeats: int = 3) -> dict[str, float]:
    """Device <-> host bandwidth (bytes/s) for `num_pages` pages of `kv` moved in `layout`.

    Page-first: one gather into [L, n, ...] and one transfer per direction. Per page: n
    gathers and n transfers. Each direction is timed to completion, best of `repeats`.
    """
    leaves = jax.tree.leaves(kv)
    kind = host_memory_kind(next(iter(leaves[0].devices())))
    pages = np.arange(min(num_pages, leaves[0].shape[1]), dtype=np.int32)
    groups = [pages] if layout is TransferLayout.PAGE_FIRST else [pages[i:i + 1] for i in pages]

    gather = jax.jit(_gather)

    def to_host(x):
        return np.asarray(x) if kind is None else jax.device_put(
            x, x.sharding.with_memory_kind(kind))

    def down():
        out = [[to_host(x) for x in gather(leaves, g)] for g in groups]
        jax.block_until_ready(out)
        return out

    def up(host):
        out = [[jax.device_put(x, s.sharding.with_memory_kind("device"))
                for x, s in zip(h, leaves, strict=True)] for h in host]
        jax.block_until_ready(out)

    host = down()  # warm-up: compiles the gathers
    up(host)
    d2h, h2d = math.inf, math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        host = down()
        t1 = time.perf_counter()
        up(host)
        t2 = time.perf_counter()
        d2h, h2d = min(d2h, t1 - t0), min(h2d, t2 - t1)
    nbytes = sum(x.nbytes for h in host for x in jax.tree.leaves(h))
    return dict(bytes=nbytes, device_to_host_bytes_per_s=nbytes / d2h,
                host_to_device_bytes_per_s=nbytes / h2d)
