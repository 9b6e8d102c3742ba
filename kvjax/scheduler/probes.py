"""Probe rows: the tokens a retention policy runs after a sequence's prefill to score its
cached keys before it decodes (`RetentionPolicy.probes`; KVzip's context reconstruction).

A sequence probes when a row that completes its prefill (its tokens all computed, sampling its
next one) is formed and the policy has probes for its tokens. Until they are scored it forms no
decode row: each step gives it at most one probe row, a whole probe (a probe's scores are maxima
over its queries per layer and kv head, which rows of a part of its queries could not add up),
so probes are at most `probe_room` tokens: the step's token budget and prefill chunk, and the
context left. A probe's tokens sit at the positions after the sequence's tokens, on pages past
its cached length; the row's key scores go to the policy (`RetentionManager.observe_probe`), and
once the last row is committed those pages go back to the pool and the policy decides (a
compaction like any other). A preemption starts the probes over (`Probing.restart`); a
recompute forms new ones.
"""

from __future__ import annotations

import numpy as np

from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.output import ScheduledRow
from kvjax.scheduler.request import Probing, Sequence


def probe_room(num_tokens: int, *, max_model_len: int, max_prefill_chunk: int,
               max_num_batched_tokens: int) -> int:
    """The most tokens a probe row after `num_tokens` tokens may hold: one row of a step, in
    the context length."""
    return min(max_model_len - num_tokens, max_prefill_chunk, max_num_batched_tokens)


class ProbeRows:
    """Starts, schedules and commits sequences' probe rows.

    Attributes:
      kv_cache: the KVCacheManager (pages, the retention record).
      stats: the engine's counters (probe_rows, probe_tokens).
    """

    def __init__(self, config: SchedulerConfig, kv_cache, stats: dict):
        self.config = config
        self.kv_cache = kv_cache
        self.stats = stats
        self.stats.setdefault("probe_rows", 0)
        self.stats.setdefault("probe_tokens", 0)

    def start(self, seq: Sequence, num_tokens: int) -> None:
        """A row computing the sequence's tokens up to `num_tokens` (all of them) was formed:
        its probes, if the policy has any."""
        cfg = self.config
        room = probe_room(num_tokens, max_model_len=cfg.max_model_len,
                          max_prefill_chunk=cfg.max_prefill_chunk,
                          max_num_batched_tokens=cfg.max_num_batched_tokens)
        probes = self.kv_cache.retention.probes(seq.seq_id, seq.tokens[:num_tokens], room)
        seq.probing = Probing(probes, seq.kv_epoch) if probes else None

    def next_row(self, seq: Sequence, budget: int) -> int:
        """Tokens of the sequence's next probe row, its pages allocated; 0 when it has none to
        run now (all in flight), the step's `budget` is short of it, or the pool is."""
        probing = seq.probing
        if probing.epoch != seq.kv_epoch:
            probing.restart(seq.kv_epoch)
        if probing.is_dispatched:
            return 0
        n = len(probing.probes[probing.next].token_ids)
        cached = self.kv_cache.cached_len(seq.seq_id, seq.num_computed)
        return n if n <= budget and self.kv_cache.allocate(seq.seq_id, cached, cached + n) \
            else 0

    def dispatched(self, seq: Sequence) -> int:
        """The sequence's next probe row was formed: the index of its probe."""
        probing = seq.probing
        probing.next += 1
        probing.in_flight += 1
        self.stats["probe_rows"] += 1
        self.stats["probe_tokens"] += len(probing.probes[probing.next - 1].token_ids)
        return probing.next - 1

    def commit(self, seq: Sequence, row: ScheduledRow, key_scores: np.ndarray | None) -> None:
        """A probe row's results (the row is of the sequence's current KV epoch): its scores
        to the policy; after the last, the probe pages back to the pool and the decision."""
        probing = seq.probing
        if probing is None or probing.epoch != row.kv_epoch:
            return
        self.kv_cache.retention.observe_probe(seq.seq_id, probing.probes[row.probe],
                                              key_scores)
        probing.in_flight -= 1
        if probing.is_dispatched and not probing.in_flight:
            seq.probing = None
            self.kv_cache.truncate(seq.seq_id,
                                   self.kv_cache.cached_len(seq.seq_id, seq.num_computed))
            self.kv_cache.finish_probes(seq.seq_id, version=seq.weights_version)
