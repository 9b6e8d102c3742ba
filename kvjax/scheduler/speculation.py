"""The scheduler's speculative-decoding planner: whether a step drafts or verifies, how many
drafts a row checks, the draft rows, and what a verify row's result keeps
(`kvjax.scheduler.spec` holds the drafters)."""

from __future__ import annotations

import numpy as np

from kvjax.sampling_params import SamplingParams
from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.output import RunnerOutput, ScheduledRow
from kvjax.scheduler.request import Sequence
from kvjax.scheduler.spec import Drafter, NoDrafts

# Draft rows propose the draft's argmax: verification handles deterministic drafts.
_GREEDY_DRAFT = SamplingParams(max_new_tokens=1)


class SpeculativePlanner:
    """Plans the speculative part of each step for the scheduler.

    Attributes:
      drafter: where draft tokens come from (a host proposer, or the model's draft steps).
      config: the SchedulerConfig (`num_draft_tokens`, `adaptive_drafts`, length limits).
      stats: the engine's counters (`spec_*`).
    """

    def __init__(self, config: SchedulerConfig, kv_cache, drafter: Drafter | None,
                 stats: dict):
        self.config = config
        self.kv_cache = kv_cache
        self.drafter = drafter or NoDrafts()
        self.stats = stats

    def step_kind(self, decoding: list[Sequence], speculate: bool) -> tuple[bool, bool]:
        """(is_draft_step, verifies) of a step whose decode candidates are `decoding`: a draft
        step while some row still lacks drafts the model drafts, else a verify step (with
        speculation on; neither without)."""
        speculate = speculate and self.config.num_draft_tokens > 0
        is_draft_step = speculate and self.drafter.runs_draft_steps and any(
            len(s.draft_tokens) < self.max_drafts(s) for s in decoding)
        return is_draft_step, speculate and not is_draft_step

    def max_drafts(self, seq: Sequence) -> int:
        """Draft tokens the sequence may verify next: gamma, less near its length limits (the
        verify step emits one token beyond its drafts) and before a retention decision or a
        KIVI key group's aging. Under a grammar, the row ships a mask per draft
        (`GrammarMatcher.masks`)."""
        left = min(seq.sampling.max_new_tokens - len(seq.output_ids),
                   self.config.max_model_len - seq.num_tokens)
        gamma = self.config.num_draft_tokens
        if self.config.adaptive_drafts and seq.draft_len:
            gamma = min(gamma, seq.draft_len)
        num = max(0, min(gamma, left - 1))
        # A verify row reads what plain decoding would only while retention and KIVI's key
        # groups decide nothing before its last token (`KVCacheManager.max_verify_tokens`).
        return num and self.kv_cache.max_verify_tokens(seq.seq_id, seq.num_computed,
                                                       num + 1) - 1

    def propose(self, seq: Sequence, budget: int) -> None:
        """The drafts a verify row checks: a host drafter's proposals, or the draft steps'."""
        num = min(self.max_drafts(seq), budget)
        if not self.drafter.runs_draft_steps:
            seq.draft_tokens = self.drafter.propose(seq.tokens, num)
        del seq.draft_tokens[num:]

    def draft_row(self, seq: Sequence, index: int) -> ScheduledRow:
        """A draft step's row: the sequence's next unverified token at its position, reading
        the page subset the drafter chooses (every page under KIVI, whose exact window and key
        groups are addressed by cache position); it counts nothing as computed."""
        table = np.asarray(self.kv_cache.block_table(seq.seq_id), np.int32)
        evicted = self.kv_cache.retention.num_evicted(seq.seq_id)
        start = seq.num_computed + len(seq.draft_tokens)
        token = (seq.tokens + seq.draft_tokens)[start]
        cache_pos = start - evicted
        self.kv_cache.mark_written({int(table[cache_pos // self.config.page_size])},
                                   seq.weights_version)
        reads, read_len = self.drafter.draft_reads(table, cache_pos + 1, self.config.page_size)
        if self.kv_cache.keeps_windows:  # KIVI addresses its window and groups by position
            reads, read_len = table, cache_pos + 1
        return ScheduledRow(
            seq_id=seq.seq_id, token_ids=np.asarray([token], np.int32), start=start,
            num_evicted=evicted, block_table=table, score_weights=np.zeros(1, np.float32),
            sampling=_GREEDY_DRAFT, seed=seq.seed, counter=0,
            seq_slot=self.kv_cache.seq_slot(seq.seq_id),
            kv_floor=self.kv_cache.floors.floor(seq.seq_id), samples=False, kv_epoch=seq.kv_epoch,
            is_draft=True, read_table=np.asarray(reads, np.int32), read_len=int(read_len))

    def verified(self, seq: Sequence, row: ScheduledRow, out: RunnerOutput, i: int
                 ) -> tuple[list[int], list[float]]:
        """A verify row's result: the drafts it kept and the logprobs of those and of the
        model's next token; the sequence's next draft length follows (`adaptive_drafts`)."""
        k = 0 if out.num_accepted is None else int(out.num_accepted[i])
        kept = [int(t) for t in row.token_ids[1:1 + k]]
        logprobs = ([float(out.logprobs[i])] if out.spec_logprobs is None
                    else [float(x) for x in out.spec_logprobs[i, :k + 1]])
        self.stats["spec_accepted"] += k
        m = row.num_drafts
        seq.draft_len = min(m + 1, self.config.num_draft_tokens) if k == m else k + 1
        return kept, logprobs
