"""The rows of a step: a scheduled sequence's snapshot as the runner reads it (`ScheduledRow`),
its grammar masks, and prefill chunks cut to end on a padded bucket."""

from __future__ import annotations

import numpy as np

from kvjax import grammar as grammar_lib
from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.output import ScheduledRow
from kvjax.scheduler.request import Sequence


class RowBuilder:
    """Turns the scheduler's choices into `ScheduledRow`s.

    Attributes:
      config: the SchedulerConfig (page size, prefill buckets, EOS ids).
      kv_cache: the KVCacheManager the rows' tables and retention weights come from.
      stats: the engine's counters (tokens dispatched, verify rows).
    """

    def __init__(self, config: SchedulerConfig, kv_cache, stats: dict):
        self.config = config
        self.kv_cache = kv_cache
        self.stats = stats

    def fit_to_bucket(self, total: int, chunk: int) -> int:
        """`chunk` tokens more after `total` prefill tokens, cut to end on a prefill bucket
        inside the chunk when padding up to the next bucket would exceed the configured
        fraction of it."""
        limit, buckets = self.config.prefill_padding_limit, self.config.prefill_buckets
        end = total + chunk
        up = min((b for b in buckets if b >= end), default=end)
        if limit is None or up - end <= limit * up:
            return chunk
        down = max((b for b in buckets if total < b <= end), default=end)
        return down - total

    @staticmethod
    def grammar_masks(rows: list[tuple[Sequence, int, int]]) -> dict[str, np.ndarray]:
        """The token masks of the step's rows that sample under a grammar, by sequence id:
        (sequence, tokens, drafts) per row, filled together (`kvjax.grammar.fill_masks`: in
        parallel when several rows are constrained), each before and after its drafts."""
        wanted = [(seq, seq.draft_tokens[:num_drafts]) for seq, n, num_drafts in rows
                  if seq.grammar is not None and n - num_drafts == seq.num_pending]
        filled = grammar_lib.fill_masks([(seq.grammar, drafts) for seq, drafts in wanted])
        return {seq.seq_id: m for (seq, _), m in zip(wanted, filled, strict=True)}

    def _tables(self, seq: Sequence, pos: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray | None, int, tuple[int, ...]]:
        """The sequence's block table(s) and evicted counts for a row writing logical
        positions `pos`; the pages it writes are recorded as written by its weights version."""
        table, group_tables = self.kv_cache.row_tables(seq.seq_id)
        evicted = self.kv_cache.retention.num_evicted(seq.seq_id)
        written = table[(pos - evicted) // self.config.page_size]
        group_evicted = self.kv_cache.retention.group_evicted(seq.seq_id)
        if group_tables is not None:
            gpos = pos[None] - np.asarray(group_evicted or (evicted,) * len(group_tables),
                                          np.int32)[:, None]  # [G-1, n]
            written = np.concatenate([written, np.take_along_axis(
                group_tables, gpos // self.config.page_size, axis=1).ravel()])
        self.kv_cache.mark_written(set(written.tolist()), seq.weights_version)
        return table, group_tables, evicted, group_evicted

    def probe_row(self, seq: Sequence, probe: int) -> ScheduledRow:
        """A probe row (`kvjax.scheduler.probes`): the tokens of the sequence's probe `probe`,
        after its computed tokens, every query scoring the keys; it samples nothing."""
        spec = seq.probing.probes[probe]
        token_ids = np.asarray(spec.token_ids, np.int32)
        start, n = seq.num_computed, len(token_ids)
        table, group_tables, evicted, group_evicted = self._tables(
            seq, np.arange(start, start + n, dtype=np.int32))
        self.stats["prefill_tokens"] += n
        return ScheduledRow(
            seq_id=seq.seq_id, token_ids=token_ids, start=start, num_evicted=evicted,
            block_table=table, group_tables=group_tables, group_evicted=group_evicted,
            score_weights=np.ones(n, np.float32), sampling=seq.sampling, seed=seq.seed,
            counter=seq.num_tokens - seq.num_prompt_tokens,
            seq_slot=self.kv_cache.seq_slot(seq.seq_id),
            kv_floor=self.kv_cache.floors.floor(seq.seq_id), samples=False,
            kv_epoch=seq.kv_epoch, num_prompt_tokens=seq.num_prompt_tokens, probe=probe,
            score_span=spec.span,
            history=np.asarray(seq.tokens[:seq.num_computed], np.int32)
            if seq.sampling.reads_history else None)

    def row(self, seq: Sequence, n: int, index: int, num_drafts: int = 0,
             masks: np.ndarray | None = None) -> ScheduledRow:
        """The row's snapshot; the sequence counts its tokens as computed from now on, and its
        pages are recorded as written by its weights version. A verify row's last
        `num_drafts` tokens are the sequence's draft tokens; `masks`, a sampling row's
        grammar masks before and after them (`grammar_masks`)."""
        start = seq.num_computed
        pos = np.arange(start, start + n, dtype=np.int32)
        table, group_tables, evicted, group_evicted = self._tables(seq, pos)
        if seq.num_unresolved:  # Its one token comes from the previous step, on the device.
            token_ids, feed_index = np.zeros(n, np.int32), seq.inflight_index
        else:
            token_ids = np.asarray(seq.tokens[start:start + n - num_drafts]
                                   + seq.draft_tokens[:num_drafts], np.int32)
            feed_index = -1
        samples = n - num_drafts == seq.num_pending
        host_table = self.kv_cache.host_table(seq.seq_id)
        row = ScheduledRow(
            seq_id=seq.seq_id, token_ids=token_ids, start=start, num_evicted=evicted,
            host_table=host_table if len(host_table) else None,
            host_len=len(host_table) * self.config.page_size,
            block_table=table, group_tables=group_tables, group_evicted=group_evicted,
            score_weights=self.kv_cache.retention.verify_score_weights(seq.seq_id, pos)
            if num_drafts else self.kv_cache.retention.score_weights(seq.seq_id, pos,
                                                                     seq.num_tokens),
            sampling=seq.sampling, seed=seq.seed, counter=seq.num_tokens - seq.num_prompt_tokens,
            seq_slot=self.kv_cache.seq_slot(seq.seq_id),
            kv_floor=self.kv_cache.floors.floor(seq.seq_id), samples=samples,
            kv_epoch=seq.kv_epoch, feed_index=feed_index, num_drafts=num_drafts,
            history=np.asarray(seq.tokens[:start], np.int32)
            if seq.sampling.reads_history else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            stop_ids=seq.sampling.stop_ids(self.config.eos_token_ids)
            if seq.sampling.min_tokens else (),
            token_mask=None if masks is None else masks[0],
            draft_masks=masks[1:] if masks is not None and num_drafts else None)
        seq.draft_tokens = []  # Checked by this row (verified or not, they are spent).
        seq.num_computed += n
        if num_drafts:
            self.stats["spec_verify_rows"] += 1
            self.stats["spec_proposed"] += num_drafts
        # Counted when dispatched: the device computes them whatever happens to the sequence.
        is_decode = n - num_drafts == 1 and samples and start >= seq.num_prompt_tokens
        self.stats["decode_tokens" if is_decode else "prefill_tokens"] += n
        if seq.is_chunk_fill:
            self.stats["chunk_fill_tokens"] += n
        if samples and not seq.is_prefill_only:
            seq.num_unresolved += 1
            seq.inflight_index = index
        return row
