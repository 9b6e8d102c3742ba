"""The disk tier: one checksummed page file per page, written and read by worker threads.

A page file is a magic tag, a BLAKE2b digest of the payload, the payload (each leaf's bytes in
turn).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Hashable, Sequence

import numpy as np

from kvjax.memory.transfer import (
    Transfer,
    TransferKind,
    TransferState,
    flip_byte,
    page_checksums_np,
)

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

