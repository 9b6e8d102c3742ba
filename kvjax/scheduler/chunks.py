"""The scheduler's side of non-prefix context reuse (`kvjax.scheduler.context`): chunk copies
at a sequence's chunk spans, chunk fills on a miss, CacheBlend recomputes for the runner."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from kvjax.sampling_params import SamplingParams
from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.context import ChunkPlan, ReuseStrategy, blend_count, make_strategy
from kvjax.scheduler.output import BlendRow
from kvjax.scheduler.request import Sequence
from kvjax.scheduler.requests import RequestTable
from kvjax.shapes import pages_for

NO_LIMIT = 1 << 62  # tokens a sequence may compute before its next chunk copy: no copy ahead
_FILL = SamplingParams(max_new_tokens=1)  # a fill's one sampled token is dropped


class ChunkReuse:
    """The scheduler's chunk copies and fills.

    A sequence whose prefill reaches one of its chunk spans copies the chunk in from the chunk
    cache (`KVCacheManager.load_chunk`) and skips over it; on a miss it waits while a fill
    sequence (an internal request of the `RequestTable`, `Sequence.is_chunk_fill`) computes
    every chunk it lacks.

    Attributes:
      reuse_strategies: context-reuse strategies by name; a name not in it is made with its
        default options.
      fills_requested: chunk fills were queued in the step being formed.
    """

    def __init__(self, config: SchedulerConfig, kv_cache, table: RequestTable, stats: dict, *,
                 cache_key: Callable[[str | None, str], bytes],
                 strategies: dict[str, ReuseStrategy] | None):
        self.config = config
        self.kv_cache = kv_cache
        self.table = table
        self.stats = stats
        self._cache_key = cache_key
        self.reuse_strategies = dict(strategies or {})
        self._blends: list[BlendRow] = []
        self.fills_requested = False  # chunk fills were queued in the step being formed
        self.stats.update(chunk_lookups=0, chunk_hits=0, chunk_reused_tokens=0, chunk_fills=0,
                          chunk_fill_tokens=0, blend_tokens=0, blend_probe_tokens=0)

    def strategy(self, name: str) -> ReuseStrategy:
        """The context-reuse strategy of that name (ValueError if none is registered)."""
        if name not in self.reuse_strategies:
            self.reuse_strategies[name] = make_strategy(name)
        return self.reuse_strategies[name]

    def reuse_chunks(self, seq: Sequence) -> int:
        """Copies the cached chunks whose copy starts at the sequence's next token into its
        cache (`kvjax.scheduler.context`); returns how many tokens it may compute before the
        next copy (a very large number when none is ahead), or 0 while it waits: for a chunk
        fill (requested here on a miss) or for room in the pool."""
        strategy = self.strategy(seq.context_reuse)
        if not seq.chunk_spans or not strategy.reuses:
            return NO_LIMIT
        for start, end, point, plan in self._copies_ahead(seq, strategy):
            if seq.num_computed < point:
                return point - seq.num_computed
            prefix = self._shared_prefix(seq, plan)
            ids = self._chunk_ids(seq, prefix, start, end)
            fill = self._fill_id(seq, ids)
            if self.table.has_request(fill):
                return 0
            self.stats["chunk_lookups"] += 1
            cached = self.kv_cache.cached_len(seq.seq_id, seq.num_computed)
            status = self.kv_cache.load_chunk(
                seq.seq_id, ids, self.chunk_key(seq), first=len(prefix) + plan.recompute_first,
                count=end - point, start=cached, shift=start - len(prefix),
                key_scale=plan.key_scale, version=seq.weights_version)
            if status == "miss":
                self._request_fills(seq, strategy)
                return 0
            if status == "full":
                return 0
            self.stats["chunk_hits"] += 1
            self.stats["chunk_reused_tokens"] += end - point
            seq.num_computed = end
            if plan.blend_ratio:
                num = blend_count(plan.blend_ratio, end - point)
                self._blends.append(BlendRow(
                    seq_id=seq.seq_id, token_ids=np.asarray(seq.tokens[point:end], np.int32),
                    start=point,
                    block_table=np.asarray(self.kv_cache.block_table(seq.seq_id), np.int32),
                    num_select=num, ratio=plan.blend_ratio))
                self.stats["blend_tokens"] += num
                self.stats["blend_probe_tokens"] += end - point
                self.stats["prefill_tokens"] += num
        return NO_LIMIT

    @staticmethod
    def _copies_ahead(seq: Sequence, strategy: ReuseStrategy):
        """(start, end, point, plan) of each chunk span whose copy (from `point`, after the
        plan's recomputed first tokens) the sequence has not reached or made yet, in order."""
        for start, end in seq.chunk_spans:
            plan = strategy.plan(end - start)
            point = start + plan.recompute_first
            if point < end and seq.num_computed <= point:
                yield start, end, point, plan

    @staticmethod
    def _shared_prefix(seq: Sequence, plan: ChunkPlan) -> list[int]:
        """The tokens a chunk is encoded after: the prompt before its first chunk (the system
        prompt) with `plan.shared_prefix`, else none."""
        return list(seq.tokens[:seq.chunk_spans[0][0]]) if plan.shared_prefix else []

    def _chunk_ids(self, seq: Sequence, prefix: list[int], start: int, end: int) -> list[int]:
        """A chunk's tokens after `prefix`, padded to whole pages: how the chunk cache keys
        (and fills) it."""
        ids = prefix + list(seq.tokens[start:end])
        return ids + [0] * (pages_for(len(ids), self.config.page_size) * self.config.page_size
                            - len(ids))

    def chunk_cache_key(self, tenant: str | None, weights_version: str) -> bytes:
        """The key the chunk cache keeps a tenant's chunks under, for one weights version."""
        return self._cache_key(tenant, weights_version) + b"|chunk"

    def chunk_key(self, seq: Sequence) -> bytes:
        return self.chunk_cache_key(seq.tenant, seq.weights_version)

    def _fill_id(self, seq: Sequence, ids: list[int]) -> str:
        digest = hashlib.blake2b(self.chunk_key(seq), digest_size=8)
        digest.update(np.asarray(ids, "<i8").tobytes())
        return f"chunk-{digest.hexdigest()}"

    def _request_fills(self, seq: Sequence, strategy: ReuseStrategy) -> None:
        """Queues a fill (a prefill of the chunk alone, ranked with the request that waits for
        it) for every chunk the sequence will copy that the chunk cache lacks, so they are
        computed side by side."""
        key = self.chunk_key(seq)
        for start, end, _, plan in self._copies_ahead(seq, strategy):
            ids = self._chunk_ids(seq, self._shared_prefix(seq, plan), start, end)
            fill_id = self._fill_id(seq, ids)
            if self.table.has_request(fill_id):
                self.table.request_meta(fill_id)["waiters"].add(seq.request_id)
            elif self.kv_cache.peek_cached_tokens(ids + [0], key) < len(ids):
                self._add_fill(seq, fill_id, ids)

    def _add_fill(self, seq: Sequence, fill_id: str, ids: list[int]) -> None:
        fill = Sequence(
            seq_id=f"{fill_id}#0", request_id=fill_id, tokens=list(ids),
            num_prompt_tokens=len(ids), sampling=_FILL, seed=0,
            arrival_time=seq.arrival_time, order=seq.order, tenant=seq.tenant,
            priority=seq.priority, is_chunk_fill=True, weights_version=seq.weights_version)
        self.table.add_request(fill_id, list(ids), [fill], arrival=seq.arrival_time,
                         tenant=seq.tenant, n=1, internal=True)
        self.stats["chunk_fills"] += 1
        self.fills_requested = True
        self.table.request_meta(fill_id)["waiters"] = {seq.request_id}

    def take_blends(self) -> tuple[BlendRow, ...]:
        """The CacheBlend recomputes of the copies made since the last call."""
        blends, self._blends = tuple(self._blends), []
        return blends
