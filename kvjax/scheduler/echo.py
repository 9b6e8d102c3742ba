"""Host-authoritative sparse KV (ECHO): which pages a decode row keeps on the device.

With Quest's `echo_prefetch` option every full page of a decoding sequence has a copy in the
host pool, and the device keeps `num_read - 1 + echo_prefetch` of them plus the page the row
writes (`kvjax.engine.echo` has the step's side). The plan for step t + 1 comes from the
selection of the row's last step the host has seen (step t, or t - 1 under asynchronous
scheduling): each full page scores the number of layers that read it, and the pages of
highest score stay on the device (ties to the most recent), the rest are released and come
back from their host copies when they rank again. The step computes the exact selection
whatever the plan, so a wrong guess costs bytes over the link, never a changed token.

Plain Python and numpy: the planner issues its moves through the KV cache manager
(`KVCacheManager.echo_place`) as `KVOpKind.HOST_OUT` / `HOST_IN` ops the runner applies.

Stats (in the engine's): `echo_selected_pages`, the (layer, page) reads of decode rows whose
pages could be released; `echo_resident_reads`, those whose page was on the device (prefetch
recall = their ratio); `echo_pages_mirrored`, `_released`, `_prefetched` (page moves, from the
KV cache manager).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def plan_residency(votes: np.ndarray | None, num_full: int, num_keep: int) -> set[int]:
    """The full pages [0, num_full) a row keeps on the device for its next step.

    Args:
      votes: [W] how many layers read each table entry in the row's last seen step, or None
        (none seen yet: every full page stays).
      num_full: the row's full pages.
      num_keep: how many of them the device keeps.
    """
    if votes is None:
        return set(range(num_full))
    score = np.zeros(num_full, np.int64)
    n = min(num_full, len(votes))
    score[:n] = votes[:n]
    order = sorted(range(num_full), key=lambda j: (-score[j], -j))  # most read, then newest
    return set(order[:num_keep])


class EchoPlanner:
    """Plans each decode row's device-resident pages and counts prefetch recall.

    Attributes:
      num_keep: full pages a decode row keeps on the device (Quest's reads less the page it
        writes, plus the prefetch margin).
    """

    def __init__(self, kv_cache, page_size: int, num_read: int, prefetch: int, stats: dict):
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.num_keep = max(num_read - 1, 0) + prefetch
        self.stats = stats
        self._votes: dict[str, np.ndarray] = {}
        stats.update(echo_selected_pages=0, echo_resident_reads=0)

    def place(self, rows: Sequence[tuple[str, int]], live: Sequence[str]) -> None:
        """Moves pages for this step's decode rows (seq_id, cached tokens before the step)."""
        self._votes = {k: v for k, v in self._votes.items() if k in set(live)}
        for seq_id, cached in rows:
            num_full = cached // self.page_size
            keep = plan_residency(self._votes.get(seq_id), num_full, self.num_keep)
            self.kv_cache.echo_place(seq_id, num_full, keep)

    def host_table(self, seq_id: str) -> np.ndarray:
        """The row's `ScheduledRow.host_table`: per entry, the host page it reads, or -1."""
        return self.kv_cache.echo_host_table(seq_id)

    def observe(self, rows: Sequence, page_reads: np.ndarray | None) -> None:
        """Takes a step's selection (`RunnerOutput.page_reads` [Rd, L, W] of its decode rows
        `rows`) as the next plan's votes, and counts the reads of resident pages."""
        if page_reads is None:
            return
        for row, reads in zip(rows, page_reads, strict=True):
            if row.host_table is None or row.is_draft:
                continue
            n = len(row.host_table)
            full = (row.start - row.num_evicted) // self.page_size  # before its write
            selected = reads[:, :min(n, full)]  # [L, F]: pages that could be released
            resident = row.host_table[:selected.shape[1]] < 0
            self.stats["echo_selected_pages"] += int(selected.sum())
            self.stats["echo_resident_reads"] += int(selected[:, resident].sum())
            self._votes[row.seq_id] = reads.sum(axis=0)
