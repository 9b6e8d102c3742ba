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
