"""Where each decode row's pages live between the device and host pools: the split policy's
targets applied before a step, and a row offloaded to the host instead of a preemption
(`kvjax.scheduler.host_split` holds the policies).

A KV controller owns the rows it moves to the host (`Decisions.to_host`, through `hold`): the
split policy may not bring such a row back until the device's free pages cover the
controller's `Decisions.reserve` (what the queued sequences it made room for need) and the
row's own pages, so the two never undo each other's moves step after step."""

from __future__ import annotations

from kvjax.scheduler.host_split import HostSplitPolicy, Never, RowPlacement
from kvjax.scheduler.request import SeqStatus, Sequence


class HostPlacement:
    """Moves decode rows' full pages between the pools for the scheduler.

    Attributes:
      policy: the HostSplitPolicy (`Never`: every page stays on the device).
      kv_cache: the KVCacheManager that moves the pages.
      held: the rows a KV controller moved to the host pool (`hold`) that have not come back.
    """

    def __init__(self, policy: HostSplitPolicy | None, kv_cache, page_size: int, stats: dict):
        self.policy = policy or Never()
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.stats = stats
        self.held: set[str] = set()

    def _placement(self, seq: Sequence) -> RowPlacement:
        cached = self.kv_cache.cached_len(seq.seq_id, seq.num_computed)
        # The position the row writes: its page stays on the device.
        return RowPlacement(seq.seq_id, cached + 1, cached // self.page_size,
                            self.kv_cache.num_host_pages(seq.seq_id))

    def place_rows(self, decoding: list[Sequence], reserve: int = 0) -> None:
        """Moves pages between the pools to the split policy's targets for this step's
        decode rows (a move that finds no room leaves the row as it is); a row the
        controller holds on the host comes back only where the free device pages cover
        `reserve` (the controller's `Decisions.reserve`) and the pages it brings back."""
        self.held = {i for i in self.held if self.kv_cache.num_host_pages(i)}
        if not self.policy.uses_host or not decoding:
            return
        rows = [self._placement(s) for s in decoding]
        targets = self.policy.targets(rows, self.kv_cache.allocator.num_free_pages(),
                                      self.kv_cache.num_free_host_pages())
        for row in rows:
            if row.seq_id not in targets:
                continue
            target = min(max(targets[row.seq_id], 0), row.num_full_pages)
            back = row.num_host_pages - target
            if back < 0:
                self.kv_cache.to_host(row.seq_id, -back)
            elif back > 0 and self._may_return(row.seq_id, back, reserve):
                self.kv_cache.to_device(row.seq_id, back)

    def _may_return(self, seq_id: str, num: int, reserve: int) -> bool:
        """Whether `num` of the row's host pages may come back: always for the split
        policy's own rows; for one the controller holds, once the device has room for them
        beyond `reserve` (it is then the policy's again)."""
        if seq_id not in self.held:
            return True
        if self.kv_cache.allocator.num_free_pages() - num < reserve:
            return False
        self.held.discard(seq_id)
        return True

    def offload_a_row(self, ranked_running: list[Sequence]) -> bool:
        """The device pool is full: moves the full device pages of the lowest-ranked decoding
        sequence that has some, and room in the host pool, there; False if none does."""
        return any(self.offload(seq) for seq in reversed(ranked_running))

    def offload(self, seq: Sequence) -> bool:
        """Moves a decoding sequence's full device pages to the host pool, where its decode
        attention reads them; False, with nothing moved, when it is no decoding row, has no
        full device page, or the host pool lacks room."""
        if not self.policy.uses_host or seq.status is not SeqStatus.RUNNING \
                or seq.num_pending != 1:
            return False  # prefill rows read device pages only
        row = self._placement(seq)
        extra = row.num_full_pages - row.num_host_pages
        if extra > 0 and self.kv_cache.to_host(seq.seq_id, extra):
            self.stats["host_offloads"] += 1
            return True
        return False

    def hold(self, seq: Sequence) -> bool:
        """`offload` for a KV controller's `to_host` decision: the row then stays on the host
        until the controller's reserve leaves room for it (`place_rows`)."""
        if not self.offload(seq):
            return False
        self.held.add(seq.seq_id)
        return True

    def row_rates(self) -> tuple[int, float, float] | None:
        """(free host pages, the host's decode-attention tokens per second, the device's step
        seconds) a KV controller prices a host-resident row with; None without a host pool."""
        if not self.policy.uses_host:
            return None
        return (self.kv_cache.num_free_host_pages(), *self.policy.rates())
