"""The KV cache manager: one object in front of the allocator, prefix cache, swap space, tiers,
retention and the page-version ledger.

The scheduler decides *which* sequence gets, keeps, shares or loses KV; this manager does the
bookkeeping and issues every device consequence (copy-on-write copies, swaps, scrubs, spills,
tier loads, compactions) as a `KVOp` for the `KVDevice` that owns the pool (the model runner).
Between `defer_ops()` and `take_plan()` (while the scheduler forms or commits a step) the ops
of `DATA_KINDS` (copy-on-write copies, scrubs, window copies, compactions, chunk loads, swaps
out to host slots and back) are collected as data for the runner to apply; otherwise, and for
the other kinds, the device applies them when issued (`kvjax.memory.ops`).
It knows sequences by id only: token lists, versions and cache keys come in as arguments.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence

import numpy as np

from kvjax.kv.retention_host import RetentionManager, SeqLayout
from kvjax.memory.block_manager import RELEASED, AllocStatus, CopyOp
from kvjax.memory.host_pool import HostPagePool
from kvjax.memory.ops import ChunkLoadPlan, KVDevice, KVOp, KVOpKind
from kvjax.shapes import geometric_buckets, next_power_of_2, pad_repeat_last, pages_for
from kvjax.trace import NULL_TRACER, Tracer


class SwapSlots:
    """The host slots of swapped sequences' copies (`KVOp.host_slot`), the lowest free one
    first, so a replay hands out the same ones."""

    def __init__(self):
        self._held: dict[str, tuple[int, int]] = {}  # sequence -> (slot, the copy's bits)
        self._free: list[int] = []  # a heap of the slots below the most ever held

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._held

    def take(self, seq_id: str, bits: int) -> int:
        """A free slot for the sequence's copy at `bits`."""
        slot = heapq.heappop(self._free) if self._free else len(self._held)
        self._held[seq_id] = (slot, bits)
        return slot

    def release(self, seq_id: str) -> tuple[int, int]:
        """(slot, bits) of the sequence's copy; the slot is free again."""
        slot, bits = self._held.pop(seq_id)
        heapq.heappush(self._free, slot)
        return slot, bits


class KVCacheManager:
    """Allocation, sharing, movement and versioning of KV pages for the scheduler.

    Attributes:
      allocator: the page (or slot) allocator, with the prefix cache when it has one.
      swap_space: host copies of swapped-out sequences (through the tiers when enabled).
      tiers: the host/disk TierManager, or None.
      retention: the retention manager (which tokens each sequence keeps).
      page_versions: pool page -> the weights version that last wrote it.
      stats: the engine's counters (shared dict) this manager adds to.
      host_pool: the host pool's bookkeeping (host-resident rows: `to_host`), or None.

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
        self.page_versions: dict[int, str] = {}
        self._host_versions: dict[int, str] = {}  # host-pool page -> the version that wrote it
        self._quantized_len = quantized_len
        if clock is not None and self.has_prefix_cache:
            allocator.clock = clock  # when cached pages are released (CachedPage.released_at)
        self._floors: dict[str, int] = {}  # sequence -> tokens its pages hold from the start
        self._ops: list[KVOp] = []
        # swapped sequence -> (block-table entry, layer group) of each page its host copy holds
        self._swapped_entries: dict[str, list[tuple[int, int]]] = {}
        self._swap_slots = SwapSlots()  # without tiers: where each swapped copy is
        self._plan: list[KVOp] | None = None  # data ops deferred to the step; None: apply now
        self.tracer: Tracer = NULL_TRACER
        self.stats.update(scrubbed_pages=0, swaps_out=0, swaps_in=0, swap_bytes=0,
                          stale_kv_reads=0, bytes_device_to_host=0, bytes_host_to_device=0,
                          bytes_host_to_disk=0, bytes_disk_to_host=0, host_pages_out=0,
                          host_pages_in=0, echo_pages_mirrored=0, echo_pages_released=0,
                          echo_pages_prefetched=0)

    # ----------------------------------------------------------------------------- KV ops

    def set_tracer(self, tracer: Tracer) -> None:
        """Reports page events (allocator), KV ops and tier transfers to `tracer`."""
        self.tracer = self.allocator.tracer = tracer
        if self.tiers is not None:
            self.tiers.set_tracer(tracer)

    def _record(self, op: KVOp) -> None:
        self._ops.append(op)
        self.tracer.emit(op.kind.value, "page", "pages/device", num_pages=len(op.pages))

    def _issue(self, op: KVOp) -> None:
        """A data op (`DATA_KINDS`): into the step's plan while one is formed, else applied."""
        self._record(op)
        if self._plan is None:
            self.device.apply_ops((op,))
        else:
            self._plan.append(op)

    def _flush_plan(self) -> None:
        """Applies the data ops planned so far: an op that runs now must come after them."""
        if self._plan:
            self.device.apply_ops(tuple(self._plan))
            self._plan.clear()

    def plan_op(self, op: KVOp) -> None:
        """A data op decided outside this manager (a controller's in-place demotion): into the
        step's plan while one is formed, else applied now."""
        self._issue(op)

    def _apply(self, op: KVOp, fn) -> None:
        self._flush_plan()
        self._record(op)
        self.device.apply(op, fn)

    def _read(self, op: KVOp, fn):
        self._flush_plan()
        self._record(op)
        return self.device.read(op, fn)

    def defer_ops(self) -> None:
        """From now until `take_plan`, ops of `DATA_KINDS` are planned as data (a step is
        being formed or committed) instead of applied when issued."""
        self._flush_plan()
        self._plan = []

    def take_plan(self) -> tuple[KVOp, ...]:
        """The data ops planned since `defer_ops`, in order, for the runner to apply before
        the step's model; ops are applied when issued again afterwards."""
        plan, self._plan = tuple(self._plan or ()), None
        return plan

    def end_plan(self) -> None:
        """Applies the data ops still planned (none once `take_plan` took them) and applies
        ops when issued again."""
        self._flush_plan()
        self._plan = None

    def pages_in_use(self) -> dict[str, int]:
        """Pages held per tier now: device pages not allocatable, and the tiers' pages."""
        held = dict(device=self.num_pages - self.allocator.num_free_pages())
        if self.tiers is not None:
            held.update(self.tiers.num_pages_held())
        return held

    def take_ops(self) -> tuple[KVOp, ...]:
        """The KV operations issued since the last call, in order."""
        ops, self._ops = tuple(self._ops), []
        return ops

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
        rows = self.allocator.block_tables(seq_id)
        tables = np.zeros((len(rows), max(map(len, rows))), np.int32)
        for g, row in enumerate(rows):
            tables[g, :len(row)] = np.maximum(row, 0)
        return tables[0], (tables[1:] if len(tables) > 1 else None)

    def seq_slot(self, seq_id: str) -> int:
        """The sequence's per-sequence state slot (KIVI windows), else 0."""
        return self.allocator.seq_slot(seq_id)

    def kv_floor(self, seq_id: str) -> int:
        """Cache positions of a sequence read from its pages whatever its length: the fully
        quantized pages it took from the prefix cache or the tiers (0 without a window)."""
        return self._floors.get(seq_id, 0)

    def cached_len(self, seq_id: str, num_computed: int) -> int:
        """Tokens of a sequence in the cache: its computed length less what retention evicted."""
        return num_computed - self.retention.num_evicted(seq_id)

    def can_admit(self, num_new_pages: int) -> bool:
        """Whether `num_new_pages` more pages leave the watermark's reserve free."""
        reserve = int(self.watermark * self.allocator.capacity)
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
        self.attach_loaded(seq_id, cached)
        return cached

    def attach_loaded(self, seq_id: str, num_tokens: int) -> None:
        """The sequence's first `num_tokens` came as whole pages from the prefix cache or the
        tiers: with a window beside the pages, they are read from the pages from now on."""
        if self._quantized_len is not None and num_tokens:
            self._floors[seq_id] = max(self.kv_floor(seq_id), num_tokens)

    def unregister(self, seq_id: str) -> None:
        """Drops a registration whose pages were never written by it (admission fell through);
        its prefix-cache hits go back to the cache."""
        self.allocator.free(seq_id)
        self._floors.pop(seq_id, None)

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
        if self._quantized_len is not None:
            token_ids = token_ids[:max(self.kv_floor(seq_id),
                                       self._quantized_len(len(token_ids)))]
        self.allocator.commit(seq_id, token_ids)

    def load_chunk(self, seq_id: str, chunk_ids: Sequence[int], cache_key: bytes, *,
                   first: int, count: int, start: int, shift: int, key_scale: float,
                   version: str) -> str:
        """Copies tokens [first, first + count) of a cached chunk into the sequence's cache
        positions [start, start + count), keys turned forward by `shift` positions and scaled
        by `key_scale` (`kvjax.kv.reuse`); the chunk's own pages are only read.

        chunk_ids: the chunk's tokens padded to whole pages, as the chunk cache keys them.
        Returns 'loaded'; 'miss' when the prefix cache does not hold every page of the chunk
        (nothing changed); 'full' when the sequence's pages do not fit the pool.
        """
        found = self.allocator.peek_cached_tokens(list(chunk_ids) + [0], cache_key=cache_key)
        if found < len(chunk_ids):
            return "miss"
        pin = f"{seq_id}@chunk"  # Holds the chunk's pages while the sequence allocates.
        self.allocator.add_sequence(pin, list(chunk_ids) + [0], cache_key=cache_key,
                                    record_stats=False)
        try:
            if not self.allocate(seq_id, start, start + count):
                return "full"
            p = self.page_size
            src_pages = self.block_table(pin)[first // p:pages_for(first + count, p)]
            dst_table = np.asarray(self.block_table(seq_id), np.int64)
            dst_pos = np.arange(start, start + count)
            dst = dst_table[dst_pos // p] * p + dst_pos % p
            written = sorted(set(dst_table[dst_pos // p].tolist()))
            plan = ChunkLoadPlan.padded(src_pages, first % p, dst.tolist(), shift, key_scale,
                                        page_size=p)
            self._issue(KVOp(KVOpKind.CHUNK_LOAD, tuple(written), plan=plan))
            self.mark_written(written, version)
            return "loaded"
        finally:
            self.allocator.free(pin)

    def copy(self, copies: Sequence[CopyOp]) -> None:
        """Applies copy-on-write copies (after spilling evicted pages they may overwrite)."""
        self.spill_evictions()
        if not copies:
            return
        for c in copies:
            self.page_versions[c.dst] = self.page_versions.get(c.src, "")
        n = next_power_of_2(len(copies))
        # Padding repeats the last copy: idempotent, and keeps shapes bucketed.
        src = pad_repeat_last([c.src for c in copies], n)
        dst = pad_repeat_last([c.dst for c in copies], n)
        self._issue(KVOp(KVOpKind.COPY, tuple(int(c.dst) for c in copies),
                         src=tuple(src.tolist()), dst=tuple(dst.tolist())))

    def free(self, seq_id: str, *, keep_retention: bool = False) -> None:
        """Releases a sequence's pages (cached ones stay in the prefix cache) and policy state
        (kept with keep_retention: a swapped sequence comes back with the same tokens, and its
        host-resident pages stay in the host pool for it)."""
        if not keep_retention:
            self.retention.drop(seq_id)
            self._floors.pop(seq_id, None)
        if self.host_pool is not None and not keep_retention:
            self.host_pool.free(seq_id)
        freed = self.allocator.free(seq_id)
        if self.scrub_freed_pages:
            if freed:
                self.spill_evictions()
            # Also with no page freed (its pages stay in the prefix cache): a KIVI sequence's
            # window slot is freed with it and must be zeroed before a new sequence takes it.
            self.scrub(freed)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Drops a sequence's cache positions from `num_tokens` on (rejected speculative
        drafts): the pages past them return to the pool (scrubbed if configured)."""
        freed = self.allocator.truncate(seq_id, num_tokens)
        if self.scrub_freed_pages and freed:
            self.scrub(freed)

    def scrub(self, pages: Sequence[int]) -> None:
        """Zeroes freed pages (and freed window slots) so no later reader sees their content."""
        slots = self.swap_space.take_released_slots()
        # Padding repeats the last index: zeroing twice is harmless, and shapes stay bucketed.
        self._issue(KVOp(KVOpKind.SCRUB, tuple(pages),
                         dst=tuple(pad_repeat_last(sorted(pages)).tolist()) if pages else (),
                         seq_slots=tuple(pad_repeat_last(slots).tolist()) if slots else ()))
        self.stats["scrubbed_pages"] += len(pages)

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
        if parent_id in self._floors:
            self._floors[child_id] = self._floors[parent_id]
        self.copy(copies)
        if self.keeps_windows:
            self._issue(KVOp(KVOpKind.COPY_WINDOW, src=(self.seq_slot(parent_id),),
                             dst=(self.seq_slot(child_id),)))
        return True

    # ----------------------------------------------------------------------------- host rows

    def num_host_pages(self, seq_id: str) -> int:
        """How many of the sequence's first pages live in the host pool (0 without one)."""
        return 0 if self.host_pool is None else self.host_pool.num_held(seq_id)

    def host_table(self, seq_id: str) -> np.ndarray:
        """[h] int32, the host-pool pages of the sequence's first h pages."""
        return np.asarray([] if self.host_pool is None else self.host_pool.table(seq_id),
                          np.int32)

    def num_free_host_pages(self) -> int:
        return 0 if self.host_pool is None else self.host_pool.num_free()

    def to_host(self, seq_id: str, num: int) -> bool:
        """Moves the sequence's next `num` device pages after its host-resident ones to the
        host pool (full pages only: the caller checks) and gives the device pages back;
        False, with nothing changed, when the host pool lacks room."""
        if num <= 0:
            return True
        if self.host_pool is None or self.host_pool.num_free() < num:
            return False
        first = self.host_pool.num_held(seq_id)
        src, freed = self.allocator.release_pages(seq_id, first, num)
        dst = self.host_pool.take(seq_id, num)
        for d, s in zip(dst, src, strict=True):
            self._host_versions[d] = self.page_versions.get(s, "")
        self._issue(KVOp(KVOpKind.HOST_OUT, tuple(src), src=_padded(src), dst=_padded(dst)))
        self.stats["host_pages_out"] += num
        if self.scrub_freed_pages and freed:
            self.spill_evictions()
            self.scrub(freed)
        return True

    def to_device(self, seq_id: str, num: int) -> bool:
        """Brings the sequence's last `num` host-resident pages back into fresh device pages;
        False, with nothing changed, when the device pool lacks room."""
        if num <= 0:
            return True
        first = self.num_host_pages(seq_id) - num
        if first < 0:
            raise ValueError(f"sequence {seq_id!r} holds {first + num} host pages, not {num}")
        dst = self.allocator.fill_pages(seq_id, first, num)
        if dst is None:
            return False
        self.spill_evictions()  # Before the copy overwrites pages evicted for it.
        src = self.host_pool.give_last(seq_id, num)
        for d, s in zip(dst, src, strict=True):
            self.page_versions[d] = self._host_versions.get(s, "")
        self._issue(KVOp(KVOpKind.HOST_IN, tuple(dst), src=_padded(src), dst=_padded(dst)))
        self.stats["host_pages_in"] += num
        return True

    # ----------------------------------------------------------------------------- ECHO

    def echo_host_table(self, seq_id: str) -> np.ndarray:
        """[n] int32 over a host-authoritative sequence's block-table entries: the host page
        an entry's step reads (its device page was released), or -1 (it is resident)."""
        table = self.block_table(seq_id)
        host = self.host_table(seq_id)
        return np.asarray([host[i] if page == RELEASED else -1
                           for i, page in enumerate(table)], np.int32)

    def echo_place(self, seq_id: str, num_full: int, keep: Collection[int]) -> None:
        """Host-authoritative pages (ECHO, `kvjax.engine.echo`): copies the sequence's full
        pages [0, num_full) that have no host copy yet to the host pool (the device keeps
        them), then keeps on the device exactly those full pages with a host copy that are in
        `keep`: released ones come back from their copies (a prefetch; skipped when the
        device pool has no room: the step then reads the host copy), the others are released.
        Pages without a host copy, the last (partial) one included, stay."""
        held = self.host_pool.num_held(seq_id)
        table = self.block_table(seq_id)
        new = min(num_full - held, self.host_pool.num_free())
        if new > 0:
            src = table[held:held + new]
            dst = self.host_pool.take(seq_id, new)
            for d, s in zip(dst, src, strict=True):
                self._host_versions[d] = self.page_versions.get(s, "")
            self._issue(KVOp(KVOpKind.HOST_OUT, tuple(src), src=_padded(src), dst=_padded(dst)))
            self.stats["echo_pages_mirrored"] += new
            held += new
        host = self.host_pool.table(seq_id)
        freed = []
        for index in range(held):
            if index not in keep and table[index] != RELEASED:
                freed += self.allocator.release_pages(seq_id, index, 1)[1]
                self.stats["echo_pages_released"] += 1
        if self.scrub_freed_pages and freed:
            self.spill_evictions()
            self.scrub(freed)
        src, dst = [], []
        for index in sorted(keep):
            if index < held and self.block_table(seq_id)[index] == RELEASED:
                page = self.allocator.fill_pages(seq_id, index, 1)
                if page is None:
                    break
                src.append(host[index])
                dst += page
                self.page_versions[page[0]] = self._host_versions.get(host[index], "")
        if dst:
            self.spill_evictions()  # Before the copy overwrites pages evicted for it.
            self._issue(KVOp(KVOpKind.HOST_IN, tuple(dst), src=_padded(src), dst=_padded(dst)))
            self.stats["echo_pages_prefetched"] += len(dst)

    # ----------------------------------------------------------------------------- swap

    def swap_out(self, seq_id: str, num_computed: int, *, demote_bits: int = 0) -> None:
        """Copies a sequence's computed pages (every layer group's, and its window) to host
        memory (int8 or int4 with `demote_bits`: see `kvjax.engine.swap`), then frees them.
        Without tiers the copy is a `KVOpKind.SWAP_OUT` op into a host slot, planned before the
        frees' scrubs and whatever reuses the pages.

        A sequence retention compacted keeps its record of which tokens its pages hold."""
        if self.retention.group_evicted(seq_id):
            raise ValueError(f"sequence {seq_id!r}: its table groups keep retention budgets of "
                             f"their own, each at its own cached length, which a swap does not "
                             f"restore (kvjax.engine.compat refuses swaps with them)")
        held = self.cached_len(seq_id, num_computed)
        # Host-resident pages are host memory already: they wait in the host pool.
        entries = self._held_entries(seq_id, self.num_host_pages(seq_id),
                                     pages_for(held, self.page_size))
        tables = self.allocator.block_tables(seq_id)
        pages = [tables[group][index] for index, group in entries]
        if self.tiers is None:
            nbytes = self._swap_out_op(seq_id, entries, pages, demote_bits)
        else:  # a copy in the tiers comes back as tier loads, by its keys
            nbytes = self._read(KVOp(KVOpKind.SWAP_OUT, tuple(pages)), lambda kv: (
                self.swap_space.swap_out(kv, seq_id, pages, demote_bits=demote_bits)))
        self.stats["swaps_out"] += 1
        self.stats["swap_bytes"] += nbytes
        self.free(seq_id, keep_retention=True)

    def _swap_out_op(self, seq_id: str, entries: list[tuple[int, int]], pages: list[int],
                     bits: int) -> int:
        """Issues the SWAP_OUT of `pages` into a free host slot; returns the copy's bytes."""
        slot = self._swap_slots.take(seq_id, bits)
        self._swapped_entries[seq_id] = entries
        window = (self.seq_slot(seq_id),) if self.keeps_windows else ()
        self._issue(KVOp(KVOpKind.SWAP_OUT, tuple(pages), src=_padded(pages) if pages else (),
                         seq_slots=window, host_slot=slot, bits=bits))
        return self._copy_bytes(len(pages), bits, window)

    def _copy_bytes(self, num_pages: int, bits: int, window: tuple[int, ...]) -> int:
        """Bytes of a host copy of `num_pages` pages at `bits`, with a window or not."""
        kv = self.device.kv  # its shapes and dtypes only
        return (self.swap_space.page_bytes(kv, bits) * num_pages
                + (self.swap_space.window_bytes(kv) if window else 0))

    def swap_in(self, seq_id: str, token_ids: Sequence[int], num_computed: int,
                cache_key: bytes, version: str) -> bool:
        """Brings a swapped sequence's pages back (prefix-cache hits reused, the rest from host
        memory, as a `KVOpKind.SWAP_IN` op planned before the step whose rows read them);
        False, with nothing changed, when the pool has no room."""
        cached = self.register_returning(seq_id, token_ids, num_computed, cache_key)
        if cached is None:
            return False
        pages = self.block_table(seq_id)
        first = cached // self.page_size
        num_host = self.num_host_pages(seq_id)
        targets, skipped = self._swap_targets(seq_id, first)
        if num_host:  # its host-resident pages come back too (those the prefix cache lacks)
            host = self.host_table(seq_id)
            if first < num_host:
                for d, s in zip(pages[first:num_host], host[first:num_host], strict=True):
                    self.page_versions[d] = self._host_versions.get(int(s), "")
                self.spill_evictions()
                self._issue(KVOp(KVOpKind.HOST_IN, tuple(pages[first:num_host]),
                                 src=_padded(host[first:num_host].tolist()),
                                 dst=_padded(pages[first:num_host])))
                self.stats["host_pages_in"] += num_host - first
            self.host_pool.free(seq_id)
        # The copy's pages past the prefix hit, where a window still reads them.
        kept = [i for i in range(skipped, len(targets)) if targets[i] != RELEASED]
        dst = [targets[i] for i in kept]
        slot, bits = self._swap_slots.release(seq_id)
        window = (self.seq_slot(seq_id),) if self.keeps_windows else ()
        written = [p for table in self.allocator.block_tables(seq_id) for p in table[first:]
                   if p != RELEASED]
        self._issue(KVOp(KVOpKind.SWAP_IN, tuple(written), src=_padded(kept) if kept else (),
                         dst=_padded(dst) if dst else (), seq_slots=window, host_slot=slot))
        self.mark_written(written, version)
        self.stats["swaps_in"] += 1
        self.stats["swap_bytes"] += self._copy_bytes(len(dst), bits, window)
        return True

    def _held_entries(self, seq_id: str, start: int, stop: int) -> list[tuple[int, int]]:
        """(block-table entry, layer group) of every page the sequence holds in entries
        [start, stop) of its tables, entry by entry (a window's released entries left out)."""
        tables = self.allocator.block_tables(seq_id)
        return [(index, group) for index in range(start, stop)
                for group, table in enumerate(tables) if table[index] != RELEASED]

    def _swap_targets(self, seq_id: str, first: int) -> tuple[list[int], int]:
        """Where a returning sequence's swapped pages go: the page of each one's entry in its
        group's new table (RELEASED where a window no longer reads it), and how many lead
        entries before `first` the prefix cache supplied (skipped)."""
        entries = self._swapped_entries.pop(seq_id)
        tables = self.allocator.block_tables(seq_id)
        targets = [tables[group][index] for index, group in entries]
        skipped = sum(index < first for index, _ in entries)
        stored = set(entries)
        lost = [(index, group) for group, table in enumerate(tables)
                for index in range(max(first, self.num_host_pages(seq_id)), len(table))
                if table[index] != RELEASED and (index, group) not in stored]
        if lost:
            raise RuntimeError(f"sequence {seq_id!r} came back with pages at (entry, group) "
                               f"{lost[:4]} that its swapped copy does not hold")
        return targets, skipped

    def place(self, seq_id: str, token_ids: Sequence[int], num_computed: int, cache_key: bytes,
              version: str, num_pages: int, scatter, retention: dict | None = None,
              kv_floor: int = 0) -> bool:
        """Registers a sequence whose first `num_pages` block-table entries of KV come from
        outside the pool (a snapshot): prefix-cache hits are shared, the rest written by
        `scatter(kv, tables, first) -> kv` (tables: [G][num_pages - first], every layer group's
        pool pages for entries first.., RELEASED where a window no longer reads the entry; the
        sequence's slot is `seq_slot(seq_id)` by then). `retention`: the retention record
        saved with the pages (`RetentionManager.record`), if any; `kv_floor`: the sequence's
        `kv_floor` when it was saved. False, with nothing changed, when the pool has no room."""
        self.retention.restore(seq_id, retention)
        self.attach_loaded(seq_id, kv_floor)
        cached = self.register_returning(seq_id, token_ids, num_computed, cache_key)
        if cached is None:
            self.retention.drop(seq_id)
            self._floors.pop(seq_id, None)
            return False
        first = cached // self.page_size
        tables = [t[first:num_pages] for t in self.allocator.block_tables(seq_id)]
        written = [p for t in tables for p in t if p != RELEASED]
        self._apply(KVOp(KVOpKind.SCATTER, tuple(written)),
                    lambda kv: scatter(kv, tables, first))
        self.mark_written(written, version)
        self.commit(seq_id, token_ids[:num_computed])
        return True

    def register_returning(self, seq_id: str, token_ids: Sequence[int], num_computed: int,
                           cache_key: bytes) -> int | None:
        """Registers a returning (swapped or restored) sequence with pages for the tokens its
        cache holds (prefix hits shared unless retention dropped some); the number of leading
        cached tokens the prefix cache supplied, or None, with nothing changed, when the pool
        has no room."""
        held = self.cached_len(seq_id, num_computed)
        floor = self._floors.get(seq_id)
        cached = self.lookup(seq_id, token_ids[:num_computed + 1], cache_key,
                             indexable=held == num_computed)
        if not self.allocate(seq_id, cached, held, returning=True):
            self.unregister(seq_id)
            if floor is not None:  # It stays swapped out, with the floor it had.
                self._floors[seq_id] = floor
            return None
        return cached

    @property
    def keeps_windows(self) -> bool:
        """Whether sequences hold state beside their pages (KIVI windows)."""
        return self.swap_space.keeps_windows

    def restore_window(self, seq_id: str) -> None:
        """Writes a swapped sequence's saved window into its new slot, once it is registered
        again (with tiers on, its pages come back as tier loads)."""
        if not self.keeps_windows:
            return
        nbytes = []

        def restore(kv):
            kv, n = self.swap_space.restore_window(kv, seq_id)
            nbytes.append(n)
            return kv

        self._apply(KVOp(KVOpKind.SWAP_IN), restore)
        self.stats["swap_bytes"] += nbytes[0]

    def drop_swapped(self, seq_id: str) -> None:
        """Forgets a sequence's host copy (it finished or restarts)."""
        if seq_id in self._swap_slots:
            self._issue(KVOp(KVOpKind.SWAP_DROP, host_slot=self._swap_slots.release(seq_id)[0]))
        if self.tiers is not None:
            self.swap_space.drop(seq_id)
        self._swapped_entries.pop(seq_id, None)
        self.retention.drop(seq_id)
        self._floors.pop(seq_id, None)
        if self.host_pool is not None:
            self.host_pool.free(seq_id)

    # ----------------------------------------------------------------------------- retention

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
        if self._quantized_len is None:
            return most
        cached, floor = self.cached_len(seq_id, num_computed), self.kv_floor(seq_id)

        def aged(length: int) -> int:
            return max(self._quantized_len(length), floor)

        n = 1
        while n < most and aged(cached + n + 1) == aged(cached):
            n += 1
        return n

    def _retain_selected(self, seq_id: str, *, is_prefill_done: bool, version: str) -> None:
        keep = self.retention.select(seq_id, is_prefill_done=is_prefill_done)
        if keep is None:
            return
        if self.retention.num_tables > 1:
            self._retain_groups(seq_id, keep, is_prefill_done=is_prefill_done, version=version)
            return
        old_table = list(self.block_table(seq_id))
        status, src, dst, freed = self.allocator.retain(seq_id, keep)
        if status is not AllocStatus.OK:  # No page for a copy now: evict after a later step.
            return
        table = self.block_table(seq_id)
        layout = SeqLayout(old_table=old_table, new_table=list(table),
                           kv_floor=self._floors.pop(seq_id, 0),
                           seq_slot=self.seq_slot(seq_id))
        plan = self.retention.evict(seq_id, keep, src, dst, len(freed),
                                    is_prefill_done=is_prefill_done, layout=layout)
        self._issue(KVOp(KVOpKind.COMPACT, tuple(table), plan=plan))
        self.mark_written(table, version)
        if freed and self.scrub_freed_pages:
            self.scrub(freed)

    def _retain_groups(self, seq_id: str, keeps: list[np.ndarray], *, is_prefill_done: bool,
                       version: str) -> None:
        """Table groups with budgets of their own (`kvjax.kv.layer_retention`): each keeps
        keeps[g], compacted by a COMPACT op of its own."""
        old_tables = [list(t) for t in self.allocator.block_tables(seq_id)]
        status, moves, freed = self.allocator.retain_groups(seq_id, keeps)
        if status is not AllocStatus.OK:  # No page for a copy now: evict after a later step.
            return
        tables = self.allocator.block_tables(seq_id)
        layouts = [SeqLayout(old_table=old, new_table=list(new), seq_slot=self.seq_slot(seq_id))
                   for old, new in zip(old_tables, tables, strict=True)]
        plans = self.retention.evict_groups(seq_id, keeps, moves, len(freed),
                                            is_prefill_done=is_prefill_done, layouts=layouts)
        for table, plan in zip(tables, plans, strict=True):
            self._issue(KVOp(KVOpKind.COMPACT, tuple(table), plan=plan))
            self.mark_written(table, version)
        if freed and self.scrub_freed_pages:
            self.scrub(freed)

    # ----------------------------------------------------------------------------- versions

    def mark_written(self, pages, version: str) -> None:
        """Records that `version`'s weights wrote these pages."""
        for page in pages:
            self.page_versions[int(page)] = version

    def stale_pages(self, seq_id: str, kv_len: int, version: str) -> list:
        """Pages among a sequence's first `kv_len` cached tokens written by other weights (its
        host-pool pages as 'host:<page>')."""
        num_host = self.num_host_pages(seq_id)
        table = self.block_table(seq_id)[num_host:pages_for(kv_len, self.page_size)]
        stale = [p for p in table if self.page_versions.get(p) != version]
        return stale + [f"host:{p}" for p in self.host_table(seq_id).tolist()
                        if self._host_versions.get(p) != version]

    def check_fresh(self, seq_id: str, kv_len: int, version: str) -> None:
        """Raises (and counts) if the sequence would read a page written under other weights."""
        stale = self.stale_pages(seq_id, kv_len, version)
        if stale:
            self.stats["stale_kv_reads"] += len(stale)
            raise RuntimeError(
                f"stale KV: sequence {seq_id!r} (weights {version!r}) would read pages "
                f"{stale[:4]} written under {[self.page_versions.get(p) for p in stale[:4]]}")

    # ----------------------------------------------------------------------------- tiers

    def spill_evictions(self) -> None:
        """Copies cached pages evicted since the last call out to the tiers; runs before anything
        writes to those pages (copies, scrubs, loads, the step)."""
        if self.tiers is None or not self.has_prefix_cache:
            return
        evicted = self.allocator.drain_evictions()
        if evicted:
            self._read(KVOp(KVOpKind.SPILL, tuple(p for _, p in evicted)),
                             lambda kv: self.tiers.spill(kv, evicted))
        self._sync_tier_stats()

    def poll_tiers(self, owner: str | None = None) -> list:
        """Advances tier transfers (only `owner`'s, if given); returns the finished loads."""
        if self.tiers is None:
            return []
        self.spill_evictions()
        results = []

        def poll(kv):
            kv, done = self.tiers.poll(kv, owner=owner)
            results.extend(done)
            return kv

        self._apply(KVOp(KVOpKind.POLL), poll)
        self._sync_tier_stats()
        return results

    def _sync_tier_stats(self) -> None:
        for key in ("bytes_device_to_host", "bytes_host_to_device", "bytes_host_to_disk",
                    "bytes_disk_to_host"):
            self.stats[key] = self.tiers.stats[key]

    # ----------------------------------------------------------------------------- warm-up

    def warmup(self, block_table_width: int, *, swap: bool, max_copies: int = 0,
               max_chunk_tokens: int = 0, demote_bits: tuple[int, ...] = ()) -> None:
        """Compiles the tier, retention, swap and scrub programs on padding inputs, the
        copy-on-write programs for up to `max_copies` copies in one step (page 0 onto itself,
        which changes nothing) and the chunk copies of up to `max_chunk_tokens` tokens."""
        idle = [KVOp(KVOpKind.COPY, src=(0,) * n, dst=(0,) * n)
                for n in (geometric_buckets(1, next_power_of_2(max_copies), 2)
                          if max_copies else ())]
        idle += [KVOp(KVOpKind.COMPACT, plan=plan) for plan in self.retention.warmup_plans()]
        n = 1
        while max_chunk_tokens and n <= next_power_of_2(max_chunk_tokens):  # writing nothing
            idle.append(KVOp(KVOpKind.CHUNK_LOAD, plan=ChunkLoadPlan.padded(
                [], 0, [-1] * n, 0, 1.0, page_size=self.page_size)))
            n *= 2
        for op in idle:
            self._apply(KVOp(KVOpKind.WARMUP), lambda kv, op=op: self.device.run_op(kv, op))
        if self.tiers is not None:
            self._apply(KVOp(KVOpKind.WARMUP), self.tiers.warmup)
        self._apply(KVOp(KVOpKind.WARMUP), lambda kv: self.swap_space.warmup(
            kv, block_table_width, swap=swap, scrub=self.scrub_freed_pages,
            demote_bits=demote_bits))


def _padded(pages: Sequence[int]) -> tuple[int, ...]:
    """Pages padded to a power of two by repeating the last (a repeated copy is harmless)."""
    return tuple(pad_repeat_last(list(pages)).tolist())
