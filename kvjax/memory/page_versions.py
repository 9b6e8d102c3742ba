"""The page-version ledger: which weights version last wrote each device page and each
host-pool page, so a read of KV written under other weights is caught (`debug_provenance`)."""

from __future__ import annotations

from collections.abc import Iterable


class PageVersions:
    """Attributes:
      device: pool page -> the weights version that last wrote it.
      host: host-pool page -> the weights version that wrote it.
    """

    def __init__(self):
        self.device: dict[int, str] = {}
        self.host: dict[int, str] = {}

    def mark_written(self, pages: Iterable[int], version: str) -> None:
        """Records that `version`'s weights wrote these device pages."""
        for page in pages:
            self.device[int(page)] = version

    def copied(self, src: Iterable[int], dst: Iterable[int]) -> None:
        """Device pages `dst` now hold copies of device pages `src`."""
        for d, s in zip(dst, src, strict=True):
            self.device[d] = self.device.get(s, "")

    def to_host(self, src: Iterable[int], dst: Iterable[int]) -> None:
        """Host-pool pages `dst` now hold copies of device pages `src`."""
        for d, s in zip(dst, src, strict=True):
            self.host[d] = self.device.get(s, "")

    def to_device(self, src: Iterable[int], dst: Iterable[int]) -> None:
        """Device pages `dst` now hold copies of host-pool pages `src`."""
        for d, s in zip(dst, src, strict=True):
            self.device[d] = self.host.get(int(s), "")

    def stale(self, pages: Iterable[int], host_pages: Iterable[int], version: str) -> list:
        """Of these device and host-pool pages, those written under other weights than
        `version` (host-pool pages as 'host:<page>')."""
        return ([p for p in pages if self.device.get(p) != version]
                + [f"host:{p}" for p in host_pages if self.host.get(p) != version])

    def check_fresh(self, seq_id: str, version: str, stale: list, stats: dict) -> None:
        """Raises (and counts) if the sequence, under weights `version`, would read `stale`
        pages."""
        if stale:
            stats["stale_kv_reads"] += len(stale)
            raise RuntimeError(
                f"stale KV: sequence {seq_id!r} (weights {version!r}) would read pages "
                f"{stale[:4]} written under {[self.device.get(p) for p in stale[:4]]}")
