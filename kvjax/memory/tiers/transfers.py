"""The runner's side of the tiers: tier ops applied to the device pool, and what landed.

Pages travel in the transfer layout, not the compute layout: a chunk of n pages is gathered on
the device into one contiguous page-first buffer `[L, n, ...]` per leaf and moved in a single
asynchronous transfer (`jax.device_put` returns at once), with its per-page checksums. The
tiers' ledger (`kvjax.memory.tiers.manager.TierManager`, on the host) decides every transfer and
verifies every checksum; this side only moves bytes, from the ops it is given (`TIER_KINDS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from kvjax import jit as kvjax_jit
from kvjax.kv import pages as kv_pages
from kvjax.memory.ops import KVOp, KVOpKind, TierLanded
from kvjax.memory.tiers.host import host_memory_kind
from kvjax.memory.transfer import page_checksums


def _is_ready(x) -> bool:
    return not isinstance(x, jax.Array) or x.is_ready()


class TierTransfers:
    """Applies tier ops to a page-major KV pool and reports the transfers whose data is in.

    SPILL gathers pool pages into a chunk (so later writes to them cannot leak in), takes its
    checksums and sends it to host memory; TIER_LOAD sends a host chunk to the device and takes
    its checksums there; TIER_SCATTER writes a landed load into its pages; TIER_RELEASE forgets
    a transfer. `take` and `report` hand out what landed (`TierLanded`).

    Attributes:
        memory_kind: the jax memory kind of host memory (None: numpy).
    """

    def __init__(self, kv, *, warm_sizes: Sequence[int] = ()):
        leaves = kv.page_leaves()
        self.memory_kind = host_memory_kind(next(iter(leaves[0].devices())))
        self._shardings = [x.sharding for x in leaves]
        self.warm_sizes = tuple(warm_sizes)
        # Loaded pages match the pool's committedness: jit caches committed and uncommitted
        # inputs apart, so a committed page scattered into an uncommitted pool would make every
        # step program compile again.
        self._committed = leaves[0].committed
        # Device programs over page-major leaves [L, num_pages, ...]; one compile per chunk
        # size. Each instance jits its own, so its compile count is its own engine's.
        self._gather = kvjax_jit.jit(kv_pages.take)
        self._scatter = kvjax_jit.jit(kv_pages.put, donate_argnums=0)
        # Kept apart from the gather: XLA:CPU fused the two into a program twice as slow.
        self._checksums = kvjax_jit.jit(page_checksums)  # [n] uint32
        self._out: dict[int, tuple[list, Any]] = {}  # spills: host leaves, device checksums
        # loads: device leaves, their checksums there, the checksums they must have
        self._in: dict[int, tuple[list, Any, tuple[int, ...]]] = {}
        self._reported: set[int] = set()  # loads reported, waiting for a scatter or release

    @property
    def num_compiles(self) -> int:
        return sum(f.num_compiles for f in (self._gather, self._scatter, self._checksums))

    @property
    def num_inflight(self) -> int:
        """Transfers issued and not yet reported."""
        return len(self._out) + len(self._in) - len(self._reported)

    def _to_host(self, x: jax.Array):
        if self.memory_kind is None:
            return np.asarray(x)
        return jax.device_put(x, x.sharding.with_memory_kind(self.memory_kind))

    def _to_device(self, x: np.ndarray, sharding) -> jax.Array:
        if not self._committed:
            return jax.device_put(x)
        return jax.device_put(x, sharding.with_memory_kind("device"))

    def apply(self, kv, op: KVOp):
        """Applies one op of `TIER_KINDS` to the pool; returns the pool."""
        if op.kind is KVOpKind.SPILL:
            gathered = self._gather(kv.page_leaves(), np.asarray(op.src, np.int32))
            self._out[op.transfer] = ([self._to_host(x) for x in gathered],
                                      self._checksums(gathered))
        elif op.kind is KVOpKind.TIER_LOAD:
            on_device = [self._to_device(x, s)
                         for x, s in zip(op.plan.staged, self._shardings, strict=True)]
            self._in[op.transfer] = (on_device, self._checksums(on_device), op.plan.expected)
        elif op.kind is KVOpKind.TIER_SCATTER:
            on_device, sums, expected = self._in.pop(op.transfer)
            self._reported.discard(op.transfer)
            if not np.array_equal(np.asarray(sums), np.asarray(expected, np.uint32)):
                raise RuntimeError(f"tier load {op.transfer}: the pages arrived with checksums "
                                   f"{np.asarray(sums).tolist()}, not {list(expected)}")
            kv = kv.with_page_leaves(self._scatter(kv.page_leaves(),
                                                   np.asarray(op.dst, np.int32), on_device))
        elif op.kind is KVOpKind.TIER_RELEASE:
            self._out.pop(op.transfer, None)
            self._in.pop(op.transfer, None)
            self._reported.discard(op.transfer)
        else:
            raise ValueError(f"KV operation {op.kind.value!r} is not a tier transfer")
        return kv

    def has_landed(self, transfer: int) -> bool:
        """Whether the transfer's data is at its destination (an unknown one: False)."""
        if transfer in self._out:
            return all(_is_ready(x) for x in self._out[transfer][0])
        return transfer in self._in and _is_ready(self._in[transfer][1])

    def take(self, transfer: int) -> TierLanded:
        """What landed of a transfer (`has_landed`); a spill's chunk is the host's from now on,
        a load's stays on the device for its TIER_SCATTER or TIER_RELEASE."""
        if transfer in self._out:
            leaves, sums = self._out.pop(transfer)
            return TierLanded(transfer, np.asarray(sums), tuple(leaves))
        self._reported.add(transfer)
        return TierLanded(transfer, np.asarray(self._in[transfer][1]))

    def report(self, *, wait: bool = False, host_numpy: bool = True) -> tuple[TierLanded, ...]:
        """Every transfer that landed since the last report (all in flight with `wait`), a
        spill's pages as numpy arrays with `host_numpy` (for the host side, which holds no
        jax array)."""
        if wait:
            self.wait(self._out)
            self.wait(t for t in self._in if t not in self._reported)
        landed = []
        for transfer in [t for t in self._out if self.has_landed(t)] + [
                t for t in self._in if t not in self._reported and self.has_landed(t)]:
            got = self.take(transfer)
            if host_numpy and got.leaves:
                got = TierLanded(transfer, got.checksums, tuple(np.asarray(x)
                                                                 for x in got.leaves))
            landed.append(got)
        return tuple(landed)

    def wait(self, transfers: Iterable[int]) -> None:
        """Blocks until the data of `transfers` (in flight) is at its destination."""
        for t in list(transfers):
            if t in self._out:
                jax.block_until_ready(self._out[t][0])
            elif t in self._in:
                jax.block_until_ready(self._in[t][1])

    def warmup(self, kv, sizes: Sequence[int] | None = None):
        """Compiles the gather, checksum and scatter programs of each chunk size in `sizes`
        (`warm_sizes` by default).

        Scatters each gathered chunk back where it came from, so the pool's content is
        unchanged. Returns the new pool (its buffers were donated).
        """
        leaves = kv.page_leaves()
        num_pages = leaves[0].shape[1]
        for size in sorted(s for s in (self.warm_sizes if sizes is None else sizes)
                           if s <= num_pages):
            pages = np.arange(size, dtype=np.int32)
            gathered = self._gather(leaves, pages)
            self._checksums(gathered)
            # Staged like a load (from host arrays), so the compiled programs are the same ones.
            staged = [self._to_device(np.asarray(x), s)
                      for x, s in zip(gathered, self._shardings, strict=True)]
            self._checksums(staged)
            leaves = self._scatter(leaves, pages, staged)
        jax.block_until_ready(leaves)
        return kv.with_page_leaves(leaves)
