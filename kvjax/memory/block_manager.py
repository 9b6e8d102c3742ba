"""Host-side allocator of KV pages: block tables, reference counts, copy-on-write, prefix sharing.

Every page is in exactly one of three states:

- free: on the free list, content meaningless;
- in use: referenced by the block table of at least one sequence (refcount > 0);
- cached: indexed by the prefix cache and referenced by nobody, so evictable (LRU, after
  pages a caller keeps: `keep_cached`).

An indexed page may also be in use; it is then shared through the cache and never evicted. A
page that is indexed or referenced by several sequences is read-only: a write into it first
copies it into a private page (copy-on-write), and the engine performs the returned `CopyOp`s on
the device before it writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from kvjax.delegation import delegate, delegate_attribute
from kvjax.memory.page_pool import FreeList as FreeList  # re-exported for its importers
from kvjax.memory.page_pool import PagePool, PageSource
from kvjax.memory.prefix_cache import (
    PrefixCache,
    PrefixEviction,
    hash_page,
    hash_root,
    page_hash_chain,
)
from kvjax.memory.table_edits import RELEASED as RELEASED  # re-exported for its importers
from kvjax.memory.table_edits import AllocStatus as AllocStatus
from kvjax.memory.table_edits import SeqPages, TableEdits


@dataclasses.dataclass(frozen=True)
class CopyOp:
    """Copy-on-write: the device copies page `src` into page `dst` before writing into `dst`."""

    src: int
    dst: int


def hit_limit(token_ids: Sequence[int], max_hit: int | None) -> int:
    """The most leading tokens a prefix hit may cover: all but the last (whose logits the
    model must produce), and at most `max_hit` when given."""
    limit = len(token_ids) - 1
    return limit if max_hit is None else max(0, min(limit, max_hit))


@dataclasses.dataclass(frozen=True)
class BlockManagerStats:
    """Counters since construction.

    Attributes:
        prefix_queries: prompts looked up in the prefix cache.
        prefix_query_tokens: tokens of those prompts.
        prefix_hits: pages attached from the prefix cache.
        prefix_hit_tokens: tokens covered by those pages (prefix_hits * P).
        evictions: cached pages evicted to satisfy an allocation.
    """

    prefix_queries: int = 0
    prefix_query_tokens: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the cache (0 before any lookup)."""
        if self.prefix_query_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens


class BlockManager:
    """Allocates pages of P tokens to sequences and shares full pages through a prefix cache.

    With a `window` (the pages of a sliding-window layer group), a sequence needs only the
    pages of its last `window` tokens before the position it computes next: `release_before`
    gives the older ones back (their block-table entries become RELEASED), and a prefix hit
    needs only the cached pages of the window before the hit's end (`best_hit`).

    Attributes:
        num_pages: pages in the device KV pool.
        page_size: P, tokens per page.
        window: the sliding window in tokens, 0 when every token is kept.
        prefix_cache: the index of full pages, or None when prefix caching is disabled.
    """

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_cache: bool = True,
                 pages: PageSource | None = None,
                 prefix_eviction: PrefixEviction = PrefixEviction.LRU, window: int = 0):
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an int >= 0, got {window!r}")
        self.window = window
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = (PrefixCache(page_size, prefix_eviction) if enable_prefix_cache
                             else None)
        self.pool = PagePool(num_pages, pages, self.prefix_cache)
        self._free_pages = self.pool.free_pages  # the same PageSource, read by the tests
        self._seqs: dict[Hashable, SeqPages] = {}
        self.edits = TableEdits(self.pool, page_size, self._get)
        self._stats = BlockManagerStats()

    @property
    def stats(self) -> BlockManagerStats:
        return dataclasses.replace(self._stats, evictions=self.pool.num_evictions)

    @property
    def capacity(self) -> int:
        """The most pages this manager can hold at once: num_pages, or its share of a pool
        it shares with other engines (the watermark's reserve is a fraction of it)."""
        return self.pool.capacity()

    tracer = delegate_attribute(
        "pool", "tracer", "Where page allocations, frees and evictions are reported (a Tracer).")
    clock = delegate_attribute("pool", "clock", "When cached pages are released (a clock).")

    num_free_pages = delegate("pool", PagePool.num_free_pages)
    num_used_pages = delegate("pool", PagePool.num_used_pages)
    ref_count = delegate("pool", PagePool.ref_count)
    reset_prefix_cache = delegate("pool", PagePool.reset_prefix_cache)
    record_evictions = delegate("pool", PagePool.record_evictions)
    drain_evictions = delegate("pool", PagePool.drain_evictions)
    cached_pages = delegate("pool", PagePool.cached_pages)
    keep_cached = delegate("pool", PagePool.keep_cached)
    num_givable_pages = delegate("pool", PagePool.num_givable_pages)
    give_back_cached = delegate("pool", PagePool.give_back_cached)
    retain = delegate("edits", TableEdits.retain)
    pages_to_retain = delegate("edits", TableEdits.pages_to_retain)
    truncate = delegate("edits", TableEdits.truncate)
    release_pages = delegate("edits", TableEdits.release_pages)
    fill_pages = delegate("edits", TableEdits.fill_pages)
    writes_in_place = delegate("edits", TableEdits.writes_in_place)
    record_in_place = delegate("edits", TableEdits.record_in_place)

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def seq_slot(self, seq_id: Hashable) -> int:
        """The sequence's per-sequence state slot: 0 (pages are all it holds)."""
        return 0

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The page ids of `seq_id`, [pages_per_seq]; position p lives in page p // P."""
        return list(self._get(seq_id).block_table)

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """Every layer group's table: this manager's one."""
        return [self.block_table(seq_id)]

    def block_table_array(self, seq_id: Hashable) -> np.ndarray:
        """[1, pages_per_seq] int32: `block_tables` as one array."""
        return np.asarray([self._get(seq_id).block_table], np.int32).reshape(1, -1)

    def num_tokens_cached(self, seq_id: Hashable) -> int:
        """Prompt tokens of `seq_id` attached from the prefix cache by add_sequence."""
        return self._get(seq_id).num_cached_tokens

    def peek_cached_tokens(self, token_ids: Sequence[int], *, cache_key: bytes = b"",
                           max_hit: int | None = None) -> int:
        """What add_sequence would return now, without attaching pages or counting a query."""
        if self.prefix_cache is None or len(token_ids) == 0:
            return 0
        return self.best_hit(token_ids, cache_key, hit_limit(token_ids, max_hit))

    def best_hit(self, token_ids: Sequence[int], cache_key: bytes, limit: int) -> int:
        """The most leading tokens of `token_ids` (a multiple of P, at most `limit`) whose
        pages this manager could attach from the prefix cache: every page of them, or with a
        window the pages of the last `window` tokens before the end."""
        if self.prefix_cache is None or limit <= 0:
            return 0
        p = self.page_size
        if not self.window:
            return len(self.prefix_cache.lookup(token_ids[:limit], cache_key)) * p
        found = self.prefix_cache.lookup_each(token_ids[:limit], cache_key)
        for end in range(len(found), 0, -1):  # the longest hit whose window is all cached
            if all(page is not None for page in found[self._first_needed(end * p) // p:end]):
                return end * p
        return 0

    def _first_needed(self, position: int) -> int:
        """The first cached position a query at `position` reads (0 without a window)."""
        return max(0, position - self.window + 1) if self.window else 0

    def add_sequence(
        self, seq_id: Hashable, token_ids: Sequence[int], *, cache_key: bytes = b"",
        indexable: bool = True, record_stats: bool = True, num_cached: int | None = None,
        max_hit: int | None = None,
    ) -> int:
        """Registers a sequence and attaches the cached pages of its prompt's longest prefix.

        Only full pages are shared, and the prompt's last token is always left to recompute so
        the model produces logits for it. Pages are shared only between equal `cache_key`s
        (tenant salt + KV provenance fingerprint). Allocates nothing else.

        Args:
            seq_id: a new sequence id (ValueError if already registered).
            token_ids: the prompt, [S] with S >= 1.
            cache_key: seeds the hash chain.
            indexable: False for a sequence whose pages hold a subset of its tokens (one that
                `retain` compacted, coming back from swap): it neither reads nor feeds the
                prefix cache.
            record_stats: count the lookup in the prefix-cache statistics (False for a
                registration that only holds cached pages, such as a chunk being copied).
            num_cached: attach exactly this many leading tokens (a multiple of P that
                `best_hit` allows: the hit every layer group of a model can take), instead
                of this manager's own best hit.
            max_hit: attach at most this many leading tokens (None: no bound but the last
                token's).

        Returns:
            The number of cached tokens: a multiple of P, and < len(token_ids).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already registered")
        if len(token_ids) == 0:
            raise ValueError(f"sequence {seq_id!r} has an empty prompt")
        if not isinstance(cache_key, bytes):
            raise ValueError(f"cache_key must be bytes, got {type(cache_key).__name__}")
        pages, hashes = [], []
        if self.prefix_cache is not None and indexable:
            if num_cached is None:
                num_cached = self.best_hit(token_ids, cache_key, hit_limit(token_ids, max_hit))
            found = self.prefix_cache.lookup_each(token_ids[:num_cached], cache_key)
            first = self._first_needed(num_cached) // self.page_size
            if len(found) * self.page_size != num_cached or None in found[first:]:
                raise ValueError(f"sequence {seq_id!r}: the prefix cache does not hold the "
                                 f"pages of a {num_cached}-token hit")
            hashes = self.prefix_cache.chain_hashes(token_ids[:num_cached], cache_key)
            pages = [RELEASED] * first + found[first:]
            for page in pages[first:]:
                self.pool.acquire(page)
                if record_stats:
                    self.prefix_cache.record_hit(page)
        num_cached = len(pages) * self.page_size
        if self.prefix_cache is not None and indexable and record_stats:
            self._stats = dataclasses.replace(
                self._stats,
                prefix_queries=self._stats.prefix_queries + 1,
                prefix_query_tokens=self._stats.prefix_query_tokens + len(token_ids),
                prefix_hits=self._stats.prefix_hits + len(pages),
                prefix_hit_tokens=self._stats.prefix_hit_tokens + num_cached,
            )
            if self.tracer.enabled:  # the chain it wanted, for kvjax.bench.trace_report
                wanted = self.prefix_cache.chain_hashes(
                    token_ids[:hit_limit(token_ids, max_hit)], cache_key)
                self.tracer.emit("prefix_lookup", "page", "pages/device", seq_id=str(seq_id),
                                 wanted=[h.hex() for h in wanted], hit_pages=len(pages))
        self._seqs[seq_id] = SeqPages(
            block_table=pages,
            cache_key=cache_key,
            page_hashes=hashes,
            num_tokens=num_cached,
            num_cached_tokens=num_cached,
            is_indexable=indexable,
        )
        return num_cached

    def pages_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Pages (new ones plus copies) for `seq_id` to cover `num_tokens` tokens in all.

        Exactly what `ensure_writable(seq_id, start, num_tokens)` takes, with `start` the
        sequence's current length: the cached prefix after add_sequence, then the `end` of the
        last successful ensure_writable (a rewrite from an earlier position, such as a rejected
        speculative draft, shortens it).
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        start = min(self._get(seq_id).num_tokens, num_tokens)
        return self.pages_to_write(seq_id, start, num_tokens)

    def pages_to_write(self, seq_id: Hashable, start: int, end: int) -> int:
        """Pages (new ones plus copies) `ensure_writable(seq_id, start, end)` would take."""
        cow_indices, num_new = self._plan(self._get(seq_id), start, end)
        return len(cow_indices) + num_new

    def ensure_writable(
        self, seq_id: Hashable, start: int, end: int
    ) -> tuple[AllocStatus, list[CopyOp]]:
        """Makes positions [start, end) of `seq_id` writable before the device writes their KV.

        Appends pages until the sequence covers `end` tokens, and replaces every touched page
        that is shared (held by another sequence or indexed by the prefix cache) with a private
        copy. All-or-nothing: on NO_PAGES nothing changed. Evicts unreferenced cached pages, least
        recently released first, when the free list runs out.

        Returns:
            (status, copies): the device must perform `copies` before writing.
        """
        seq = self._get(seq_id)
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
        cow_indices, num_new = self._plan(seq, start, end)
        if len(cow_indices) + num_new > self.num_free_pages():
            return AllocStatus.NO_PAGES, []
        copies = []
        for index in cow_indices:
            copies.append(CopyOp(src=seq.block_table[index], dst=self.pool.allocate()))
            seq.block_table[index] = copies[-1].dst
        seq.block_table.extend(self.pool.allocate() for _ in range(num_new))
        # Sources are released only now, so none is reallocated as a destination of this call.
        for copy in copies:
            self.pool.release(copy.src)
        if end > start:
            # Positions from `start` on get new content: hashes of the pages they touch are stale.
            del seq.page_hashes[start // self.page_size :]
        seq.num_tokens = end
        return AllocStatus.OK, copies

    def ensure_restored(
        self, seq_id: Hashable, start: int, end: int
    ) -> tuple[AllocStatus, list[CopyOp]]:
        """Makes positions [start, end) of a returning sequence (registered again with its
        cached prefix, its KV coming back from host memory or a snapshot) writable, its next
        query at `end`: with a window only the pages that query reads (`release_returning`,
        `restored_start`), else `ensure_writable(seq_id, start, end)`."""
        self.release_returning(seq_id, end)
        return self.ensure_writable(seq_id, self.restored_start(start, end), end)

    def restored_start(self, start: int, end: int) -> int:
        """Where a returning sequence's pages begin to be written: `start`, or with a window
        the first page a query at `end` reads when that is later."""
        if not self.window:
            return start
        return max(start, self._first_needed(end) // self.page_size * self.page_size)

    def release_returning(self, seq_id: Hashable, end: int) -> list[int]:
        """With a window: a returning sequence's entries before the first page a query at
        `end` reads become RELEASED (its table padded with RELEASED up to there, attached prefix
        pages among them given back). A no-op without a window.

        Returns:
            The pages that went to the free list.
        """
        if not self.window:
            return []
        table = self._get(seq_id).block_table
        table.extend([RELEASED] * (self._first_needed(end) // self.page_size - len(table)))
        return self.release_before(seq_id, end)

    def stop_indexing(self, seq_id: Hashable) -> None:
        """The sequence feeds the prefix cache no more: its pages' rows no longer hold what
        their hashes name (`kvjax.memory.precision.RoundedPages`)."""
        self._get(seq_id).is_indexable = False

    def page_hash(self, seq_id: Hashable, page: int) -> bytes | None:
        """The hash of the sequence's committed `page` (None: not committed, or not indexed)."""
        seq = self._get(seq_id)
        index = seq.block_table.index(page) if page in seq.block_table else len(seq.page_hashes)
        return seq.page_hashes[index] if index < len(seq.page_hashes) else None

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Registers `child_id` sharing every page of `parent_id` (e.g. n > 1 samples)."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already registered")
        for page in parent.block_table:
            if page != RELEASED:
                self.pool.add_ref(page)
        self._seqs[child_id] = dataclasses.replace(
            parent, block_table=list(parent.block_table), page_hashes=list(parent.page_hashes)
        )

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Records that the device wrote the KV of `token_ids`, the sequence's tokens so far.

        Every page that became full is indexed in the prefix cache under the sequence's hash
        chain; when another page already holds the same chain, that one stays indexed. A
        sequence that `retain` compacted indexes nothing (its pages hold a subset of its tokens).
        """
        seq = self._get(seq_id)
        if not seq.is_indexable:
            return
        capacity = len(seq.block_table) * self.page_size
        if len(token_ids) > capacity:
            raise ValueError(
                f"commit of {len(token_ids)} tokens, but sequence {seq_id!r} has pages for "
                f"{capacity}"
            )
        if self.prefix_cache is None:
            return
        root = hash_root(seq.cache_key)
        parent = seq.page_hashes[-1] if seq.page_hashes else root
        for index in range(len(seq.page_hashes), len(token_ids) // self.page_size):
            start = index * self.page_size
            parent = hash_page(parent, token_ids[start : start + self.page_size])
            seq.page_hashes.append(parent)
            page = seq.block_table[index]
            if page != RELEASED and self.prefix_cache.insert(parent, page, index, owner=root):
                self.tracer.emit("index", "page", "pages/device", page=page, hash=parent.hex())

    def release_before(self, seq_id: Hashable, position: int) -> list[int]:
        """With a window: gives back the sequence's pages that no query from `position` on
        reads (every token older than the window before it); their entries become RELEASED.
        A no-op without a window.

        Returns:
            The pages that went to the free list.
        """
        seq = self._get(seq_id)
        if not self.window:
            return []
        freed = []
        for index in range(self._first_needed(position) // self.page_size):
            page = seq.block_table[index]
            if page != RELEASED:
                seq.block_table[index] = RELEASED
                if self.pool.release(page):
                    freed.append(page)
        return freed

    def take_released(self) -> list[int]:
        """Pages windows gave back since the last call: none here (`release_before` returns
        its own; `kvjax.memory.groups.GroupedBlockManager` collects them)."""
        return []

    def num_held_pages(self, seq_id: Hashable) -> int:
        """Pages in the sequence's block table (RELEASED entries not counted)."""
        return sum(page != RELEASED for page in self._get(seq_id).block_table)

    def free(self, seq_id: Hashable) -> list[int]:
        """Drops `seq_id` and releases its pages.

        Pages still referenced elsewhere stay; indexed pages become evictable, tail pages ahead of
        the prefix in the LRU order (evicting a prefix page would strand the pages after it).

        Returns:
            The pages that went to the free list (the engine may scrub them).
        """
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        return [page for page in reversed(seq.block_table)
                if page != RELEASED and self.pool.release(page)]

    def cache_key_of(self, seq_id: Hashable) -> bytes:
        """The cache key `seq_id` was registered with (the seed of its hash chain)."""
        return self._get(seq_id).cache_key

    def last_page_hash(self, seq_id: Hashable, token_ids: Sequence[int]) -> bytes | None:
        """The hash the last full page of the sequence's leading `token_ids` will be indexed
        under (None without a prefix cache, or for a sequence that indexes nothing)."""
        seq, num_pages = self._get(seq_id), len(token_ids) // self.page_size
        if self.prefix_cache is None or not seq.is_indexable or num_pages == 0:
            return None
        return page_hash_chain(token_ids[:num_pages * self.page_size], seq.cache_key,
                               self.page_size, seq.page_hashes[:num_pages])[-1]

    def _get(self, seq_id: Hashable) -> SeqPages:
        if seq_id not in self._seqs:
            raise ValueError(f"unknown sequence {seq_id!r}")
        return self._seqs[seq_id]

    def _plan(self, seq: SeqPages, start: int, end: int) -> tuple[list[int], int]:
        """(indices in the block table to copy on write, number of pages to append)."""
        num_pages_after = -(-end // self.page_size)
        num_new = max(0, num_pages_after - len(seq.block_table))
        if end == start:
            return [], num_new
        touched = range(start // self.page_size, min(num_pages_after, len(seq.block_table)))
        return [i for i in touched if self.pool.is_shared(seq.block_table[i])], num_new
