"""Retention applied to pages: a row's tokens observed by the retention policy, its decision
compacted into fewer pages (a COMPACT op per table), and how long a verify row may be."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvjax.kv.retention_host import RetentionManager, SeqLayout
from kvjax.memory.block_manager import AllocStatus
from kvjax.memory.floors import WindowFloors
from kvjax.memory.op_plan import OpPlan
from kvjax.memory.ops import KVOp, KVOpKind
from kvjax.memory.page_versions import PageVersions


class RetentionOps:
    """The KV cache manager's retention decisions, as page moves and COMPACT ops.

    Attributes:
      retention: the RetentionManager (which tokens each sequence keeps).
      allocator: the page allocator whose tables a compaction rewrites.

    Args:
      floors: the manager's `WindowFloors` (shared: a compaction resets a sequence's floor).
      scrub: zeroes freed device pages (with `scrub_freed_pages`).
    """

    def __init__(self, retention: RetentionManager, allocator, ops: OpPlan,
                 versions: PageVersions, *, floors: WindowFloors, scrub_freed_pages: bool,
                 scrub: Callable[[Sequence[int]], None]):
        self.retention = retention
        self.allocator = allocator
        self.ops = ops
        self.versions = versions
        self.floors = floors
        self.scrub_freed_pages = scrub_freed_pages
        self._scrub = scrub

    def retain(self, seq_id: str, start: int, num_new: int, key_scores: np.ndarray | None, *,
               is_prefill_done: bool, version: str) -> None:
        """Tells the retention policy about a row's computed tokens; compacts and frees what
        it drops."""
        if self.retention.is_exact:
            return
        self.retention.observe(seq_id, start, num_new, key_scores)
        self._retain_selected(seq_id, is_prefill_done=is_prefill_done, version=version)

    def retain_verified(self, seq_id: str, start: int, num_new: int,
                        query_scores: np.ndarray | None, *, version: str) -> None:
        """A verify row's accepted tokens (its first `num_new`), observed one at a time with
        their own queries' key scores (query_scores [>= num_new, W*P], or None when the policy
        scores nothing), then the policy's decision. The row was no longer than
        `max_verify_tokens`, so plain decoding's decisions after its earlier tokens keep
        everything, and this one decision is the one plain decoding makes after its last."""
        if self.retention.is_exact:
            return
        if query_scores is None:
            self.retention.observe(seq_id, start, num_new, None)
        else:
            self.retention.observe_each(seq_id, start, query_scores[:num_new])
        self._retain_selected(seq_id, is_prefill_done=True, version=version)

    def finish_probes(self, seq_id: str, *, version: str) -> None:
        """The sequence's probe rows are all scored (`kvjax.scheduler.probes`): the policy's
        decision, compacted."""
        self.retention.finish_probes(seq_id)
        self._retain_selected(seq_id, is_prefill_done=True, version=version)

    def max_verify_tokens(self, seq_id: str, num_computed: int, most: int) -> int:
        """The most tokens (at most `most`, at least 1) a verify row of `seq_id` starting at
        token `num_computed` may hold so that each of its queries reads what a plain decode
        step would: the retention policy decides nothing before its last token
        (`RetentionManager.max_verify_tokens`), and with an exact window beside the pages
        (KIVI) no key group ages inside it (a row that must age one has no drafts), so all its
        queries read the groups quantized that their own decode steps would, and no draft,
        nor a draft step's key, ever enters an aged group or overwrites a window row that a
        later aging reads."""
        limit = self.retention.max_verify_tokens(seq_id)
        most = most if limit is None else max(1, min(most, limit))
        if not self.floors.has_window:
            return most
        cached = num_computed - self.retention.num_evicted(seq_id)
        aged = self.floors.paged_len(seq_id, cached)
        n = 1
        while n < most and self.floors.paged_len(seq_id, cached + n + 1) == aged:
            n += 1
        return n

    def _retain_selected(self, seq_id: str, *, is_prefill_done: bool, version: str) -> None:
        keep = self.retention.select(seq_id, is_prefill_done=is_prefill_done)
        if keep is None:
            return
        if self.retention.num_tables > 1:
            self._retain_groups(seq_id, keep, is_prefill_done=is_prefill_done, version=version)
            return
        old_table = list(self.allocator.block_table(seq_id))
        status, src, dst, freed = self.allocator.retain(seq_id, keep)
        if status is not AllocStatus.OK:  # No page for a copy now: evict after a later step.
            return
        table = self.allocator.block_table(seq_id)
        layout = SeqLayout(old_table=old_table, new_table=list(table),
                           kv_floor=self.floors.pop(seq_id),
                           seq_slot=self.allocator.seq_slot(seq_id))
        plan = self.retention.evict(seq_id, keep, src, dst, len(freed),
                                    is_prefill_done=is_prefill_done, layout=layout)
        self.ops.issue(KVOp(KVOpKind.COMPACT, tuple(table), plan=plan))
        self.versions.mark_written(table, version)
        if freed and self.scrub_freed_pages:
            self._scrub(freed)

    def _retain_groups(self, seq_id: str, keeps: list[np.ndarray], *, is_prefill_done: bool,
                       version: str) -> None:
        """Table groups with budgets of their own (`kvjax.kv.layer_retention`): each keeps
        keeps[g], compacted by a COMPACT op of its own."""
        old_tables = [list(t) for t in self.allocator.block_tables(seq_id)]
        status, moves, freed = self.allocator.retain_groups(seq_id, keeps)
        if status is not AllocStatus.OK:  # No page for a copy now: evict after a later step.
            return
        tables = self.allocator.block_tables(seq_id)
        slot = self.allocator.seq_slot(seq_id)
        layouts = [SeqLayout(old_table=old, new_table=list(new), seq_slot=slot)
                   for old, new in zip(old_tables, tables, strict=True)]
        plans = self.retention.evict_groups(seq_id, keeps, moves, len(freed),
                                            is_prefill_done=is_prefill_done, layouts=layouts)
        for table, plan in zip(tables, plans, strict=True):
            self.ops.issue(KVOp(KVOpKind.COMPACT, tuple(table), plan=plan))
            self.versions.mark_written(table, version)
        if freed and self.scrub_freed_pages:
            self._scrub(freed)
