"""The KV cache manager: one object in front of the allocator, prefix cache, swap space, tiers,
retention and the page-version ledger.

The scheduler decides *which* sequence gets, keeps, shares or loses KV; this manager does the
bookkeeping and issues every device consequence (copy-on-write copies, swaps, scrubs, spills,
tier loads, compactions) as a `KVOp` for the `KVDevice` that owns the pool (the model runner).
Between `defer_ops()` and `take_plan()` (while the scheduler forms or commits a step) the ops
of `DATA_KINDS` (copy-on-write copies, scrubs, window copies, compactions, chunk loads, swaps
out to host slots and back, tier transfers) are collected as data for the runner to apply;
otherwise, and for the other kinds, the device applies them when issued (`kvjax.memory.ops`).
It knows sequences by id only: token lists, versions and cache keys come in as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvjax.delegation import delegate
from kvjax.kv.retention_host import RetentionManager
from kvjax.memory.block_manager import AllocStatus
from kvjax.memory.floors import WindowFloors
from kvjax.memory.host_moves import HostMoves
from kvjax.memory.host_pool import HostPagePool
from kvjax.memory.op_plan import OpPlan
from kvjax.memory.ops import ChunkLoadPlan, KVDevice, KVOp, KVOpKind
from kvjax.memory.page_ops import PageOps, TierTraffic
from kvjax.memory.page_versions import PageVersions
from kvjax.memory.precision import RoundedPages
from kvjax.memory.retaining import RetentionOps
from kvjax.memory.returning import ReturningSequences
from kvjax.memory.swapping import SwapMoves
from kvjax.shapes import geometric_buckets, next_power_of_2, pages_for
from kvjax.trace import Tracer


class KVCacheManager:
    """Allocation, sharing, movement and versioning of KV pages for the scheduler.

    The work is done by components: the `OpPlan` (ops issued or planned as data),
    `PageOps` (copy-on-write copies, chunk loads, scrubs), `HostMoves` (host-resident rows,
    ECHO), `SwapMoves` (swap out and back), `RetentionOps` (compactions), `TierTraffic`
    (spills and polls) and the `PageVersions` ledger, whose methods are this manager's too;
    `ReturningSequences` (`returning`: swapped and snapshot sequences registered again) and
    `WindowFloors` (`floors`: which tokens pages hold beside a KIVI window).

    Attributes:
      allocator: the page (or slot) allocator, with the prefix cache when it has one.
      swap_space: host copies of swapped-out sequences (through the tiers when enabled).
      tiers: the host/disk TierManager, or None.
      retention: the retention manager (which tokens each sequence keeps).
      page_versions: pool page -> the weights version that last wrote it (`versions.device`).
      stats: the engine's counters (shared dict) this manager adds to.
      host_pool: the host pool's bookkeeping (host-resident rows: `to_host`), or None.
      floors: the sequences' `kv_floor`s and the pages' share of their tokens (`WindowFloors`).
      returning: registers sequences that come back from a swap or a snapshot.

    Args:
      quantized_len: for a state whose newest tokens live beside the pages (KIVI with an
        exact window), how many of a sequence's first n tokens its pages hold; only those
        pages are published to the prefix cache. None: pages hold every computed token.
    """

    def __init__(self, device: KVDevice, allocator, swap_space, retention: RetentionManager, *,
                 page_size: int, watermark: float, scrub_freed_pages: bool, stats: dict,
                 tiers=None, quantized_len=None, clock=None,
                 host_pool: HostPagePool | None = None):
        self.device = device
        self.host_pool = host_pool
        self.allocator = allocator
        self.swap_space = swap_space
        self.retention = retention
        self.tiers = tiers
        self.page_size = page_size
        self.watermark = watermark
        self.scrub_freed_pages = scrub_freed_pages
        self.stats = stats
        self.versions = PageVersions()
        self.page_versions = self.versions.device
        self.floors = WindowFloors(quantized_len)
        if clock is not None and self.has_prefix_cache:
            allocator.clock = clock  # when cached pages are released (CachedPage.released_at)
        self.ops = OpPlan(device)
        self.rounded = RoundedPages(allocator)  # pages demoted in place leave the index
        if tiers is not None:  # its transfer ops join the step's plan like every data op
            tiers.port.issue_to = self.ops.issue
        self.tier_traffic = TierTraffic(tiers, allocator, self.ops, stats)
        self.page_ops = PageOps(allocator, swap_space, self.ops, self.versions, stats,
                                page_size=page_size, spill=self.spill_evictions,
                                allocate=self.allocate)
        self.host = HostMoves(host_pool, allocator, self.ops, self.versions, stats,
                              scrub_freed_pages=scrub_freed_pages, spill=self.spill_evictions,
                              scrub=self.scrub)
        self.returning = ReturningSequences(
            allocator, retention, self.ops, self.versions, self.floors, self.rounded,
            page_size=page_size, lookup=self.lookup, allocate=self.allocate, commit=self.commit)
        self.swaps = SwapMoves(allocator, swap_space, retention, self.ops, self.versions,
                               self.host, stats, tiers=tiers, page_size=page_size,
                               free=self.free, register_returning=self.returning.register,
                               spill=self.spill_evictions)
        self.retaining = RetentionOps(retention, allocator, self.ops, self.versions,
                                      floors=self.floors, scrub_freed_pages=scrub_freed_pages,
                                      scrub=self.scrub)
        self.stats.update(scrubbed_pages=0, swaps_out=0, swaps_in=0, swap_bytes=0,
                          stale_kv_reads=0, bytes_device_to_host=0, bytes_host_to_device=0,
                          bytes_host_to_disk=0, bytes_disk_to_host=0, host_pages_out=0,
                          host_pages_in=0, echo_pages_mirrored=0, echo_pages_released=0,
                          echo_frames_taken=0, echo_layer_pages_prefetched=0)

    # ----------------------------------------------------------------------------- KV ops

    def set_tracer(self, tracer: Tracer) -> None:
        """Reports page events (allocator), KV ops and tier transfers to `tracer`."""
        self.ops.tracer = self.allocator.tracer = tracer
        if self.tiers is not None:
            self.tiers.set_tracer(tracer)

    @property
    def tracer(self) -> Tracer:
        return self.ops.tracer

    defer_ops = delegate("ops", OpPlan.defer_ops)
    take_plan = delegate("ops", OpPlan.take_plan)
    end_plan = delegate("ops", OpPlan.end_plan)
    take_ops = delegate("ops", OpPlan.take_ops)
    plan_op = delegate("ops", OpPlan.issue)  # a data op decided outside (in-place demotion)

    def pages_in_use(self) -> dict[str, int]:
        """Pages held per tier now: device pages not allocatable, and the tiers' pages."""
        held = dict(device=self.num_pages - self.allocator.num_free_pages())
        if self.tiers is not None:
            held.update(self.tiers.num_pages_held())
        return held

    # ----------------------------------------------------------------------------- views

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def has_prefix_cache(self) -> bool:
        return self.allocator.prefix_cache is not None

    def has_sequence(self, seq_id: str) -> bool:
        return self.allocator.has_sequence(seq_id)

    def block_table(self, seq_id: str) -> list[int]:
        return self.allocator.block_table(seq_id)

    def row_tables(self, seq_id: str) -> tuple[np.ndarray, np.ndarray | None]:
        """A step row's tables: group 0's [n] int32 and the other layer groups' [G-1, n] (None
        with one group). An entry a window gave back reads page 0, which the window's mask
        hides; so does one past the end of a table shorter than the others (groups that keep
        retention budgets of their own hold different numbers of pages)."""
        tables = np.maximum(self.allocator.block_table_array(seq_id), 0)  # [G, n]
        return tables[0], (tables[1:] if len(tables) > 1 else None)

    def seq_slot(self, seq_id: str) -> int:
        """The sequence's per-sequence state slot (KIVI windows), else 0."""
        return self.allocator.seq_slot(seq_id)

    def cached_len(self, seq_id: str, num_computed: int) -> int:
        """Tokens of a sequence in the cache: its computed length less what retention evicted."""
        return num_computed - self.retention.num_evicted(seq_id)

    def can_admit(self, num_new_pages: int, *, reserve: bool = True) -> bool:
        """Whether `num_new_pages` more pages leave the watermark's reserve (if `reserve`) free."""
        reserve = int(self.watermark * self.allocator.capacity) if reserve else 0
        return self.allocator.num_free_pages() - num_new_pages >= reserve

    def pages_needed(self, seq_id: str, num_tokens: int) -> int:
        return self.allocator.pages_needed(seq_id, num_tokens)

    def peek_cached_tokens(self, token_ids: Sequence[int], cache_key: bytes,
                           max_hit: int | None = None) -> int:
        """Tokens a new sequence would find in the prefix cache (0 without one; at most
        `max_hit`)."""
        if not self.has_prefix_cache:
            return 0
        return self.allocator.peek_cached_tokens(token_ids, cache_key=cache_key,
                                                 max_hit=max_hit)

    def cache_key_of(self, seq_id: str) -> bytes:
        return self.allocator.cache_key_of(seq_id)

    def last_page_hash(self, seq_id: str, token_ids: Sequence[int]) -> bytes | None:
        """The prefix-cache hash the last full page of the sequence's leading `token_ids` will
        be indexed under (None without a prefix cache, or for a sequence that indexes none)."""
        if not self.has_prefix_cache:
            return None
        return self.allocator.last_page_hash(seq_id, token_ids)

    def cached_pages(self) -> list:
        """The unreferenced prefix-cache pages (`kvjax.memory.prefix_cache.CachedPage`), least
        recently released first; [] without a prefix cache."""
        return self.allocator.cached_pages() if self.has_prefix_cache else []

    def keep_cached(self, pages: Sequence[int]) -> None:
        """Cached pages evicted only after every other one, in this order (a controller's
        choice of which prefix pages to keep); a no-op without a prefix cache."""
        if self.has_prefix_cache:
            self.allocator.keep_cached(pages)

    def host_room_bytes(self) -> float:
        """Bytes the host tier can take before it evicts (inf without a host budget: swapped
        copies live in host memory unbounded)."""
        return float("inf") if self.tiers is None else self.tiers.host_room_bytes()

    def prefix_cache_stats(self) -> dict:
        stats = getattr(self.allocator, "stats", None)
        if stats is None:
            return dict(prefix_queries=0, prefix_query_tokens=0, prefix_hit_tokens=0)
        return dict(prefix_queries=stats.prefix_queries,
                    prefix_query_tokens=stats.prefix_query_tokens,
                    prefix_hit_tokens=stats.prefix_hit_tokens)

    @property
    def num_compiles(self) -> int:
        return self.swap_space.num_compiles

    # ----------------------------------------------------------------------------- pages

    def lookup(self, seq_id: str, token_ids: Sequence[int], cache_key: bytes, *,
               indexable: bool = True, max_hit: int | None = None) -> int:
        """Registers a sequence; returns how many of its tokens the prefix cache holds.

        indexable: False when the sequence's pages hold a subset of its tokens (retention
        evicted some): it then neither reads nor feeds the prefix cache.
        max_hit: attach at most this many leading tokens (None: every cached one)."""
        cached = self.allocator.add_sequence(seq_id, token_ids, cache_key=cache_key,
                                             indexable=indexable, max_hit=max_hit)
        self.floors.attach_loaded(seq_id, cached)
        return cached

    def unregister(self, seq_id: str) -> None:
        """Drops a registration whose pages were never written by it (admission fell through);
        its prefix-cache hits go back to the cache."""
        self.allocator.free(seq_id)
        self.floors.pop(seq_id)

    def allocate(self, seq_id: str, start: int, end: int, *, returning: bool = False) -> bool:
        """Makes cache positions [start, end) of a sequence writable (new pages, copy-on-write
        copies of shared ones, applied now); False when the pool has no room.

        returning: the positions' KV comes back from host memory or a snapshot and the next
        query is at `end`, so a sliding-window layer group takes pages only for its window."""
        ensure = self.allocator.ensure_restored if returning else self.allocator.ensure_writable
        status, copies = ensure(seq_id, start, end)
        released = self.allocator.take_released()  # pages sliding windows gave back
        if self.scrub_freed_pages and released:
            self.scrub(released)
        if status is not AllocStatus.OK:
            return False
        self.copy(copies)
        return True

    def commit(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """Publishes the sequence's full computed pages to the prefix cache (with a window
        beside the pages, those whose every token the pages hold)."""
        self.allocator.commit(seq_id, self.floors.paged_tokens(seq_id, token_ids))

    def free(self, seq_id: str, *, keep_retention: bool = False) -> None:
        """Releases a sequence's pages (cached ones stay in the prefix cache) and policy state
        (kept with keep_retention: a swapped sequence comes back with the same tokens, and its
        host-resident pages stay in the host pool for it)."""
        if not keep_retention:
            self._forget(seq_id)
        freed = self.allocator.free(seq_id)
        if self.scrub_freed_pages:
            if freed:
                self.spill_evictions()
            # Also with no page freed (its pages stay in the prefix cache): a KIVI sequence's
            # window slot is freed with it and must be zeroed before a new sequence takes it.
            self.scrub(freed)

    load_chunk = delegate("page_ops", PageOps.load_chunk)
    copy = delegate("page_ops", PageOps.copy)
    scrub = delegate("page_ops", PageOps.scrub)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Drops a sequence's cache positions from `num_tokens` on (rejected speculative
        drafts): the pages past them return to the pool (scrubbed if configured)."""
        freed = self.allocator.truncate(seq_id, num_tokens)
        if self.scrub_freed_pages and freed:
            self.scrub(freed)

    def fork(self, parent_id: str, child_id: str) -> bool:
        """Shares the parent's pages (and copies its window) with a new child sequence; False
        when the allocator cannot share (the child is then prefilled afresh). A parent forks
        before it decodes, so it has no host-resident pages."""
        if self.num_host_pages(parent_id):
            raise ValueError(f"sequence {parent_id!r} forks with host-resident pages")
        try:
            copies = self.allocator.fork(parent_id, child_id) or []
        except ValueError:
            return False
        self.retention.fork(parent_id, child_id)
        self.floors.fork(parent_id, child_id)
        self.copy(copies)
        if self.keeps_windows:
            self.ops.issue(KVOp(KVOpKind.COPY_WINDOW, src=(self.seq_slot(parent_id),),
                             dst=(self.seq_slot(child_id),)))
        return True

    # ----------------------------------------------------------------------------- moves

    num_host_pages = delegate("host", HostMoves.num_host_pages)
    host_table = delegate("host", HostMoves.host_table)
    num_free_host_pages = delegate("host", HostMoves.num_free_host_pages)
    to_host = delegate("host", HostMoves.to_host)
    to_device = delegate("host", HostMoves.to_device)
    swap_out = delegate("swaps", SwapMoves.swap_out)
    swap_in = delegate("swaps", SwapMoves.swap_in)
    swap_out_bytes = delegate("swaps", SwapMoves.swap_out_bytes)
    restore_window = delegate("swaps", SwapMoves.restore_window)
    retain = delegate("retaining", RetentionOps.retain)
    retain_verified = delegate("retaining", RetentionOps.retain_verified)
    finish_probes = delegate("retaining", RetentionOps.finish_probes)
    max_verify_tokens = delegate("retaining", RetentionOps.max_verify_tokens)

    @property
    def keeps_windows(self) -> bool:
        """Whether sequences hold state beside their pages (KIVI windows)."""
        return self.swap_space.keeps_windows

    # ----------------------------------------------------------------------------- forgetting

    def drop_swapped(self, seq_id: str) -> None:
        """Forgets a sequence's host copy (it finished or restarts)."""
        self.swaps.drop(seq_id)
        self._forget(seq_id)

    def _forget(self, seq_id: str) -> None:
        """Drops what the sequence keeps while away: its retention record, floor, pages
        demoted in place and host-pool pages."""
        self.retention.drop(seq_id)
        self.floors.pop(seq_id)
        self.rounded.discard(seq_id)
        if self.host_pool is not None:
            self.host_pool.free(seq_id)

    # ----------------------------------------------------------------------------- versions

    mark_written = delegate("versions", PageVersions.mark_written)

    def stale_pages(self, seq_id: str, kv_len: int, version: str) -> list:
        """Pages among a sequence's first `kv_len` cached tokens written by other weights (its
        host-pool pages as 'host:<page>')."""
        table = self.block_table(seq_id)[self.num_host_pages(seq_id):
                                         pages_for(kv_len, self.page_size)]
        return self.versions.stale(table, self.host_table(seq_id).tolist(), version)

    def check_fresh(self, seq_id: str, kv_len: int, version: str) -> None:
        """Raises (and counts) if the sequence would read a page written under other weights."""
        stale = self.stale_pages(seq_id, kv_len, version)
        self.versions.check_fresh(seq_id, version, stale, self.stats)

    # ----------------------------------------------------------------------------- tiers

    spill_evictions = delegate("tier_traffic", TierTraffic.spill_evictions)
    poll_tiers = delegate("tier_traffic", TierTraffic.poll_tiers)

    # ----------------------------------------------------------------------------- warm-up

    def warmup(self, block_table_width: int, *, swap: bool, max_copies: int = 0,
               max_chunk_tokens: int = 0, demote_bits: tuple[int, ...] = ()) -> None:
        """Compiles the retention, swap and scrub programs on padding inputs, the
        copy-on-write programs for up to `max_copies` copies in one step (page 0 onto itself,
        which changes nothing) and the chunk copies of up to `max_chunk_tokens` tokens."""
        for op in _idle_ops(self.retention, self.page_size, max_copies, max_chunk_tokens):
            self.ops.apply(KVOp(KVOpKind.WARMUP), lambda kv, op=op: self.device.run_op(kv, op))
        # (The runner warms its tier transfers itself.)
        self.ops.apply(KVOp(KVOpKind.WARMUP), lambda kv: self.swap_space.warmup(
            kv, block_table_width, swap=swap, scrub=self.scrub_freed_pages,
            demote_bits=demote_bits))


def _idle_ops(retention: RetentionManager, page_size: int, max_copies: int,
              max_chunk_tokens: int) -> list[KVOp]:
    """Ops that change nothing and compile every program size of the copy-on-write copies
    (page 0 onto itself), retention compactions and chunk loads (writing nothing)."""
    idle = [KVOp(KVOpKind.COPY, src=(0,) * n, dst=(0,) * n)
            for n in (geometric_buckets(1, next_power_of_2(max_copies), 2)
                      if max_copies else ())]
    idle += [KVOp(KVOpKind.COMPACT, plan=plan) for plan in retention.warmup_plans()]
    n = 1
    while max_chunk_tokens and n <= next_power_of_2(max_chunk_tokens):
        idle.append(KVOp(KVOpKind.CHUNK_LOAD, plan=ChunkLoadPlan.padded(
            [], 0, [-1] * n, 0, 1.0, page_size=page_size)))
        n *= 2
    return idle
