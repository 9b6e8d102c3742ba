"""KV operations: every change the KV cache manager makes to the device pool, as a record.

The manager owns the host metadata (block tables, prefix cache, tiers, swap space); the model
runner owns the device KV pytree. Each device consequence of a memory decision (a copy-on-write
copy, a swap, a tier load, a scrub, a compaction) goes through `KVDevice.apply` as one `KVOp`,
in the order the decisions were made, and the runner lists the ops of each step in the
`SchedulerOutput` for metering and tracing. Ops are applied when issued: JAX dispatch is
asynchronous anyway, and issuing order is what keeps, e.g., a spill of an evicted page ahead of
the copy that overwrites it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Protocol


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


@dataclasses.dataclass(frozen=True)
class KVOp:
    """One operation on the device pool.

    Attributes:
      kind: what it does.
      pages: the pool pages it writes (or reads, for SWAP_OUT and SPILL).
    """

    kind: KVOpKind
    pages: tuple[int, ...] = ()


class KVDevice(Protocol):
    """The owner of the device KV pytree (the model runner)."""

    @property
    def kv(self) -> Any:
        """The current KV state (read it; change it only through `apply`)."""

    def apply(self, op: KVOp, fn: Callable[[Any], Any]) -> None:
        """Replaces the KV state with fn(state) and records `op`."""

    def copy_pages(self, kv: Any, src, dst) -> Any:
        """The pool's copy program: page dst[i] becomes a copy of page src[i]."""

    def read(self, op: KVOp, fn: Callable[[Any], Any]) -> Any:
        """Records `op` and returns fn(state); the state is unchanged (gathers to host)."""


class HostKV:
    """A KVDevice over a KV state held in a plain attribute (tests, tools)."""

    def __init__(self, kv: Any):
        self.kv = kv
        self.ops: list[KVOp] = []

    def apply(self, op: KVOp, fn: Callable[[Any], Any]) -> None:
        self.kv = fn(self.kv)
        self.ops.append(op)

    def copy_pages(self, kv: Any, src, dst) -> Any:
        return kv.copy_pages(src, dst)

    def read(self, op: KVOp, fn: Callable[[Any], Any]) -> Any:
        self.ops.append(op)
        return fn(self.kv)
