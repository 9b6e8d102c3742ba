"""Tier configuration: budgets, the disk directory, the transfer layout, faults."""

from __future__ import annotations

import dataclasses
import enum

from kvjax.memory.transfer import FaultConfig


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

