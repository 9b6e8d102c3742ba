"""The record every tier transfer goes through: its fault draw, its outcome, the bytes it moved."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

from kvjax.memory.transfer import FaultConfig, FaultInjector, Transfer, TransferKind, TransferState
from kvjax.trace import NULL_TRACER, Tracer


class TransferLedger:
    """Draws each tier transfer's fault and counts what the transfers did.

    The TierManager and its movers (DeviceStaging, DiskQueue) share one ledger.

    Attributes:
        faults: the FaultInjector.
        clock: what issue and landing times are read from.
        stats: bytes moved per direction, transfers committed/failed/timed out, pages dropped.
        recent_transfers: the last 4096 transfers, for inspection.
    """

    def __init__(self, faults: FaultConfig, clock: Callable[[], float]):
        self.faults = FaultInjector(faults)
        self.clock = clock
        self.tracer: Tracer = NULL_TRACER
        self.recent_transfers: collections.deque[Transfer] = collections.deque(maxlen=4096)
        # Ids count from 0 per ledger: a replayed ledger gives its transfers the same ones.
        self._ids = itertools.count()
        self.stats = dict(bytes_device_to_host=0, bytes_host_to_device=0, bytes_host_to_disk=0,
                          bytes_disk_to_host=0, transfers_committed=0, transfers_failed=0,
                          transfers_timed_out=0, pages_dropped=0, pages_loaded=0,
                          device_transfer_s=0.0, device_transfer_bytes=0)

    def track(self, t: Transfer) -> Transfer:
        """Numbers `t`, draws its fault and records it among the recent transfers."""
        t.transfer_id = next(self._ids)
        t.fault = self.faults.draw(t.kind)
        t.tracer = self.tracer
        self.tracer.emit(t.state.value, "transfer", f"tier/{t.kind.value}",
                         transfer_id=t.transfer_id, owner=str(t.owner), num_pages=len(t.keys),
                         nbytes=t.nbytes)
        self.recent_transfers.append(t)
        return t

    def finished(self, t: Transfer) -> None:
        """Counts a transfer that committed or failed (and a device transfer's time)."""
        self.stats["transfers_committed" if t.state is TransferState.COMMITTED
                   else "transfers_failed"] += 1
        if t.kind in (TransferKind.DEVICE_TO_HOST, TransferKind.HOST_TO_DEVICE) and t.land_time:
            self.stats["device_transfer_s"] += t.land_time - t.issue_time
            self.stats["device_transfer_bytes"] += t.nbytes
