"""A step's results committed: sampled tokens, verified drafts, prefix-cache pages, retention
decisions, forks of shared prompts, stop checks and finished outputs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvjax.scheduler.keys import CacheKeys
from kvjax.scheduler.output import RunnerOutput, ScheduledRow, SchedulerOutput
from kvjax.scheduler.policies import SchedulingPolicy
from kvjax.scheduler.probes import ProbeRows
from kvjax.scheduler.request import FinishReason, SeqStatus, Sequence
from kvjax.scheduler.requests import RequestTable
from kvjax.scheduler.speculation import SpeculativePlanner
from kvjax.scheduler.tenants import TenantShares


class StepCommitter:
    """Applies a `RunnerOutput` to the sequences of the step it ran.

    Attributes:
      kv_cache: the KVCacheManager committing pages and applying retention.
      table: the RequestTable of the sequences.
    """

    def __init__(self, kv_cache, table: RequestTable, *, keys: CacheKeys,
                 spec: SpeculativePlanner, tenants: TenantShares, policy: SchedulingPolicy,
                 probes: ProbeRows, stats: dict, clock: Callable[[], float]):
        self.kv_cache = kv_cache
        self.table = table
        self.keys = keys
        self.spec = spec
        self.tenants = tenants
        self.policy = policy
        self.probes = probes
        self.stats = stats
        self._clock = clock

    def commit(self, so: SchedulerOutput, out: RunnerOutput) -> None:
        """Commits a step's rows (see `Scheduler.update_from_output`)."""
        now = self._clock()
        for i, row in enumerate(so.rows):
            seq = self.table.find(row.seq_id)
            if seq is None or seq.status is SeqStatus.FINISHED:
                continue
            is_current = row.kv_epoch == seq.kv_epoch and seq.status is SeqStatus.RUNNING
            if row.is_draft:
                if is_current:
                    seq.draft_tokens.append(int(out.tokens[i]))
                continue
            if row.num_drafts:
                self._commit_verified(seq, row, out, i, now, is_current, so.weights_version)
                continue
            if row.probe >= 0:
                if is_current:
                    self.probes.commit(seq, row, out.key_scores[i])
                continue
            if is_current:
                self._commit_kv(seq, row, None if out.key_scores is None else out.key_scores[i])
            if not row.samples:
                continue
            if seq.is_group_prefill:
                if is_current:
                    self.table.fork_group(seq)
                continue
            if seq.is_chunk_fill:  # Its pages are in the chunk cache now: it is done.
                if is_current:
                    self.table.finish(seq, FinishReason.STOP)
                continue
            seq.num_unresolved -= 1
            seq.tokens.append(int(out.tokens[i]))
            seq.token_versions.append(so.weights_version)
            seq.logprobs.append(float(out.logprobs[i]))
            seq.token_times.append(now)
            self.table.check_stop(seq)
        for request_id in {row.seq_id.rsplit("#", 1)[0] for row in so.rows}:
            if self.table.has_request(request_id):
                self.table.maybe_emit(request_id)
        self.stats["steps"] += not so.is_empty  # an idle step only brings tier landings

    def _commit_verified(self, seq: Sequence, row: ScheduledRow, out: RunnerOutput, i: int,
                         now: float, is_current: bool, version: str) -> None:
        """A verify row: its kept drafts and the model's next token are output; the rejected
        drafts' cache positions are rolled back (pages past them freed) before anything of
        the row reaches the prefix cache."""
        kept, logprobs = self.spec.verified(seq, row, out, i)
        k = len(kept)
        if is_current:
            seq.num_computed = row.start + 1 + k
            held = self.kv_cache.cached_len(seq.seq_id, seq.num_computed)
            self.kv_cache.truncate(seq.seq_id, held)
            self._commit_kv(seq, row, None, tokens=seq.tokens + kept, num_new=1 + k,
                            query_scores=None if out.query_key_scores is None
                            else out.query_key_scores[i])
        seq.num_unresolved -= 1
        for token, logprob in zip([*kept, int(out.tokens[i])], logprobs, strict=True):
            seq.tokens.append(token)
            seq.token_versions.append(version)
            seq.logprobs.append(logprob)
            seq.token_times.append(now)
            self.table.check_stop(seq)
            if seq.status is SeqStatus.FINISHED:
                break

    def _commit_kv(self, seq: Sequence, row: ScheduledRow, key_scores: np.ndarray | None, *,
                   tokens: list[int] | None = None, num_new: int | None = None,
                   query_scores: np.ndarray | None = None) -> None:
        """A row's tokens are computed: full pages to the prefix cache, retention decisions.

        tokens: the sequence's tokens the KV holds (default seq.tokens); num_new: tokens of
        the row that stay computed (default all of them); query_scores: a verify row's
        [1 + gamma, W*P] key scores of each of its queries alone (`retain_verified`)."""
        n = row.num_tokens if num_new is None else num_new
        tokens = seq.tokens if tokens is None else tokens
        self.kv_cache.commit(seq.seq_id, tokens[:min(seq.num_computed, len(tokens))])
        if row.start < seq.num_prompt_tokens:  # a prefill chunk
            self.keys.pay_for_pages(seq)
        self.policy.on_tokens(seq, n)
        self.tenants.on_tokens(seq, n)
        if row.num_drafts:
            self.kv_cache.retain_verified(seq.seq_id, row.start, n, query_scores,
                                          version=seq.weights_version)
            return
        self.kv_cache.retain(seq.seq_id, row.start, n, key_scores, is_prefill_done=row.samples,
                             version=seq.weights_version)
