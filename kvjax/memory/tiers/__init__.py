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

Modules: `config` (TierConfig, TransferLayout), `host` (HostTier), `disk` (the page file format
and DiskTier), `manager` (TierManager: the host-side ledger, with `loads.TierLoads`,
`disk_queue.DiskQueue` the host tier's traffic with the disk, and `ledger.TransferLedger` the
record of every transfer; it imports no jax), `port` (where its transfer ops go: the step's
plan, or a local pool), `transfers` (TierTransfers: the runner's side, which gathers,
checksums, moves and scatters chunks of pages), `swap` (TieredSwapSpace) and `bandwidth`
(measure_transfer_bandwidth).
"""

from kvjax.memory.prefix_cache import page_hash_chain
from kvjax.memory.tiers.config import TierConfig, TransferLayout
from kvjax.memory.tiers.disk import DiskTier
from kvjax.memory.tiers.host import HostTier, host_memory_kind
from kvjax.memory.tiers.manager import LoadResult, TierManager
from kvjax.memory.tiers.port import LocalTierPort, PlannedTierPort
from kvjax.memory.tiers.swap import TieredSwapSpace

# The device side loads on first use: the host side (the ledger) runs without jax.
_DEVICE_NAMES = {"TierTransfers": "kvjax.memory.tiers.transfers",
                 "measure_transfer_bandwidth": "kvjax.memory.tiers.bandwidth"}


def __getattr__(name: str):
    if name not in _DEVICE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_DEVICE_NAMES[name]), name)


__all__ = [
    "DiskTier",
    "HostTier",
    "LoadResult",
    "LocalTierPort",
    "PlannedTierPort",
    "TierConfig",
    "TierManager",
    "TierTransfers",
    "TieredSwapSpace",
    "TransferLayout",
    "host_memory_kind",
    "measure_transfer_bandwidth",
    "page_hash_chain",
]
