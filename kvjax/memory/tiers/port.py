"""Where the tiers' ledger sends its transfer ops and learns what landed.

`TierManager` (the host-side ledger) decides every transfer as a `KVOp` of `TIER_KINDS` and
reads back `TierLanded` reports. A `PlannedTierPort` (the engine's) hands the ops to the KV
cache manager, so they travel in the step's `SchedulerOutput.kv_plan` and the runner applies
them in its dispatch; reports arrive from `RunnerOutput.tier_landed` (`receive`), or from
the engine core right after dispatching a step with none in flight, so a key spilled in step t
reads as in flight until its report is received. A `LocalTierPort`
applies each op at once on a pool it is handed (tools, tests, the bandwidth probe).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from kvjax.memory.ops import KVOp, TierLanded


class PlannedTierPort:
    """The tiers' ops go to `issue_to` (the KV cache manager's plan); what landed comes back
    through `receive`. It holds no device array and imports no jax."""

    def __init__(self, page_shapes, page_dtypes, memory_kind: str | None):
        self.page_shapes = [tuple(s) for s in page_shapes]
        self.page_dtypes = [np.dtype(d) for d in page_dtypes]
        self.memory_kind = memory_kind
        self.issue_to: Callable[[KVOp], None] | None = None
        self._landed: dict[int, TierLanded] = {}

    @classmethod
    def of(cls, kv, memory_kind: str | None) -> PlannedTierPort:
        """A port for a page-major pool `kv` (its shapes and dtypes only)."""
        leaves = kv.page_leaves()
        return cls([(x.shape[0], *x.shape[2:]) for x in leaves], [x.dtype for x in leaves],
                   memory_kind)

    num_compiles = 0  # the runner compiles (and counts) the tier programs

    def issue(self, op: KVOp) -> None:
        if self.issue_to is None:
            raise RuntimeError("the tiers' port is not attached to a KV cache manager")
        self.issue_to(op)

    def receive(self, landed: Iterable[TierLanded], wanted: Callable[[int], bool]) -> None:
        for report in landed:
            if wanted(report.transfer):
                self._landed[report.transfer] = report

    def has_landed(self, transfer: int) -> bool:
        return transfer in self._landed

    def take(self, transfer: int) -> TierLanded:
        return self._landed.pop(transfer)

    def forget(self, transfer: int) -> None:
        self._landed.pop(transfer, None)

    def wait(self, transfers: Iterable[int]) -> None:
        """Nothing to wait on here: reports arrive with the runner's outputs."""


class LocalTierPort:
    """Applies the tiers' ops at once to the pool in `kv` (set it before a call that issues
    ops and read it back after), through the runner-side `TierTransfers`."""

    def __init__(self, kv, warm_sizes=()):
        from kvjax.memory.tiers.transfers import TierTransfers  # the device side

        leaves = kv.page_leaves()
        self.page_shapes = [(x.shape[0], *x.shape[2:]) for x in leaves]
        self.page_dtypes = [np.dtype(x.dtype) for x in leaves]
        self.transfers = TierTransfers(kv, warm_sizes=warm_sizes)
        self.memory_kind = self.transfers.memory_kind
        self.kv = kv

    @property
    def num_compiles(self) -> int:
        return self.transfers.num_compiles

    def issue(self, op: KVOp) -> None:
        self.kv = self.transfers.apply(self.kv, op)

    def receive(self, landed, wanted) -> None:
        raise ValueError("a local tier port reads landings from its own transfers")

    def has_landed(self, transfer: int) -> bool:
        return self.transfers.has_landed(transfer)

    def take(self, transfer: int) -> TierLanded:
        return self.transfers.take(transfer)

    def forget(self, transfer: int) -> None:
        pass

    def wait(self, transfers: Iterable[int]) -> None:
        self.transfers.wait(transfers)


def page_bytes_of(page_shapes, page_dtypes) -> int:
    """Bytes of one page over all leaves."""
    return sum(math.prod(s) * np.dtype(d).itemsize
               for s, d in zip(page_shapes, page_dtypes, strict=True))
