"""The model runner: owner of the device KV pool and the params, and of the one jitted step.

It turns a `SchedulerOutput` into one padded `StepInput` (shapes bucketed so each bucket
compiles once), runs the step under the weights version the scheduler chose, and returns the
sampled tokens as a `RunnerOutput` in row order. The step's plan of KV operations
(`SchedulerOutput.kv_plan`: copy-on-write copies, scrubs, window copies, chunk loads, swaps
out to host memory and back in) is
applied first, from its index arrays (`apply_ops`), and so are the compactions a commit plans;
every other change to the pool arrives as a `KVOp` through `apply` (it is the `KVDevice` of the
KV cache manager). Observers see each step and each KV op (metering, logits taps, tracing)
without replacing any part.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from kvjax.engine.host_rows import HostPool
from kvjax.engine.step import (
    BlendShape,
    LogitsMode,
    StepOutput,
    StepPrograms,
    StepShape,
    empty_step_input,
)
from kvjax.memory.ops import KVOp, KVOpKind
from kvjax.sampling import SamplingParams
from kvjax.scheduler.context import blend_count
from kvjax.scheduler.output import BlendRow, RunnerOutput, SchedulerOutput
from kvjax.shapes import bucket, geometric_buckets


class StepObserver:
    """Hooks called by the runner; subclass and override what you need (all no-ops here)."""

    def before_step(self, shape: StepShape, host_input: dict[str, np.ndarray]) -> None:
        """A step is about to be dispatched with these padded host inputs."""

    def after_step(self, shape: StepShape, host_input: dict[str, np.ndarray],
                   out: StepOutput) -> None:
        """A step was dispatched; `out` holds its device arrays."""

    def on_kv_op(self, op: KVOp) -> None:
        """A KV operation was applied to the pool."""


class KVStore(Protocol):
    """Where a runner keeps its device KV state between operations."""

    def get(self) -> Any:
        """The current state."""

    def set(self, kv: Any) -> None:
        """Replaces the state (the old buffers were donated)."""


class OwnKV:
    """A runner's own KV state (engines that share an arena keep theirs in the arena)."""

    def __init__(self):
        self.kv = None

    def get(self) -> Any:
        return self.kv

    def set(self, kv: Any) -> None:
        self.kv = kv


@dataclasses.dataclass(frozen=True)
class StepBuckets:
    """The padded sizes of a step: decode rows, prefill rows and prefill tokens.

    Prefill rows are packed (`kvjax.kv.layout`), so a step pads their total token count, not
    each row: to one of `prefill_buckets` (min_chunk_bucket times powers of
    chunk_bucket_factor), up to the most one row takes (max_prefill_chunk) with one prefill
    row, up to the most the rows together take with more.

    Attributes:
      max_num_seqs, max_prefill_seqs, max_prefill_chunk, min_chunk_bucket: as in EngineConfig.
      block_table_width: W, the fixed block-table width.
      max_num_batched_tokens, chunk_bucket_factor: as in EngineConfig.
      spec_width: tokens per decode row of a speculative verify step (1 + gamma); 1: no
        speculative decoding. Steps whose decode rows verify drafts take that width, the
        others 1, so warm-up compiles both.
      history_width, bias_width: H and Kb of a step whose rows have penalties, a logit bias
        or min_tokens (`StepShape`): the context length, and the most bias entries a row has
        (`rules_entries`).
      mask_width: Wm, the words of every row's token bitmask (`StepShape`), ceil(V / 32);
        0: steps take no masks.
    """

    max_num_seqs: int
    max_prefill_seqs: int
    max_prefill_chunk: int
    min_chunk_bucket: int
    block_table_width: int
    max_num_batched_tokens: int = 1 << 30
    chunk_bucket_factor: int = 4
    spec_width: int = 1
    history_width: int = 0
    bias_width: int = 0
    mask_width: int = 0

    def decode_buckets(self, *, mixed: bool) -> list[int]:
        """Padded decode-row counts: powers of two alone, powers of four beside a prefill."""
        sizes = geometric_buckets(1, bucket(self.max_num_seqs), 4 if mixed else 2)
        return ([0] if mixed else []) + sizes

    @property
    def row_chunk(self) -> int:
        """The most tokens one prefill row has, padded: the width of its attention view."""
        return bucket(self.max_prefill_chunk)

    def prefill_rows(self) -> list[int]:
        """Padded prefill-row counts: one sequence, or the most allowed."""
        return sorted({1, self.max_prefill_seqs})

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """Every padded prefill-token total (the scheduler may cut chunks to end on one)."""
        most = self.max_prefill_chunk
        if self.max_prefill_seqs > 1:
            most = min(most * self.max_prefill_seqs, self.max_num_batched_tokens)
        sizes = geometric_buckets(self.min_chunk_bucket, bucket(most), self.chunk_bucket_factor)
        return tuple(sorted({*sizes, min(self.row_chunk, bucket(most))}))

    def chunk_buckets(self, num_prefill: int = 1) -> list[int]:
        """Padded prefill-token totals of a step with `num_prefill` (padded) prefill rows."""
        if num_prefill > 1:
            return list(self.prefill_buckets)
        return [c for c in self.prefill_buckets if c <= self.row_chunk]

    def decode_widths(self, logits_mode: LogitsMode = LogitsMode.NONE) -> list[int]:
        """Tokens per decode row a step may have: 1, and the verify width with speculation
        (verify steps return no logits: the scheduler plans no drafts for steps that do)."""
        return sorted({1, self.spec_width if logits_mode is LogitsMode.NONE else 1})

    def _prefill_shape(self, bd: int, bp: int, chunk: int, **fields) -> StepShape:
        row_chunk = chunk if bp == 1 else min(chunk, self.row_chunk)
        return StepShape(bd, bp, chunk, self.block_table_width, feed_rows=self.feed_rows,
                         row_chunk=row_chunk, mask_width=self.mask_width, **fields)

    @property
    def feed_rows(self) -> int:
        """F: the most rows a step has, the width of the token feed between steps."""
        return bucket(self.max_num_seqs) + self.max_prefill_seqs

    def step_shapes(self, logits_mode: LogitsMode = LogitsMode.NONE) -> list[StepShape]:
        """Every greedy step shape: what warm-up compiles."""
        width, feed = self.block_table_width, self.feed_rows
        shapes = [StepShape(bd, 0, 1, width, logits_mode=logits_mode, feed_rows=feed,
                            decode_width=wd, mask_width=self.mask_width)
                  for wd in self.decode_widths(logits_mode)
                  for bd in self.decode_buckets(mixed=False)]
        shapes += [self._prefill_shape(bd, bp, c, logits_mode=logits_mode, decode_width=wd)
                   for wd in self.decode_widths(logits_mode)
                   for bd in self.decode_buckets(mixed=True)
                   for bp in self.prefill_rows() for c in self.chunk_buckets(bp)
                   if bd or wd == 1]
        return shapes

    @property
    def rules_variant(self) -> dict:
        """The StepShape fields of a step with rules: one variant per shape, sampled and
        filtered (greedy rows take the argmax of their processed logits in it)."""
        return dict(all_greedy=False, needs_filter=True, history_width=self.history_width,
                    bias_width=self.bias_width)

    def shape_for(self, so: SchedulerOutput, logits_mode: LogitsMode) -> StepShape:
        """The bucketed shape that holds this step's rows."""
        num_decode, prefill = len(so.decode), so.prefill
        mixed = bool(prefill)
        bd = min(b for b in self.decode_buckets(mixed=mixed) if b >= num_decode)
        sampling = [r.sampling for r in so.rows]
        verifies = any(r.num_tokens > 1 for r in so.decode)
        fields = dict(all_greedy=all(p.is_greedy for p in sampling),
                      needs_filter=any(p.needs_filter for p in sampling),
                      logits_mode=logits_mode,
                      decode_width=self.spec_width if verifies else 1)
        if any(p.needs_rules for p in sampling):
            fields.update(self.rules_variant)
        if not mixed:
            return StepShape(num_decode=bd, num_prefill=0, chunk=1,
                             max_pages=self.block_table_width, feed_rows=self.feed_rows,
                             mask_width=self.mask_width, **fields)
        # Prefill rows come in two sizes only (one sequence, or the most allowed), which keeps
        # the number of step shapes small enough to compile them all during warm-up.
        bp = 1 if len(prefill) == 1 else self.max_prefill_seqs
        total = sum(r.num_tokens for r in prefill)
        chunk = min(c for c in self.chunk_buckets(bp) if c >= total)
        return self._prefill_shape(bd, bp, chunk, **fields)


def rules_entries(p: SamplingParams, stop_ids: tuple[int, ...]) -> int:
    """The bias entries a request takes: its logit bias, and with min_tokens its stop ids."""
    return len(p.logit_bias) + (len(stop_ids) if p.min_tokens else 0)


@functools.lru_cache(maxsize=1024)
def _bias_entries(p: SamplingParams, stop_ids: tuple[int, ...]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A request's (ids, values, until) bias entries: its logit bias for every token, and
    -inf on `stop_ids` while fewer than min_tokens are generated."""
    always = np.iinfo(np.int32).max
    ids = [t for t, _ in p.logit_bias] + list(stop_ids)
    values = [b for _, b in p.logit_bias] + [-np.inf] * len(stop_ids)
    until = [always] * len(p.logit_bias) + [p.min_tokens] * len(stop_ids)
    return (np.asarray(ids, np.int32), np.asarray(values, np.float32),
            np.asarray(until, np.int32))


def _fill_rules(buf: dict[str, np.ndarray], r: int, row) -> None:
    """Writes row `r`'s penalties, token history and bias entries."""
    p = row.sampling
    buf["presence"][r] = p.presence_penalty
    buf["frequency"][r] = p.frequency_penalty
    buf["repetition"][r] = p.repetition_penalty
    buf["num_prompt"][r] = row.num_prompt_tokens
    if row.history is not None:
        n = len(row.history)
        buf["history"][r, :n] = row.history
        buf["history_lens"][r] = n
    ids, values, until = _bias_entries(p, row.stop_ids)
    k = len(ids)
    buf["bias_ids"][r, :k], buf["bias_values"][r, :k], buf["bias_until"][r, :k] = \
        ids, values, until


@dataclasses.dataclass(frozen=True)
class InFlightStep:
    """A dispatched step whose results the host has not read yet."""

    so: SchedulerOutput
    row_index: list[int]  # padded row of each of so.rows
    out: StepOutput | None  # None: the step had no rows (only CacheBlend recomputes)


class ModelRunner:
    """Holds the device KV state and the params of every weights version still served.

    Attributes:
      programs: the jitted step programs (shareable between runners of one configuration).
      buckets: the StepBuckets shapes are padded to.
      kv: the device KV pytree (donated to each step), kept in a `KVStore`.
      params: weights version -> params.
      kv_programs: `KVOpKind` -> program(state, op) -> state, for each kind of
        `kvjax.memory.ops.DATA_KINDS`: how the runner applies ops given as data (the engine
        registers the swap, scrub and window-copy programs of its swap space, the compaction
        program of its retention policy and the chunk copy of context reuse).
      host_pool: the host pool of host-resident rows (`kvjax.engine.host_rows.HostPool`; it
        applies `KVOpKind.HOST_OUT` and `HOST_IN`), or None.
    """

    def __init__(self, programs: StepPrograms, buckets: StepBuckets, kv: Any, params: Any,
                 weights_version: str, *, page_size: int, kv_store: KVStore | None = None,
                 num_tables: int = 1):
        self.programs = programs
        self.num_tables = num_tables
        self.buckets = buckets
        self._store = OwnKV() if kv_store is None else kv_store
        self.kv = kv
        self.params = {weights_version: params}
        self.page_size = page_size
        self.observers: list[StepObserver] = []
        # The token feed between steps: the last step's sampled tokens, on the device. It
        # starts (and restarts) as committed zeros: jit caches committed and uncommitted inputs
        # apart, and every step output is committed.
        device = jax.tree.leaves(kv)[0].addressable_shards[0].device  # This process's own.
        self._zero_feed = jax.device_put(np.zeros(buckets.feed_rows, np.int32),
                                         jax.sharding.SingleDeviceSharding(device))
        self._feed = self._zero_feed
        self._kept_feed = None  # ECHO's kept misses, the same way (`StepOutput.kept_feed`)
        self._last_row_index: list[int] = []
        self.host_pool: HostPool | None = None
        self.tier_transfers = None  # kvjax.memory.tiers.TierTransfers with tiers on
        self.kv_programs: dict[KVOpKind, Callable[[Any, KVOp], Any]] = {
            KVOpKind.COPY: lambda kv, op: programs.copy_pages(
                kv, np.asarray(op.src, np.int32), np.asarray(op.dst, np.int32)),
            KVOpKind.DEMOTE: lambda kv, op: programs.demote(
                kv, np.asarray(op.dst, np.int32), op.bits, op.v_bits),
            KVOpKind.HOST_OUT: self._host_out,
            KVOpKind.HOST_IN: self._host_in}

    @property
    def kv(self) -> Any:
        return self._store.get()

    @kv.setter
    def kv(self, kv: Any) -> None:
        self._store.set(kv)

    @property
    def num_compiles(self) -> int:
        host = 0 if self.host_pool is None else self.host_pool.num_compiles
        tiers = 0 if self.tier_transfers is None else self.tier_transfers.num_compiles
        return self.programs.num_compiles + host + tiers

    @property
    def num_tier_transfers(self) -> int:
        """Tier transfers in flight (issued, not yet reported, scattered or released)."""
        return 0 if self.tier_transfers is None else self.tier_transfers.num_inflight

    def tier_landed(self, *, wait: bool = False) -> tuple:
        """The tier transfers that landed since the last report (every one in flight, once
        landed, with `wait`), as `TierLanded` reports for the scheduler."""
        return () if self.tier_transfers is None else self.tier_transfers.report(wait=wait)

    def idle_output(self) -> RunnerOutput:
        """The output of a step with no rows: the tier transfers in flight, once landed."""
        return RunnerOutput(tokens=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32),
                            tier_landed=self.tier_landed(wait=True))

    @property
    def host_kv(self) -> Any:
        """The host pool's KV state, or None without one."""
        return None if self.host_pool is None else self.host_pool.kv

    def _host_out(self, kv: Any, op: KVOp) -> Any:
        self.host_pool.move_out(kv, op.src, op.dst)
        return kv

    def _host_in(self, kv: Any, op: KVOp) -> Any:
        if op.layers:
            return self.host_pool.move_in_layers(kv, op.layers, op.src, op.dst)
        return self.host_pool.move_in(kv, op.src, op.dst)

    def _empty_input(self, shape: StepShape) -> dict[str, np.ndarray]:
        pool = self.host_pool
        return empty_step_input(shape, self.num_tables, host_rows=pool is not None,
                                num_layer_tables=0 if pool is None else pool.num_layer_tables,
                                keep_width=0 if pool is None else pool.keep_width)

    # ----------------------------------------------------------------------------- KV ops

    def apply(self, op: KVOp, fn: Callable[[Any], Any]) -> None:
        self.kv = fn(self.kv)
        for observer in self.observers:
            observer.on_kv_op(op)

    def apply_ops(self, ops: Sequence[KVOp]) -> None:
        """Applies KV operations given as data (`DATA_KINDS`), in order."""
        for op in ops:
            self.kv = self.kv_programs[op.kind](self.kv, op)
            for observer in self.observers:
                observer.on_kv_op(op)

    def run_op(self, kv: Any, op: KVOp) -> Any:
        return self.kv_programs[op.kind](kv, op)

    # ----------------------------------------------------------------------------- params

    def add_params(self, version: str, params: Any) -> None:
        self.params[version] = params

    def move_params(self, sharding: jax.sharding.Sharding) -> int:
        """Moves the params of every version to `sharding` (e.g. host memory and back);
        returns the bytes moved."""
        self.params = {v: jax.device_put(p, sharding) for v, p in self.params.items()}
        return sum(x.nbytes for p in self.params.values() for x in jax.tree.leaves(p))

    def keep_params(self, versions) -> None:
        """Releases the params of every version not in `versions`."""
        for version in [v for v in self.params if v not in versions]:
            del self.params[version]

    # ----------------------------------------------------------------------------- the step

    def build_input(self, so: SchedulerOutput, logits_mode: LogitsMode = LogitsMode.NONE
                    ) -> tuple[StepShape, dict[str, np.ndarray], list[int]]:
        """The padded host inputs of a step; returns (shape, buffers, padded row per row).

        A row whose token is still in flight (feed_index >= 0) reads it from the previous
        step's feed on the device, at that row's padded index.
        """
        shape = self.buckets.shape_for(so, logits_mode)
        buf = self._empty_input(shape)
        bd, num_decode, wd = shape.num_decode, len(so.decode), shape.decode_width
        row_index = []
        t0 = bd * wd  # the next prefill row's first token: prefill rows are packed
        for i, row in enumerate(so.rows):
            n = row.num_tokens
            if i < num_decode:
                r, start = i, i * wd
            else:
                r, start = bd + (i - num_decode), t0
                t0 += n
                buf["row_starts"][r] = start
                buf["token_rows"][start:] = r  # padding after the last row belongs to it
            self._fill_row(buf, r, start, row, shape)
            row_index.append(r)
        buf["prev_tokens"] = self._feed
        if buf["kept_feed"].size:
            buf["kept_feed"] = self._zero_kept() if self._kept_feed is None else self._kept_feed
        return shape, buf, row_index

    def _zero_kept(self) -> jax.Array:
        """A kept-misses feed in which nothing was kept, committed like the token feed."""
        pool, rows = self.host_pool, self.buckets.feed_rows
        return jax.device_put(np.full((rows, pool.num_layer_tables, pool.keep_width), -1,
                                      np.int32), self._zero_feed.sharding)

    def _fill_row(self, buf: dict[str, np.ndarray], r: int, t0: int, row, shape: StepShape
                  ) -> None:
        """Writes row `r` (its tokens from index t0) into the step's host buffers."""
        page_size = self.page_size
        n = row.num_tokens
        table = row.block_table
        cpos = row.cache_positions  # Retention: RoPE positions are logical, slots cached.
        buf["tokens"][t0:t0 + n] = row.token_ids
        buf["positions"][t0:t0 + n] = np.arange(row.start, row.start + n, dtype=np.int32)
        buf["slot_mapping"][t0:t0 + n] = table[cpos // page_size] * page_size + \
            cpos % page_size
        if row.group_tables is not None:  # the other layer groups' pages of the same tokens
            groups, gpos = row.group_tables, row.group_cache_positions  # gpos: [G-1, n]
            buf["group_slots"][:, t0:t0 + n] = np.take_along_axis(
                groups, gpos // page_size, axis=1) * page_size + gpos % page_size
            width = min(groups.shape[1], shape.max_pages)
            buf["group_tables"][:, r, :width] = groups[:, :width]
        buf["score_weights"][t0:t0 + n] = row.score_weights
        if row.score_span is not None:
            buf["score_spans"][r] = row.score_span
        reads, kv_len = (table, cpos[-1] + 1) if row.read_table is None else \
            (row.read_table, row.read_len)  # a draft row reads a subset of its pages
        width = min(len(reads), shape.max_pages)
        buf["block_tables"][r, :width] = reads[:width]
        buf["kv_lens"][r] = kv_len
        # A group's length differs only where table groups keep budgets of their own.
        buf["group_kv_lens"][:, r] = kv_len if row.group_tables is None or \
            row.read_table is not None else row.group_cache_positions[:, -1] + 1
        buf["q_lens"][r] = n
        p = row.sampling
        buf["temperature"][r] = p.temperature
        buf["top_k"][r] = p.top_k
        buf["top_p"][r] = p.top_p
        buf["min_p"][r] = p.min_p
        buf["seeds"][r] = row.seed
        buf["counters"][r] = row.counter
        if shape.has_rules:
            _fill_rules(buf, r, row)
        if row.token_mask is not None:
            buf["token_mask"][r] = row.token_mask
        if row.draft_masks is not None:
            buf["draft_mask"][r, :len(row.draft_masks)] = row.draft_masks
        buf["seq_slots"][r] = row.seq_slot
        buf["kv_floors"][r] = row.kv_floor
        if row.feed_index >= 0:
            buf["token_src"][t0] = self._last_row_index[row.feed_index]
        if row.host_table is not None:
            if r >= shape.num_decode or self.host_pool is None:
                raise ValueError(f"row {row.seq_id!r} has host-resident pages but is not a "
                                 f"decode row of an engine with a host pool")
            buf["host_tables"][r, :len(row.host_table)] = row.host_table
            if row.layer_tables is not None:
                buf["layer_tables"][r, :, :row.layer_tables.shape[1]] = row.layer_tables
            if row.keep_frames is not None:
                buf["keep_frames"][r] = row.keep_frames
                buf["keep_owners"][r] = row.keep_owners
            if row.kept_pages is not None and row.feed_index >= 0:
                buf["kept_rows"][r] = self._last_row_index[row.feed_index]
                buf["kept_pages"][r] = row.kept_pages
                buf["kept_owners"][r] = row.kept_owners
            buf["host_lens"][r] = row.host_len

    def blend_input(self, blend: BlendRow) -> tuple[BlendShape, dict[str, np.ndarray]]:
        """The padded host inputs of a CacheBlend recompute (chunk tokens to a power of two,
        at least `min_chunk_bucket`; recomputed tokens to the ratio's share of that)."""
        n = blend.token_ids.shape[0]
        size = max(bucket(n), self.buckets.min_chunk_bucket)
        select = blend_count(blend.ratio, size)  # one program per chunk size and ratio
        p, width = self.page_size, self.buckets.block_table_width
        pos = np.arange(blend.start, blend.start + n, dtype=np.int32)
        slots = np.full(size, -1, np.int32)
        slots[:n] = blend.block_table[pos // p] * p + pos % p
        host = dict(tokens=np.zeros(size, np.int32), positions=np.zeros(size, np.int32),
                    slots=slots, block_table=np.zeros(width, np.int32),
                    num_select=np.int32(blend.num_select))
        host["tokens"][:n], host["positions"][:n] = blend.token_ids, pos
        host["block_table"][:min(width, len(blend.block_table))] = blend.block_table[:width]
        return BlendShape(size, select, width), host

    def dispatch(self, so: SchedulerOutput, logits_mode: LogitsMode = LogitsMode.NONE
                 ) -> InFlightStep:
        """Starts one step under `so.weights_version` (asynchronously: nothing is read back),
        after its plan of KV operations and the CacheBlend recomputes it carries."""
        self.apply_ops(so.kv_plan)
        for blend in so.blends:
            shape, host = self.blend_input(blend)
            self.kv = self.programs.blend(self.params[so.weights_version], self.kv, host, shape)
        if not so.rows:
            return InFlightStep(so, [], None)
        shape, buf, row_index = self.build_input(so, logits_mode)
        for observer in self.observers:
            observer.before_step(shape, buf)
        out, self.kv = self.programs.step(self.params[so.weights_version], self.kv, buf, shape,
                                          self.host_kv)
        for observer in self.observers:
            observer.after_step(shape, buf, out)
        self._feed, self._last_row_index = out.feed_tokens, row_index
        self._kept_feed = out.kept_feed
        return InFlightStep(so, row_index, out)

    def fetch(self, step: InFlightStep) -> RunnerOutput:
        """Waits for a dispatched step and reads its results to the host, in row order."""
        rows = np.asarray(step.row_index, np.int64)
        out = step.out
        if out is None:
            return self.idle_output()
        key_scores = None if out.key_scores is None else np.asarray(out.key_scores)[rows]
        num_accepted = spec_logprobs = query_key_scores = None
        if out.num_accepted is not None:
            num_accepted = np.asarray(out.num_accepted)[rows]
            spec_logprobs = np.asarray(out.spec_logprobs)[rows]
        if out.query_key_scores is not None:
            query_key_scores = np.asarray(out.query_key_scores)[rows]
        page_reads = None
        if out.page_reads is not None:  # decode rows come first
            page_reads = np.asarray(out.page_reads)[rows[:len(step.so.decode)]]
        return RunnerOutput(tokens=np.asarray(out.tokens)[rows],  # The host sync.
                            logprobs=np.asarray(out.logprobs)[rows], key_scores=key_scores,
                            logits=out.logits, num_accepted=num_accepted,
                            spec_logprobs=spec_logprobs, query_key_scores=query_key_scores,
                            page_reads=page_reads, tier_landed=self.tier_landed(wait=False))

    def warmup(self, weights_version: str, *, sampling: bool = False,
               blend_ratio: float | None = None, max_blend_tokens: int = 0) -> None:
        """Compiles every greedy step shape on padding inputs (which write and read nothing);
        with `sampling`, each shape's sampled variants too (with and without top-k / top-p /
        min-p, and with penalties, logit bias or min_tokens);
        with `blend_ratio`, the CacheBlend recomputes of chunks up to `max_blend_tokens`."""
        params = self.params[weights_version]
        if self.tier_transfers is not None:
            self.kv = self.tier_transfers.warmup(self.kv)
        n = self.buckets.min_chunk_bucket
        while blend_ratio is not None and n <= bucket(max_blend_tokens):
            shape, host = self.blend_input(BlendRow(
                "", np.zeros(n, np.int32), 0, np.zeros(-(-n // self.page_size), np.int32), 1,
                blend_ratio))
            host["slots"][:] = -1  # padding: nothing is read or written
            self.kv = self.programs.blend(params, self.kv, host, shape)
            n *= 2
        variants = [{}] + ([dict(all_greedy=False), dict(all_greedy=False, needs_filter=True),
                            self.buckets.rules_variant] if sampling else [])
        for greedy_shape in self.buckets.step_shapes():
            for variant in variants:
                shape = dataclasses.replace(greedy_shape, **variant)
                buf = self._empty_input(shape)
                buf["prev_tokens"] = self._zero_feed
                if buf["kept_feed"].size:
                    buf["kept_feed"] = self._zero_kept()
                _, self.kv = self.programs.step(params, self.kv, buf, shape, self.host_kv)
        if self.host_pool is not None:
            width = self.buckets.block_table_width
            self.kv = self.host_pool.warmup(self.kv, width,
                                            self.host_pool.num_layer_tables * width)
