"""What the scheduler decides for one step, and what the model runner reports back: plain data.

`Scheduler.schedule()` returns a `SchedulerOutput`; the runner turns its rows into one padded
`StepInput`, runs the jitted step and returns a `RunnerOutput` whose arrays follow the order of
`SchedulerOutput.rows`; `Scheduler.update_from_output` commits it. Rows are snapshots: the runner
reads nothing else of the scheduler's state.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.memory.ops import KVOp
from kvjax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """One sequence's tokens to compute in a step (a decode token or a prefill chunk).

    Attributes:
      seq_id: the sequence.
      token_ids: [n] int32, the tokens whose K/V the step computes (n = 1 for decode).
      start: the logical (RoPE) position of token_ids[0].
      num_evicted: tokens before `start` a retention policy dropped from the cache; the row's
        cache slots are positions minus this.
      block_table: [num_pages] int32, the pages holding the sequence's cached tokens (of
        layer group 0 when the model has several).
      group_tables: [G-1, num_pages] int32, the other layer groups' tables, or None (G = 1).
      group_evicted: tokens before `start` each of those groups dropped, when table groups
        keep budgets of their own (`kvjax.kv.layer_retention`); (): num_evicted for each.
      score_weights: [n] float32, each query's weight in the retention policy's key scores.
      sampling, seed: how the row samples; counter: the index of the token it generates.
      seq_slot: the sequence's per-sequence state slot (KIVI windows), else 0.
      kv_floor: cache positions before it are read from the pages whatever the row's length
        (the fully quantized prefix-cache pages it started from; `WindowFloors.floor`).
      samples: the row computes the sequence's last pending token, so its sampled token is
        the sequence's next one.
      kv_epoch: the sequence's KV epoch when scheduled.
      feed_index: for a decode row whose token is still in flight, the index of the row that
        samples it in the previous step's rows (the runner feeds it on the device); else -1.
      num_drafts: a verify row's draft tokens (`kvjax.scheduler.spec`): token_ids[1:] are
        proposals the step checks; 0 for every other row.
      is_draft: a draft row: its sampled token is a proposal, not output, and the K/V it
        writes is overwritten by the verify step.
      read_table, read_len: the pages a draft row attends to and their token count (a subset
        of block_table); None: the row reads its whole block table.
      history: [start] int32, the sequence's tokens before `start`, for a row whose sampling
        penalizes repeats (`SamplingParams.reads_history`); else None.
      num_prompt_tokens: the sequence's prompt length (later positions are output).
      stop_ids: the tokens that would end the sequence (EOS unless ignored, and its stop
        tokens), for a row whose sampling masks them until `min_tokens`; else ().
      token_mask: [ceil(V / 32)] int32, the tokens a row with a grammar may sample
        (`kvjax.grammar`), built from the sequence's matcher after its last committed token;
        None: unconstrained.
      draft_masks: a constrained verify row's [num_drafts, ceil(V / 32)] int32: the mask after
        each draft token (`GrammarMatcher.masks`); None otherwise.
      host_table, host_len: a decode row's host-resident positions [0, host_len) and the
        host-pool pages holding them ([host_len / P] int32; `kvjax.engine.host_rows`); None
        and 0: all on the device. Under ECHO (`kvjax.engine.echo`) host_len is 0 and
        host_table has one entry per block-table entry: its host copy, or -1 (none).
      layer_tables: under ECHO, [L, n] int32 (or [1, n]: every layer alike): per layer and
        block-table entry, the device page holding that layer of the entry, or -1 (read its
        host copy; `kvjax.scheduler.echo`); else None.
      keep_frames, keep_owners, keep_offer: under ECHO with misses kept, [L, V] int32: per
        layer, the block-table entries of the frames the step may write its misses into
        (least wanted first, -1: padding) and the entries they hold (-1: unknown), and the
        offer's number (`kvjax.scheduler.echo`); else None, None, 0.
      kept_pages, kept_owners, kept_offer: under ECHO with misses kept, for a row whose
        previous step the host has not read back yet: [L, V] int32, the device pages of the
        frames offered to that step (offer `kept_offer`; -1: not to be read) and the entries
        they held (-1: unknown), where this step reads the pages that step kept, else the
        ones they held (`kvjax.engine.echo.merge_kept`); else None, None, 0.
      probe: a probe row (`RetentionPolicy.probes`, after the sequence's prefill): the index
        of the probe whose tokens it computes (from `start`, after the sequence's tokens);
        its K/V are given back once scored and only its key scores stay (samples is False);
        -1 for every other row.
      score_span: a probe row's `Probe.span` (the keys its scores' softmax runs over, with
        the policy's sinks and its own tokens); None: every key (every other row).
    """

    seq_id: str
    token_ids: np.ndarray
    start: int
    num_evicted: int
    block_table: np.ndarray
    score_weights: np.ndarray
    sampling: SamplingParams
    seed: int
    counter: int
    seq_slot: int = 0
    kv_floor: int = 0
    samples: bool = True
    kv_epoch: int = 0
    feed_index: int = -1
    num_drafts: int = 0
    is_draft: bool = False
    read_table: np.ndarray | None = None
    read_len: int = 0
    group_tables: np.ndarray | None = None
    history: np.ndarray | None = None
    num_prompt_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    token_mask: np.ndarray | None = None
    draft_masks: np.ndarray | None = None
    host_table: np.ndarray | None = None
    host_len: int = 0
    layer_tables: np.ndarray | None = None
    keep_frames: np.ndarray | None = None
    keep_owners: np.ndarray | None = None
    keep_offer: int = 0
    kept_pages: np.ndarray | None = None
    kept_owners: np.ndarray | None = None
    kept_offer: int = 0
    group_evicted: tuple[int, ...] = ()
    probe: int = -1
    score_span: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def group_cache_positions(self) -> np.ndarray:
        """[G-1, n] int32, where the row's tokens land in the other groups' caches."""
        evicted = self.group_evicted or (self.num_evicted,) * len(self.group_tables)
        return self.cache_positions[None] + self.num_evicted - np.asarray(
            evicted, np.int32)[:, None]

    @property
    def cache_positions(self) -> np.ndarray:
        """[n] int32, where the row's tokens land in the cache (position - num_evicted)."""
        return np.arange(self.start, self.start + self.num_tokens, dtype=np.int32) - \
            self.num_evicted


@dataclasses.dataclass(frozen=True)
class BlendRow:
    """A CacheBlend recompute the runner runs before the step (`kvjax.scheduler.context`).

    Attributes:
      seq_id: the sequence whose cache holds a chunk copied in without its context.
      token_ids: [n] int32, the chunk's tokens; start: the position of token_ids[0].
      block_table: [num_pages] int32, the sequence's pages (no retention: slots = positions).
      num_select: tokens of the chunk recomputed in every layer (those whose KV deviates most).
      ratio: the strategy's recompute ratio (the runner pads num_select to its share of the
        padded chunk, so each chunk size compiles once).
    """

    seq_id: str
    token_ids: np.ndarray
    start: int
    block_table: np.ndarray
    num_select: int
    ratio: float


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan.

    Attributes:
      decode: rows of one token each, highest ranked first.
      prefill: prefill chunks, in scheduling order.
      preempted: sequences preempted while forming this step.
      kv_ops: the KV operations (copies, swaps, loads, scrubs, compactions, spills) issued
        since the previous step was formed (the last step's compactions and frees, then this
        step's copies, swaps and loads), in order; records for metering and tracing.
      kv_plan: the KV operations the runner applies, in order, before this step's model:
        the copy-on-write copies, scrubs and chunk loads issued while the step was formed, as
        index arrays (`kvjax.memory.ops.DATA_KINDS`); the other ops of `kv_ops` were applied
        when issued.
      weights_version: the weights this step runs under (versions in flight take turns).
      blends: CacheBlend recomputes of chunks copied in this step, run before the step's rows.
    """

    decode: tuple[ScheduledRow, ...]
    prefill: tuple[ScheduledRow, ...]
    preempted: tuple[str, ...]
    kv_ops: tuple[KVOp, ...]
    weights_version: str
    blends: tuple[BlendRow, ...] = ()
    kv_plan: tuple[KVOp, ...] = ()

    @property
    def rows(self) -> tuple[ScheduledRow, ...]:
        return self.decode + self.prefill

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill and not self.blends

    @property
    def is_constrained(self) -> bool:
        """A row samples under a grammar: the next step's mask needs its token on the host."""
        return any(r.token_mask is not None for r in self.decode + self.prefill)


@dataclasses.dataclass(frozen=True)
class RunnerOutput:
    """What one step produced, per row of `SchedulerOutput.rows` (host arrays).

    Attributes:
      tokens: [R] int32, the token each row sampled; logprobs: [R] float32, its log-probability.
      key_scores: [R, W*P] float32 or None, the attention each row's cached tokens received
        (retention policies that score keys).
      logits: the step's logits as a device array (LogitsMode LAST: [padded R, V]; ALL:
        [padded T, V] in the step's token layout), else None.
      num_accepted: [R] int32 after a verify step: the draft tokens each row kept (`tokens`
        follows them); None for other steps (no row kept a draft).
      spec_logprobs: [R, 1 + gamma] float32 after a verify step: logprobs of the kept drafts,
        then of `tokens`; else None.
      query_key_scores: [R, 1 + gamma, W*P] float32 after a verify step with key scores: the
        scores each decode row's query gave alone, as its own decode step would (zeros for
        prefill rows); else None.
      tier_landed: the tier transfers whose data landed since the last output
        (`kvjax.memory.ops.TierLanded`: a spill's pages in host memory and checksums, a tier
        load's checksums on the device), for the tiers' ledger.
      page_reads: [Rd, L, W] bool after a one-token decode step of a policy that records its
        reads (Quest under ECHO, or with record_reads): the block-table entries each decode
        row (`SchedulerOutput.decode`) read in each layer; else None.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    key_scores: np.ndarray | None = None
    logits: object | None = None
    num_accepted: np.ndarray | None = None
    spec_logprobs: np.ndarray | None = None
    query_key_scores: np.ndarray | None = None
    page_reads: np.ndarray | None = None
    tier_landed: tuple = ()
