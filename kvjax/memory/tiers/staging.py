"""Device <-> host staging: chunks of pages gathered, checksummed, moved and scattered.

Pages travel in the transfer layout, not the compute layout: a chunk of n pages is gathered on
the device into one contiguous page-first buffer `[L, n, ...]` per leaf and moved in a single
asynchronous transfer (`jax.device_put` returns at once), with its per-page checksums.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from kvjax import jit as kvjax_jit
from kvjax.kv import pages as kv_pages
from kvjax.memory.tiers.ledger import TransferLedger
from kvjax.memory.transfer import (
    Fault,
    Transfer,
    TransferKind,
    TransferState,
    page_checksums,
    page_checksums_np,
)


def _leaves_ready(leaves) -> bool:
    return all(not isinstance(x, jax.Array) or x.is_ready() for x in leaves)


class DeviceStaging:
    """Moves chunks of pages between a page-major device pool and host arrays, checked.

    `send_to_host` gathers device pages into a chunk and issues its copy to the host,
    `send_to_device` issues the copy of a chunk staged on the host to the device; once the data
    is in (`has_landed`), `land_on_host` and `land_on_device` verify the checksums and commit
    (scattering a chunk into the pool) or fail the transfer.

    Attributes:
        memory_kind: the jax memory kind of the host tier (None: numpy).
    """

    def __init__(self, leaves: Sequence[jax.Array], page_shapes: Sequence[tuple[int, ...]],
                 page_dtypes: Sequence[np.dtype], memory_kind: str | None,
                 ledger: TransferLedger):
        self.memory_kind = memory_kind
        self._ledger = ledger
        self._page_shapes = list(page_shapes)
        self._page_dtypes = list(page_dtypes)
        self._shardings = [x.sharding for x in leaves]
        # Staged pages match the pool's committedness: jit caches committed and uncommitted
        # inputs apart, so a committed page scattered into an uncommitted pool would make every
        # step program compile again.
        self._committed = leaves[0].committed
        # Device programs over page-major leaves [L, num_pages, ...]; one compile per chunk
        # size. Each staging jits its own, so its compile count is its own engine's.
        self._gather = kvjax_jit.jit(kv_pages.take)
        self._scatter = kvjax_jit.jit(kv_pages.put, donate_argnums=0)
        # Kept apart from the gather: XLA:CPU fused the two into a program twice as slow.
        self._checksums = kvjax_jit.jit(page_checksums)  # [n] uint32

    @property
    def num_compiles(self) -> int:
        return sum(f.num_compiles for f in (self._gather, self._scatter, self._checksums))

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

    def send_to_host(self, t: Transfer, leaves: list, pages: np.ndarray) -> None:
        """Gathers the device `pages` now (so later writes to them cannot leak in) and issues
        their copy to the host (IN_FLIGHT)."""
        gathered = self._gather(leaves, pages)
        t.payload = ([self._to_host(x) for x in gathered], self._checksums(gathered))
        t.issue_time = self._ledger.clock()
        t.advance(TransferState.IN_FLIGHT)

    def land_on_host(self, t: Transfer) -> tuple[list, np.ndarray] | None:
        """Verifies a landed device -> host chunk: its host leaves [L, n, ...] and page checksums
        (VERIFIED), or None when a checksum does not match (FAILED)."""
        host_leaves, sums = t.payload
        t.land_time = self._ledger.clock()
        t.advance(TransferState.LANDED)
        landed = [np.asarray(x) for x in host_leaves]
        if t.fault is Fault.CORRUPT:
            landed = self._ledger.faults.corrupt(landed)
            host_leaves = [self._host_from_numpy(x, s)
                           for x, s in zip(landed, self._shardings, strict=True)]
        checksums = page_checksums_np(landed)
        if not np.array_equal(checksums, np.asarray(sums)):
            t.fail("checksum mismatch after device -> host")
            return None
        t.advance(TransferState.VERIFIED)
        return host_leaves, checksums

    # --------------------------------------------------------------------------- host -> device

    def empty_chunk(self, num_pages: int) -> list[np.ndarray]:
        """Host buffers for a chunk of `num_pages` pages, each leaf [L, num_pages, ...]."""
        return [np.empty((s[0], num_pages, *s[1:]), d)
                for s, d in zip(self._page_shapes, self._page_dtypes, strict=True)]

    def send_to_device(self, t: Transfer, staged: list[np.ndarray], expected: np.ndarray,
                       pages: np.ndarray) -> None:
        """Issues the copy of a staged chunk to the device (IN_FLIGHT), to be scattered into
        `pages` once its checksums match `expected`."""
        if t.fault is Fault.CORRUPT:
            staged = self._ledger.faults.corrupt(staged)
        on_device = [self._to_device(x, s) for x, s in zip(staged, self._shardings, strict=True)]
        t.payload = (on_device, self._checksums(on_device), expected, pages)
        t.issue_time = self._ledger.clock()
        t.advance(TransferState.IN_FLIGHT)

    def land_on_device(self, t: Transfer, leaves: list) -> list:
        """Verifies a landed host -> device chunk and scatters it into the pool `leaves`
        (COMMITTED), or fails it; returns the pool's leaves."""
        on_device, sums, expected, pages = t.payload
        t.land_time = self._ledger.clock()
        t.advance(TransferState.LANDED)
        if not np.array_equal(np.asarray(sums), expected):
            t.fail("checksum mismatch after host -> device")
            return leaves
        t.advance(TransferState.VERIFIED)
        leaves = self._scatter(leaves, pages, on_device)
        t.payload = None
        t.advance(TransferState.COMMITTED)
        self._ledger.stats["pages_loaded"] += len(pages)
        return leaves

    # --------------------------------------------------------------------------- progress

    def has_landed(self, t: Transfer) -> bool:
        if t.fault is Fault.DELAY and t.polls <= self._ledger.faults.config.delay_polls:
            return False
        if t.kind is TransferKind.DEVICE_TO_HOST:
            return _leaves_ready(t.payload[0])
        return _leaves_ready([t.payload[1]])

    def wait(self, transfers: Sequence[Transfer]) -> None:
        """Blocks until the data of `transfers` (in flight) is at its destination."""
        for t in transfers:
            jax.block_until_ready(t.payload[0] if t.kind is TransferKind.DEVICE_TO_HOST
                                  else t.payload[1])

    def warmup(self, leaves: list, sizes: Sequence[int]) -> list:
        """Compiles the gather, checksum and scatter programs of each chunk size in `sizes`.

        Scatters each gathered chunk back where it came from, so the pool's content is
        unchanged. Returns the pool's new leaves (its buffers were donated).
        """
        for size in sizes:
            pages = np.arange(size, dtype=np.int32)
            gathered = self._gather(leaves, pages)
            self._checksums(gathered)
            # Staged like a load (from host arrays), so the compiled programs are the same ones.
            staged = [self._to_device(np.asarray(x), s)
                      for x, s in zip(gathered, self._shardings, strict=True)]
            self._checksums(staged)
            leaves = self._scatter(leaves, pages, staged)
        jax.block_until_ready(leaves)
        return leaves
