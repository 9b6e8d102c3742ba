"""KV operations: every change the KV cache manager makes to the device pool, as a record.

The manager owns the host metadata (block tables, prefix cache, tiers, swap space); the model
runner owns the device KV pytree. Each device consequence of a memory decision (a copy-on-write
copy, a swap, a tier load, a scrub, a compaction) is one `KVOp`, in the order the decisions
were made.

Ops of the kinds in `DATA_KINDS` (copy-on-write copies, scrubs, window copies, and the moves of
host-resident rows' pages between the device pool and the host pool) are plain data: their
index arrays say everything, so the ops the scheduler issues while it forms a step travel in
the step's `SchedulerOutput.kv_plan` and the runner applies them in the step's dispatch, before
the model (`KVDevice.apply_ops`); those of committing a step are what
`Scheduler.update_from_output` returns, applied by the engine core right after. The other kinds
still run a closure on the device when issued (`KVDevice.apply`, `KVDevice.read`); before one
does, the manager hands over the data ops issued ahead of it, so the pool sees every op in
issuing order (a spill of an evicted page before the copy that overwrites it).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np


class KVOpKind(enum.StrEnum):
    COPY = "copy"  # copy-on-write page copies
    SWAP_OUT = "swap_out"  # pages to host memory (reads the pool)
    SWAP_IN = "swap_in"  # pages back from host memory
    SCRUB = "scrub"  # freed pages (and window slots) zeroed
    COMPACT = "compact"  # a retention policy's compaction of kept tokens
    COPY_WINDOW = "copy_window"  # a KIVI window copied to a forked sequence
    SPILL = "spill"  # evicted prefix-cache pages to the host tier (reads the pool)
    POLL = "poll"  # tier transfers advanced; landed loads scattered into pages
    SCATTER = "scatter"  # pages written from outside (snapshots, disaggregated prefill)
    CHUNK_LOAD = "chunk_load"  # a cached chunk's tokens copied into a sequence, re-rotated
    PLACE = "place"  # the pool moved to other devices or shardings
    CALIBRATE = "calibrate"  # static codec scales set
    WARMUP = "warmup"  # programs compiled on padding inputs; the pool is unchanged
    HOST_OUT = "host_out"  # a row's pages to the host pool, where its decode attention reads them
    HOST_IN = "host_in"  # host-pool pages back into device pages


# Kinds whose ops carry all they do as index arrays (the runner applies them from the data).
DATA_KINDS = frozenset({KVOpKind.COPY, KVOpKind.SCRUB, KVOpKind.COPY_WINDOW,
                        KVOpKind.HOST_OUT, KVOpKind.HOST_IN})


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
        page dst[i] becomes a copy of host-pool page src[i].
      seq_slots: SCRUB: the sequence slots zeroed (KIVI windows of freed sequences; empty:
        none).
    """

    kind: KVOpKind
    pages: tuple[int, ...] = ()
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()
    seq_slots: tuple[int, ...] = ()


class KVDevice(Protocol):
    """The owner of the device KV pytree (the model runner)."""

    @property
    def kv(self) -> Any:
        """The current KV state (read it; change it only through `apply`)."""

    def apply(self, op: KVOp, fn: Callable[[Any], Any]) -> None:
        """Replaces the KV state with fn(state) and records `op`."""

    def apply_ops(self, ops: Sequence[KVOp]) -> None:
        """Applies ops of `DATA_KINDS`, in order, from their index arrays."""

    def copy_pages(self, kv: Any, src, dst) -> Any:
        """The pool's copy program: page dst[i] becomes a copy of page src[i]."""

    def read(self, op: KVOp, fn: Callable[[Any], Any]) -> Any:
        """Records `op` and returns fn(state); the state is unchanged (gathers to host)."""


class HostKV:
    """A KVDevice over a KV state held in a plain attribute (tests, tools); `host_kv`: its
    host pool (`KVOpKind.HOST_OUT` / `HOST_IN`), or None."""

    def __init__(self, kv: Any, host_kv: Any = None):
        self.kv = kv
        self.host_kv = host_kv
        self.ops: list[KVOp] = []

    def apply(self, op: KVOp, fn: Callable[[Any], Any]) -> None:
        self.kv = fn(self.kv)
        self.ops.append(op)

    def apply_ops(self, ops: Sequence[KVOp]) -> None:
        from kvjax.kv import pages  # Imported lazily: the host side runs without jax.

        for op in ops:
            if op.kind is KVOpKind.COPY:
                self.kv = self.kv.copy_pages(np.asarray(op.src, np.int32),
                                             np.asarray(op.dst, np.int32))
            elif op.kind is KVOpKind.COPY_WINDOW:
                src, dst = np.asarray(op.src, np.int32), np.asarray(op.dst, np.int32)
                self.kv = pages.scatter_seq_slots(self.kv, dst,
                                                  pages.gather_seq_slots(self.kv, src))
            elif op.kind is KVOpKind.HOST_OUT:
                self.host_kv = pages.scatter_pages(
                    self.host_kv, np.asarray(op.dst, np.int32),
                    pages.gather_pages(self.kv, np.asarray(op.src, np.int32)))
            elif op.kind is KVOpKind.HOST_IN:
                self.kv = pages.scatter_pages(
                    self.kv, np.asarray(op.dst, np.int32),
                    pages.gather_pages(self.host_kv, np.asarray(op.src, np.int32)))
            else:
                self.kv = pages.scrub(self.kv, np.asarray(op.dst, np.int32),
                                      np.asarray(op.seq_slots, np.int32))
            self.ops.append(op)

    def copy_pages(self, kv: Any, src, dst) -> Any:
        return kv.copy_pages(src, dst)

    def read(self, op: KVOp, fn: Callable[[Any], Any]) -> Any:
        self.ops.append(op)
        return fn(self.kv)
