"""KV operations: every change the KV cache manager makes to the device pool, as a record.

The manager owns the host metadata (block tables, prefix cache, tiers, swap space); the model
runner owns the device KV pytree. Each device consequence of a memory decision (a copy-on-write
copy, a swap, a tier load, a scrub, a compaction) is one `KVOp`, in the order the decisions
were made.

Ops of the kinds in `DATA_KINDS` (copy-on-write copies, scrubs, window copies, retention
compactions, chunk loads, swaps to host slots of the swap space and back, and the moves of
host-resident rows' pages between the device pool and the host pool) are plain data: their
index arrays say everything, so the ops the scheduler issues while it forms a step travel in
the step's `SchedulerOutput.kv_plan` and the runner applies them in the step's dispatch, before
the model (`KVDevice.apply_ops`); those of committing a step are what
`Scheduler.update_from_output` returns, applied by the engine core right after. The other kinds
(scatters from outside, placements, calibrations, warm-ups) still run a closure on the device
when issued (`KVDevice.apply`); before one does, the manager hands over the data ops issued
ahead of it, so the pool sees every op in issuing order. Tier transfers are data too
(`TIER_KINDS`): a spill's pages are gathered in the step's dispatch, before anything
overwrites them, and what landed comes back to the tiers' ledger in
`RunnerOutput.tier_landed`. A sequence swapped through the tiers with a KIVI window beside its
pages sends the pages as spills and the window as a SWAP_OUT of no pages into a host slot,
and gets the window back by a SWAP_IN of no pages when it is registered again, ahead of its
tier loads: every swap is data.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from kvjax.kv.retention_host import CompactionPlan
from kvjax.shapes import next_power_of_2


class KVOpKind(enum.StrEnum):
    COPY = "copy"  # copy-on-write page copies
    SWAP_OUT = "swap_out"  # pages to host memory (reads the pool)
    SWAP_IN = "swap_in"  # pages back from host memory
    SWAP_DROP = "swap_drop"  # a swapped copy forgotten (its sequence finished or restarts)
    SCRUB = "scrub"  # freed pages (and window slots) zeroed
    COMPACT = "compact"  # a retention policy's compaction of kept tokens
    COPY_WINDOW = "copy_window"  # a KIVI window copied to a forked sequence
    SPILL = "spill"  # pages gathered for a tier transfer to host memory (reads the pool)
    TIER_LOAD = "tier_load"  # a chunk staged on the host sent to the device (not in the pool yet)
    TIER_SCATTER = "tier_scatter"  # a verified tier load written into its pages
    TIER_RELEASE = "tier_release"  # a tier transfer the runner forgets (failed, cancelled)
    SCATTER = "scatter"  # pages written from outside (snapshots, disaggregated prefill)
    CHUNK_LOAD = "chunk_load"  # a cached chunk's tokens copied into a sequence, re-rotated
    PLACE = "place"  # the pool moved to other devices or shardings
    CALIBRATE = "calibrate"  # static codec scales set
    WARMUP = "warmup"  # programs compiled on padding inputs; the pool is unchanged
    HOST_OUT = "host_out"  # a row's pages to the host pool, where its decode attention reads them
    DEMOTE = "demote"  # pages of a mixed-precision pool re-encoded in place at a coarser class
    HOST_IN = "host_in"  # host-pool pages back into device pages


# Kinds whose ops carry all they do as index arrays (the runner applies them from the data).
# With tiers on, a swap's pages go through the tiers' transfers (SPILL, TIER_LOAD,
# TIER_SCATTER); a KIVI window beside them through a host slot (SWAP_OUT, SWAP_IN).
TIER_KINDS = frozenset({KVOpKind.SPILL, KVOpKind.TIER_LOAD, KVOpKind.TIER_SCATTER,
                        KVOpKind.TIER_RELEASE})
DATA_KINDS = frozenset({KVOpKind.COPY, KVOpKind.SCRUB, KVOpKind.COPY_WINDOW,
                        KVOpKind.COMPACT, KVOpKind.CHUNK_LOAD, KVOpKind.HOST_OUT,
                        KVOpKind.HOST_IN, KVOpKind.SWAP_OUT, KVOpKind.SWAP_IN,
                        KVOpKind.SWAP_DROP, KVOpKind.DEMOTE}) | TIER_KINDS


@dataclasses.dataclass(frozen=True)
class TierLoadPlan:
    """The bytes of a tier load: a chunk of n pages staged on the host, one page-first numpy
    array [L, n, ...] per leaf of the pool, and the checksums its pages must have on arrival
    (the runner checks them before a TIER_SCATTER writes the chunk). Ops compare by their
    transfer id, pages and checksums, not by the bytes."""

    expected: tuple[int, ...]
    staged: tuple = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class TierLanded:
    """What the runner reports of a tier transfer whose data is in (`RunnerOutput`).

    Attributes:
      transfer: the transfer's id (`KVOp.transfer`).
      checksums: [n] uint32, the pages' checksums computed on the device (a SPILL: of the
        gathered pages; a TIER_LOAD: of the pages as they arrived).
      leaves: a SPILL: the pages in host memory, page-first arrays [L, n, ...] per leaf;
        a TIER_LOAD: () (its pages wait on the device for a TIER_SCATTER or TIER_RELEASE).
    """

    transfer: int
    checksums: np.ndarray = dataclasses.field(compare=False)
    leaves: tuple = dataclasses.field(default=(), compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class ChunkLoadPlan:
    """Tokens of a cached chunk copied into a sequence's slots, keys re-rotated
    (`kvjax.kv.reuse.copy_rotated`), as host data padded to sizes set by the token count
    alone (one program per padded count).

    Attributes:
      src_pages: [n // P + 1] the chunk's pages the tokens span (0 past them).
      offset: where the first token sits in src_pages[0] (< P).
      dst_slots: [n] the slot each token is written to (-1 past the tokens: nothing).
      shift: rotary positions each key turns forward.
      key_scale: what each key is multiplied by.
    """

    src_pages: tuple[int, ...]
    offset: int
    dst_slots: tuple[int, ...]
    shift: int
    key_scale: float

    @staticmethod
    def padded(src_pages: Sequence[int], offset: int, dst_slots: Sequence[int], shift: int,
               key_scale: float, *, page_size: int) -> ChunkLoadPlan:
        """The plan of len(dst_slots) tokens, padded to a power of two n."""
        if not 0 <= offset < page_size:
            raise ValueError(f"chunk load offset {offset} must be inside the first page "
                             f"(page size {page_size})")
        n = next_power_of_2(len(dst_slots))
        src = np.zeros(max(n // page_size, 1) + 1, np.int32)
        src[:len(src_pages)] = src_pages
        dst = np.full(n, -1, np.int32)
        dst[:len(dst_slots)] = dst_slots
        return ChunkLoadPlan(tuple(src.tolist()), int(offset), tuple(dst.tolist()),
                             int(shift), float(key_scale))


@dataclasses.dataclass(frozen=True)
class KVOp:
    """One operation on the device pool.

    Index arrays are int32 values held as tuples (so ops compare and hash as plain data),
    padded by the issuer to bucketed lengths (a power of two, repeating the last entry:
    repeating a copy or a zeroing is harmless), so each length compiles once.

    Attributes:
      kind: what it does.
      pages: the pool pages it writes (or reads, for SWAP_OUT and SPILL), unpadded.
      src, dst: COPY: page dst[i] becomes a copy of page src[i]. COPY_WINDOW: sequence slot
        dst[0] becomes a copy of slot src[0]. SCRUB: dst are the pages zeroed (empty: none).
        HOST_OUT: host-pool page dst[i] becomes a copy of device page src[i]. HOST_IN: device
        page dst[i] becomes a copy of host-pool page src[i] (with `layers`, in layer
        layers[i] alone). SWAP_OUT: the host copy
        `host_slot` holds pool pages src (padded; its first len(pages) are the copy's pages,
        in block-table order, every layer group's). SWAP_IN: pool page dst[i] becomes the
        copy's page src[i] (empty: none), and the copy is freed. DEMOTE: dst are the pages
        re-encoded (padded).
      seq_slots: SCRUB: the sequence slots zeroed (KIVI windows of freed sequences; empty:
        none). SWAP_OUT: the slot whose window the copy takes too; SWAP_IN: the slot it is
        written into (empty: the state keeps no windows). With tiers on, a window's SWAP_OUT
        and SWAP_IN carry no pages (the tiers move them).
      plan: COMPACT: the sequence's `CompactionPlan` (`pages`: its block table after it).
        CHUNK_LOAD: the `ChunkLoadPlan` (`pages`: the pages it writes).
      host_slot: SWAP_OUT, SWAP_IN, SWAP_DROP: the host copy's key in the swap space (the KV
        cache manager hands them out; -1: none).
      bits: SWAP_OUT: the precision the copy is demoted to (8 or 4; 0: as stored). DEMOTE:
        the class the pages' keys take (0 exact, 8, 4; a row never gets finer).
      v_bits: DEMOTE: the class the pages' values take.
      transfer: SPILL, TIER_LOAD, TIER_SCATTER, TIER_RELEASE: the tier transfer's id. SPILL
        gathers pool pages src into one chunk and sends it to host memory; TIER_LOAD sends
        its `TierLoadPlan` chunk to the device; TIER_SCATTER writes that chunk into pool
        pages dst; TIER_RELEASE forgets the transfer. What landed comes back in
        `RunnerOutput.tier_landed` (`TierLanded`).
      layers: HOST_IN of single layers (ECHO's per-layer residency, `kvjax.scheduler.echo`):
        the layer of each (src, dst) pair, padded like them; empty: every layer.
    """

    kind: KVOpKind
    pages: tuple[int, ...] = ()
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()
    seq_slots: tuple[int, ...] = ()
    plan: CompactionPlan | ChunkLoadPlan | TierLoadPlan | None = None
    host_slot: int = -1
    bits: int = 0
    transfer: int = -1
    layers: tuple[int, ...] = ()
    v_bits: int = 0


class KVDevice(Protocol):
    """The owner of the device KV pytree (the model runner)."""

    @property
    def kv(self) -> Any:
        """The current KV state (read it; change it only through `apply`)."""

    def apply(self, op: KVOp, fn: Callable[[Any], Any]) -> None:
        """Replaces the KV state with fn(state) and records `op`."""

    def apply_ops(self, ops: Sequence[KVOp]) -> None:
        """Applies ops of `DATA_KINDS`, in order, from their index arrays."""

    def run_op(self, kv: Any, op: KVOp) -> Any:
        """The program of an op of `DATA_KINDS` applied to `kv`, unrecorded (warm-up runs
        it on padding ops that change nothing)."""


class HostKV:
    """A KVDevice over a KV state held in a plain attribute (tests, tools); `host_kv`: its
    host pool (`KVOpKind.HOST_OUT` / `HOST_IN`), or None; `rotate`: how compactions turn
    kept keys (`kvjax.kv.state.Rotate`), or None; `swapped`: host slot -> the swapped copy
    (pages as stored, and the window) `KVOpKind.SWAP_OUT` left there."""

    def __init__(self, kv: Any, host_kv: Any = None, rotate: Any = None):
        self.kv = kv
        self.host_kv = host_kv
        self.rotate = rotate
        self.ops: list[KVOp] = []
        self.swapped: dict[int, tuple[Any, Any]] = {}

    def apply(self, op: KVOp, fn: Callable[[Any], Any]) -> None:
        self.kv = fn(self.kv)
        self.ops.append(op)

    def apply_ops(self, ops: Sequence[KVOp]) -> None:
        for op in ops:
            self.kv = self.run_op(self.kv, op)
            self.ops.append(op)

    def run_op(self, kv: Any, op: KVOp) -> Any:
        # Imported lazily: the host side runs without jax.
        from kvjax.kv import pages, retention

        src, dst = np.asarray(op.src, np.int32), np.asarray(op.dst, np.int32)
        if op.kind is KVOpKind.COPY:
            return kv.copy_pages(src, dst)
        if op.kind is KVOpKind.COPY_WINDOW:
            return pages.scatter_seq_slots(kv, dst, pages.gather_seq_slots(kv, src))
        if op.kind is KVOpKind.COMPACT:
            return kv.compact(retention.compaction_of(op.plan), self.rotate)
        if op.kind is KVOpKind.HOST_OUT:
            self.host_kv = pages.scatter_pages(self.host_kv, dst, pages.gather_pages(kv, src))
            return kv
        if op.kind is KVOpKind.HOST_IN:
            return pages.scatter_pages(kv, dst, pages.gather_pages(self.host_kv, src))
        if op.kind is KVOpKind.SCRUB:
            return pages.scrub(kv, dst, np.asarray(op.seq_slots, np.int32))
        if op.kind in (KVOpKind.SWAP_OUT, KVOpKind.SWAP_IN, KVOpKind.SWAP_DROP):
            return self._swap(kv, op, src, dst)
        if op.kind is KVOpKind.DEMOTE:  # a mixed-precision pool (`kvjax.kv.mixed`)
            return kv.demote(dst, np.int32(op.bits), np.int32(op.v_bits))
        raise ValueError(f"HostKV has no program for KV operation {op.kind.value!r}")

    def _swap(self, kv: Any, op: KVOp, src: np.ndarray, dst: np.ndarray) -> Any:
        from kvjax.kv import pages

        slots = np.asarray(op.seq_slots, np.int32)
        if op.kind is KVOpKind.SWAP_OUT:
            if op.bits:
                raise ValueError(f"HostKV keeps swapped copies as stored, not at {op.bits} bits")
            self.swapped[op.host_slot] = (pages.gather_pages(kv, src) if len(src) else None,
                                          pages.gather_seq_slots(kv, slots) if len(slots)
                                          else None)
            return kv
        blob, window = self.swapped.pop(op.host_slot)
        if op.kind is KVOpKind.SWAP_IN:
            if len(dst):
                kv = pages.scatter_pages(kv, dst, pages.take(blob, src))
            if len(slots):
                kv = pages.scatter_seq_slots(kv, slots, window)
        return kv
