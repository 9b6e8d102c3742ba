"""BlockManager against a brute-force model of refcounts and of the KV each page holds.

The model simulates the device: a KV cell at position p of a sequence is identified by
(cache_key, tokens[:p + 1]), which is what the real KV at p depends on. Every sequence must read
back exactly its own cells, whatever sharing, copy-on-write, eviction and prefix hits happened.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvjax.memory.block_manager import AllocStatus, BlockManager, CopyOp

_KEYS = (b"tenant-a", b"tenant-b")
_MAX_TOKENS = 24
_MAX_SEQS = 4  # live sequences; few, so pages are freed and evicted often
# Prompts are prefixes of two documents plus a random tail, so prefixes collide often.
_DOCUMENTS = ((0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1), (1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 1, 0))
_bits = st.integers(0, 1)


@dataclasses.dataclass
class _ModelSeq:
    key: bytes
    tokens: list[int]  # the tokens whose KV the sequence means to hold
    num_written: int  # positions [0, num_written) hold this sequence's KV on the device
    num_committed: int


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_pages=st.integers(2, 16),
        page_size=st.integers(1, 4),
        enable_prefix_cache=st.booleans(),
    )
    def setup(self, num_pages, page_size, enable_prefix_cache):
        self.bm = BlockManager(num_pages, page_size, enable_prefix_cache=enable_prefix_cache)
        self.page_size = page_size
        self.seqs: dict[int, _ModelSeq] = {}
        self.ref_counts = collections.Counter()
        # Unreferenced cached pages, least recently released first.
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.content = {page: [None] * page_size for page in range(num_pages)}
        self.next_id = 0
        self.next_reset_id = 4

    # Helpers.

    def _cell(self, seq: _ModelSeq, position: int):
        return (seq.key, tuple(seq.tokens[: position + 1]))

    def _indexed(self, page: int) -> bool:
        return self.bm.prefix_cache is not None and self.bm.prefix_cache.is_indexed(page)

    def _evictable(self, page: int) -> bool:
        return self.bm.prefix_cache is not None and self.bm.prefix_cache.is_evictable(page)

    def _indexed_contents(self) -> set:
        return {tuple(self.content[p]) for p in range(self.bm.num_pages) if self._indexed(p)}

    def _draw_seq(self, data, predicate=lambda seq: True) -> int:
        return data.draw(st.sampled_from(sorted(i for i, s in self.seqs.items() if predicate(s))))

    def _release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0 and self._indexed(page):
            self.lru[page] = None

    def _tables(self) -> dict[int, list[int]]:
        return {seq_id: self.bm.block_table(seq_id) for seq_id in self.seqs}

    def _write(self, seq_id: int, start: int, end: int, tokens: list[int]) -> bool:
        """Asks for [start, end), checks the allocation against the model, simulates the device."""
        seq = self.seqs[seq_id]
        old_table = self.bm.block_table(seq_id)
        tables_before = self._tables()
        num_free_before = self.bm.num_free_pages()
        num_free_list_before = len(self.bm._free_pages)
        evictions_before = self.bm.stats.evictions
        num_pages_after = -(-end // self.page_size)
        touched = range(start // self.page_size, min(num_pages_after, len(old_table)))
        shared = [
            i for i in touched if self.ref_counts[old_table[i]] > 1 or self._indexed(old_table[i])
        ]
        num_new = max(0, num_pages_after - len(old_table))
        if start == seq.num_written:
            assert self.bm.pages_needed(seq_id, end) == len(shared) + num_new

        status, copies = self.bm.ensure_writable(seq_id, start, end)

        if status is AllocStatus.NO_PAGES:
            assert len(shared) + num_new > num_free_before
            assert copies == []
            assert self._tables() == tables_before
            assert self.bm.num_free_pages() == num_free_before
            return False
        assert status is AllocStatus.OK
        table = self.bm.block_table(seq_id)
        assert len(table) == max(len(old_table), num_pages_after)
        assert [c.src for c in copies] == [old_table[i] for i in shared]
        assert [table[i] for i in shared] == [c.dst for c in copies]
        assert all(table[i] == old_table[i] for i in range(len(old_table)) if i not in shared)
        fresh = [c.dst for c in copies] + table[len(old_table) :]
        assert len(set(fresh)) == len(fresh)
        assert all(self.ref_counts[p] == 0 for p in fresh)
        assert not {c.src for c in copies} & set(fresh)
        # The free list goes first, then cached pages, least recently released first.
        evicted = fresh[num_free_list_before:]
        assert evicted == list(self.lru)[: len(evicted)]
        assert self.bm.stats.evictions - evictions_before == len(evicted)

        for page in evicted:
            del self.lru[page]
        for page in fresh:
            self.ref_counts[page] += 1
        for copy in copies:
            self.content[copy.dst] = list(self.content[copy.src])
            self._release(copy.src)
        seq.tokens = tokens
        for position in range(start, end):
            page = table[position // self.page_size]
            # Copy-on-write: nobody else can read a page this sequence writes into.
            assert self.ref_counts[page] == 1 and not self._indexed(page)
            self.content[page][position % self.page_size] = self._cell(seq, position)
        seq.num_written = end
        return True

    # Rules.

    # Rules draw their arguments from `data`, so the draws can depend on the model's state.

    @precondition(lambda self: len(self.seqs) < _MAX_SEQS)
    @rule(data=st.data())
    def add_sequence(self, data):
        document = data.draw(st.sampled_from(_DOCUMENTS))
        # Drawn as a distance from the end, so the shrinker favours long shared prefixes.
        prompt = list(document[: len(document) - data.draw(st.integers(0, len(document)))])
        prompt += data.draw(st.lists(_bits, min_size=0 if prompt else 1, max_size=3))
        seq_id = self._add(prompt, data.draw(st.sampled_from(_KEYS)))
        if data.draw(st.booleans()):
            self._step(seq_id, self.seqs[seq_id].num_written, len(prompt), prompt, commit=True)

    def _add(self, prompt: list[int], key: bytes) -> int:
        seq = _ModelSeq(key=key, tokens=prompt, num_written=0, num_committed=0)
        expected_pages = 0
        if self.bm.prefix_cache is not None:
            indexed = self._indexed_contents()
            for i in range((len(prompt) - 1) // self.page_size):
                cells = range(i * self.page_size, (i + 1) * self.page_size)
                if tuple(self._cell(seq, p) for p in cells) not in indexed:
                    break
                expected_pages += 1
        assert self.bm.peek_cached_tokens(prompt, cache_key=key) == expected_pages * self.page_size
        stats_before = self.bm.stats
        seq_id = self.next_id
        self.next_id += 1

        num_cached = self.bm.add_sequence(seq_id, prompt, cache_key=key)

        assert num_cached == expected_pages * self.page_size < len(prompt)
        assert self.bm.num_tokens_cached(seq_id) == num_cached
        table = self.bm.block_table(seq_id)
        assert len(table) == expected_pages
        for page in table:
            self.lru.pop(page, None)
            self.ref_counts[page] += 1
        stats = self.bm.stats
        if self.bm.prefix_cache is not None:
            assert stats.prefix_queries == stats_before.prefix_queries + 1
            assert stats.prefix_hits == stats_before.prefix_hits + expected_pages
            assert stats.prefix_hit_tokens == stats_before.prefix_hit_tokens + num_cached
        seq.num_written = seq.num_committed = num_cached
        self.seqs[seq_id] = seq
        with pytest.raises(ValueError, match="already registered"):
            self.bm.add_sequence(seq_id, prompt, cache_key=key)
        return seq_id

    @precondition(lambda self: any(s.num_written < _MAX_TOKENS for s in self.seqs.values()))
    @rule(data=st.data())
    def write(self, data):
        """Prefills a chunk of the prompt (most often all of it) or decodes a few tokens."""
        seq_id = self._draw_seq(data, lambda s: s.num_written < _MAX_TOKENS)
        seq = self.seqs[seq_id]
        start = seq.num_written
        num_prompt_left = len(seq.tokens) - start
        if num_prompt_left > 0:
            end = len(seq.tokens) - data.draw(st.integers(0, num_prompt_left - 1))
            tokens = seq.tokens
        else:
            end = min(start + data.draw(st.integers(1, 3)), _MAX_TOKENS)
            tokens = seq.tokens + data.draw(
                st.lists(_bits, min_size=end - start, max_size=end - start)
            )
        self._step(seq_id, start, end, tokens, commit=data.draw(st.booleans()))

    def _step(self, seq_id: int, start: int, end: int, tokens: list[int], commit: bool) -> None:
        """One engine step for one sequence: write, maybe commit; preempt on NO_PAGES."""
        if not self._write(seq_id, start, end, tokens):
            # The scheduler preempts the sequence and later recomputes it from its tokens.
            key = self.seqs[seq_id].key
            self._free(seq_id)
            self._add(tokens, key)
        elif commit:
            self._commit(seq_id)

    @precondition(lambda self: any(seq.num_written for seq in self.seqs.values()))
    @rule(data=st.data())
    def rewind(self, data):
        """Rewrites a suffix with other tokens, as a rejected speculative draft does."""
        seq_id = self._draw_seq(data, lambda s: s.num_written > 0)
        seq = self.seqs[seq_id]
        start = data.draw(st.integers(0, seq.num_written - 1))
        new_tokens = data.draw(st.lists(_bits, min_size=1, max_size=4))
        if self._write(seq_id, start, start + len(new_tokens), seq.tokens[:start] + new_tokens):
            seq.num_committed = min(seq.num_committed, start)

    @precondition(lambda self: any(s.num_written > 0 for s in self.seqs.values()))
    @rule(data=st.data())
    def truncate(self, data):
        """Drops a suffix after a speculative verify step (num_written may exceed what the
        sequence keeps): the pages past the kept tokens are released, tail first."""
        seq_id = self._draw_seq(data, lambda s: s.num_written > 0)
        seq = self.seqs[seq_id]
        keep = data.draw(st.integers(max(seq.num_committed, 0), seq.num_written))
        table = self.bm.block_table(seq_id)
        freed = self.bm.truncate(seq_id, keep)
        num_pages = -(-keep // self.page_size)
        assert self.bm.block_table(seq_id) == table[:num_pages]
        for page in reversed(table[num_pages:]):
            self._release(page)
        expected = {p for p in table[num_pages:] if self.ref_counts[p] == 0
                    and not self._indexed(p)}
        assert sorted(freed) == sorted(expected)
        seq.num_written = keep
        seq.tokens = seq.tokens[:keep]
        assert self.bm.pages_needed(seq_id, keep) == 0
        with pytest.raises(ValueError, match="truncate"):
            self.bm.truncate(seq_id, keep + 1)

    @precondition(lambda self: any(s.num_written > s.num_committed for s in self.seqs.values()))
    @rule(data=st.data())
    def commit(self, data):
        self._commit(self._draw_seq(data, lambda s: s.num_written > s.num_committed))

    def _commit(self, seq_id: int) -> None:
        seq = self.seqs[seq_id]
        num_tokens = seq.num_written
        tables_before = self._tables()
        num_free_before = self.bm.num_free_pages()

        self.bm.commit(seq_id, seq.tokens[:num_tokens])

        assert self._tables() == tables_before
        assert self.bm.num_free_pages() == num_free_before
        if self.bm.prefix_cache is not None:
            table = tables_before[seq_id]
            indexed = self._indexed_contents()
            for i in range(seq.num_committed // self.page_size, num_tokens // self.page_size):
                assert tuple(self.content[table[i]]) in indexed
        seq.num_committed = num_tokens

    @precondition(lambda self: 0 < len(self.seqs) < _MAX_SEQS)
    @rule(data=st.data())
    def fork(self, data):
        parent_id = self._draw_seq(data)
        child_id = self.next_id
        self.next_id += 1
        self.bm.fork(parent_id, child_id)
        table = self.bm.block_table(child_id)
        assert table == self.bm.block_table(parent_id)
        for page in table:
            self.ref_counts[page] += 1
        self.seqs[child_id] = dataclasses.replace(
            self.seqs[parent_id], tokens=list(self.seqs[parent_id].tokens)
        )
        with pytest.raises(ValueError, match="already registered"):
            self.bm.fork(parent_id, child_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        self._free(self._draw_seq(data))

    def _free(self, seq_id: int) -> None:
        table = self.bm.block_table(seq_id)
        freed = self.bm.free(seq_id)
        del self.seqs[seq_id]
        # Tail first: the prefix pages stay cached longest.
        for page in reversed(table):
            self._release(page)
        expected = {p for p in table if self.ref_counts[p] == 0 and not self._indexed(p)}
        assert sorted(freed) == sorted(expected)
        assert not self.bm.has_sequence(seq_id)
        for method, args in (
            (self.bm.free, ()),
            (self.bm.block_table, ()),
            (self.bm.ensure_writable, (0, 1)),
            (self.bm.commit, ([],)),
            (self.bm.pages_needed, (1,)),
        ):
            with pytest.raises(ValueError, match="unknown sequence"):
                method(seq_id, *args)

    @precondition(lambda self: self.next_id >= self.next_reset_id)
    @rule(data=st.data())
    def reset_prefix_cache(self, data):
        """Rare (once per 4 new sequences), so the cache has time to fill between resets."""
        self.next_reset_id = self.next_id + 4
        num_free_before = self.bm.num_free_pages()
        self.bm.reset_prefix_cache()
        self.lru.clear()
        assert self.bm.num_free_pages() == num_free_before
        assert not any(self._indexed(p) for p in range(self.bm.num_pages))

    # Invariants.

    @invariant()
    def each_sequence_reads_its_own_kv(self):
        for seq_id, seq in self.seqs.items():
            table = self.bm.block_table(seq_id)
            assert len(set(table)) == len(table)
            for position in range(seq.num_written):
                page = table[position // self.page_size]
                assert self.content[page][position % self.page_size] == self._cell(seq, position)

    @invariant()
    def refcounts_match_block_tables(self):
        holders = collections.Counter(p for table in self._tables().values() for p in table)
        for page in range(self.bm.num_pages):
            assert self.bm.ref_count(page) == holders[page] == self.ref_counts[page]

    @invariant()
    def every_page_is_free_used_or_evictable(self):
        free = list(self.bm._free_pages)
        assert len(set(free)) == len(free)
        used = {p for p in range(self.bm.num_pages) if self.ref_counts[p] > 0}
        evictable = {p for p in range(self.bm.num_pages) if self._evictable(p)}
        assert evictable == set(self.lru)
        assert set(free).isdisjoint(used) and set(free).isdisjoint(evictable)
        assert used.isdisjoint(evictable)
        assert set(free) | used | evictable == set(range(self.bm.num_pages))
        assert self.bm.num_used_pages() == len(used)
        assert self.bm.num_free_pages() == len(free) + len(evictable)
        assert self.bm.num_free_pages() + self.bm.num_used_pages() == self.bm.num_pages

    @invariant()
    def cached_pages_are_full_and_unique(self):
        indexed = [p for p in range(self.bm.num_pages) if self._indexed(p)]
        contents = [tuple(self.content[p]) for p in indexed]
        assert all(None not in content for content in contents)
        assert len(set(contents)) == len(contents)

    @invariant()
    def tenants_share_no_page(self):
        tables = self._tables()
        for a in self.seqs:
            for b in self.seqs:
                if self.seqs[a].key != self.seqs[b].key:
                    assert set(tables[a]).isdisjoint(tables[b])


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)
TestBlockManagerStateMachine = BlockManagerMachine.TestCase


# Unit tests.


def _write_and_commit(bm: BlockManager, seq_id, tokens, cache_key=b""):
    status, copies = bm.ensure_writable(seq_id, bm.num_tokens_cached(seq_id), len(tokens))
    assert status is AllocStatus.OK and copies == []
    bm.commit(seq_id, tokens)


def test_prefix_hit_attaches_shared_pages_and_counts_stats():
    bm = BlockManager(num_pages=8, page_size=4)
    prompt = list(range(10))
    assert bm.add_sequence("a", prompt) == 0
    _write_and_commit(bm, "a", prompt)
    table_a = bm.block_table("a")
    assert bm.peek_cached_tokens(prompt + [99]) == 8
    assert bm.stats.prefix_queries == 1 and bm.ref_count(table_a[0]) == 1

    assert bm.add_sequence("b", prompt + [99]) == 8
    assert bm.block_table("b") == table_a[:2]
    assert [bm.ref_count(p) for p in table_a] == [2, 2, 1]
    stats = bm.stats
    assert (stats.prefix_queries, stats.prefix_hits, stats.prefix_hit_tokens) == (2, 2, 8)
    assert stats.prefix_query_tokens == 21
    assert stats.prefix_hit_rate == pytest.approx(8 / 21)


def test_last_page_hash_is_the_hash_the_page_is_indexed_under_once_committed():
    """What a waiting prompt compares against a page still being computed: before the page
    is committed, the hash the prefix cache then indexes it under (and another key's differs)."""
    bm = BlockManager(num_pages=8, page_size=4)
    prompt = list(range(10))
    bm.add_sequence("a", prompt, cache_key=b"k")
    bm.add_sequence("b", prompt, cache_key=b"other")
    _write_and_commit(bm, "a", prompt[:4])
    assert bm.ensure_writable("a", 4, 8) == (AllocStatus.OK, [])
    computing = bm.last_page_hash("a", prompt[:8])  # its second page, not yet committed
    bm.commit("a", prompt[:8])
    assert computing == bm.prefix_cache.hash_of(bm.block_table("a")[1])
    assert bm.last_page_hash("b", prompt[:8]) != computing
    assert bm.last_page_hash("a", prompt[:3]) is None  # no full page
    plain = BlockManager(num_pages=8, page_size=4, enable_prefix_cache=False)
    plain.add_sequence("a", prompt)
    assert plain.last_page_hash("a", prompt[:8]) is None  # nothing is ever indexed


def test_prefix_hit_leaves_the_last_prompt_token_to_recompute():
    bm = BlockManager(num_pages=8, page_size=4)
    prompt = list(range(8))
    bm.add_sequence("a", prompt)
    _write_and_commit(bm, "a", prompt)
    assert bm.add_sequence("b", prompt) == 4
    assert bm.add_sequence("c", prompt[:4]) == 0


def test_prefix_hit_needs_equal_cache_key_and_full_prefix():
    bm = BlockManager(num_pages=8, page_size=2)
    prompt = [1, 2, 3, 4, 5]
    bm.add_sequence("a", prompt, cache_key=b"tenant-a")
    _write_and_commit(bm, "a", prompt)
    assert bm.add_sequence("b", prompt, cache_key=b"tenant-b") == 0
    # Same second page, different first page: the chain makes it a miss.
    assert bm.add_sequence("c", [9, 9, 3, 4, 5], cache_key=b"tenant-a") == 0
    assert bm.add_sequence("d", [1, 2, 9, 9, 5], cache_key=b"tenant-a") == 2


def test_disabled_prefix_cache_never_hits_and_frees_every_page():
    bm = BlockManager(num_pages=4, page_size=2, enable_prefix_cache=False)
    prompt = [1, 2, 3, 4, 5]
    bm.add_sequence("a", prompt)
    _write_and_commit(bm, "a", prompt)
    assert bm.add_sequence("b", prompt) == 0
    assert sorted(bm.free("a")) == [0, 1, 2]
    assert bm.stats.prefix_queries == 0


def test_eviction_takes_free_pages_first_then_lru_tail_first():
    bm = BlockManager(num_pages=6, page_size=2)
    first, second = [1, 1, 2, 2, 3], [4, 4, 5, 5, 6]
    for seq_id, prompt in (("a", first), ("b", second)):
        bm.add_sequence(seq_id, prompt)
        _write_and_commit(bm, seq_id, prompt)
    table_a, table_b = bm.block_table("a"), bm.block_table("b")
    # The partial tail pages are not cached: they go back to the free list.
    assert bm.free("a") == [table_a[2]]
    assert bm.free("b") == [table_b[2]]
    assert bm.num_free_pages() == 6

    bm.add_sequence("c", [7])
    assert bm.ensure_writable("c", 0, 12) == (AllocStatus.OK, [])
    # Free pages first, then a's cached pages tail first, then b's.
    assert bm.block_table("c") == [
        table_a[2],
        table_b[2],
        table_a[1],
        table_a[0],
        table_b[1],
        table_b[0],
    ]
    assert bm.stats.evictions == 4


def test_prefix_hit_refreshes_lru_position():
    bm = BlockManager(num_pages=4, page_size=2)
    for seq_id, prompt in (("a", [1, 1, 0]), ("b", [2, 2, 0])):
        bm.add_sequence(seq_id, prompt)
        _write_and_commit(bm, seq_id, prompt)
    page_a, page_b = bm.block_table("a")[0], bm.block_table("b")[0]
    bm.free("a")
    bm.free("b")
    assert bm.add_sequence("a2", [1, 1, 5]) == 2
    bm.free("a2")  # a's page is now the most recently released.
    bm.add_sequence("c", [3])
    assert bm.ensure_writable("c", 0, 6)[0] is AllocStatus.OK
    assert bm.block_table("c")[-1] == page_b
    assert bm.prefix_cache.is_evictable(page_a)


def test_kept_cached_pages_are_evicted_last_in_the_order_named():
    """A controller's keep list overrides LRU for the pages it names; every cached page
    reports its reuses, release time and depth in its chain."""
    times = iter(range(100))
    bm = BlockManager(num_pages=5, page_size=2)
    bm.clock = lambda: float(next(times))
    for seq_id, prompt in (("a", [1, 1, 2, 2, 0]), ("b", [3, 3, 0])):
        bm.add_sequence(seq_id, prompt)
        _write_and_commit(bm, seq_id, prompt)
    a0, a1 = bm.block_table("a")[:2]
    (b0,) = bm.block_table("b")[:1]
    bm.free("a")
    bm.free("b")
    assert bm.add_sequence("a2", [1, 1, 2, 2, 9]) == 4  # reuses a's two pages
    bm.free("a2")
    cached = {c.page: c for c in bm.cached_pages()}
    assert (cached[a0].hits, cached[a1].hits, cached[b0].hits) == (1, 1, 0)
    assert (cached[a0].depth, cached[a1].depth, cached[b0].depth) == (0, 1, 0)
    assert cached[a0].released_at > cached[b0].released_at  # released again by a2
    # LRU would evict b0 first, then a1, a0; keeping [a0, b0] leaves a1 first, then a0, b0.
    bm.keep_cached([a0, b0])
    bm.add_sequence("c", [7])
    assert bm.ensure_writable("c", 0, 10)[0] is AllocStatus.OK
    assert bm.block_table("c")[-3:] == [a1, a0, b0]
    assert bm.stats.evictions == 3 and bm.cached_pages() == []


def test_referenced_cached_page_is_never_evicted():
    bm = BlockManager(num_pages=3, page_size=2)
    bm.add_sequence("a", [1, 2, 3])
    _write_and_commit(bm, "a", [1, 2, 3])
    bm.add_sequence("b", [7])
    assert bm.ensure_writable("b", 0, 2)[0] is AllocStatus.OK
    assert bm.num_free_pages() == 0
    assert bm.ensure_writable("b", 2, 3) == (AllocStatus.NO_PAGES, [])
    assert bm.stats.evictions == 0


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_pages=4, page_size=2)
    bm.add_sequence("a", [1, 2, 3])
    assert bm.ensure_writable("a", 0, 3)[0] is AllocStatus.OK
    bm.fork("a", "b")
    table = bm.block_table("a")
    # Needs 2 new pages plus a copy of the shared tail; only 2 are free.
    assert bm.pages_needed("a", 8) == 3
    assert bm.ensure_writable("a", 3, 8) == (AllocStatus.NO_PAGES, [])
    assert bm.block_table("a") == bm.block_table("b") == table
    assert bm.num_free_pages() == 2
    assert [bm.ref_count(p) for p in table] == [2, 2]
    status, copies = bm.ensure_writable("a", 3, 4)
    assert status is AllocStatus.OK
    assert copies == [CopyOp(src=table[1], dst=bm.block_table("a")[1])]


def test_copy_on_write_after_fork_gives_the_writer_a_private_page():
    bm = BlockManager(num_pages=4, page_size=4)
    bm.add_sequence("parent", [1, 2, 3, 4, 5, 6])
    bm.ensure_writable("parent", 0, 6)
    bm.fork("parent", "child")
    shared_tail = bm.block_table("parent")[1]
    status, copies = bm.ensure_writable("child", 6, 7)
    assert status is AllocStatus.OK
    new_tail = bm.block_table("child")[1]
    assert copies == [CopyOp(src=shared_tail, dst=new_tail)]
    assert new_tail != shared_tail and bm.block_table("parent")[1] == shared_tail
    assert bm.ref_count(shared_tail) == bm.ref_count(new_tail) == 1
    # The full first page is still shared; the parent now writes its tail in place.
    assert bm.ensure_writable("parent", 6, 7) == (AllocStatus.OK, [])
    assert bm.ref_count(bm.block_table("parent")[0]) == 2


def test_rewriting_a_cached_page_copies_it():
    bm = BlockManager(num_pages=4, page_size=2)
    bm.add_sequence("a", [1, 2, 3])
    _write_and_commit(bm, "a", [1, 2, 3])
    cached = bm.block_table("a")[0]
    status, copies = bm.ensure_writable("a", 1, 2)
    assert status is AllocStatus.OK
    assert copies == [CopyOp(src=cached, dst=bm.block_table("a")[0])]
    assert bm.prefix_cache.is_evictable(cached)


def test_reset_prefix_cache_returns_unreferenced_pages_to_the_free_list():
    bm = BlockManager(num_pages=6, page_size=2)
    for seq_id, prompt in (("a", [7, 7, 8]), ("b", [1, 2, 3, 4, 5]), ("c", [1, 2, 3, 4, 5])):
        bm.add_sequence(seq_id, prompt)
        _write_and_commit(bm, seq_id, prompt)
    bm.free("a")
    evictable = bm.block_table("b")[0]
    assert bm.prefix_cache.is_evictable(bm.block_table("c")[0]) is False
    cached_a = [p for p in range(6) if bm.prefix_cache.is_evictable(p)]
    assert len(cached_a) == 1 and evictable not in cached_a
    num_free = bm.num_free_pages()

    bm.reset_prefix_cache()

    assert bm.prefix_cache.num_indexed() == 0
    assert bm.num_free_pages() == num_free
    assert bm.add_sequence("d", [7, 7, 8]) == 0
    assert bm.add_sequence("e", [1, 2, 3, 4, 5]) == 0
    # b's and c's shared pages are no longer cached: the last release frees them.
    table_b, table_c = bm.block_table("b"), bm.block_table("c")
    assert bm.free("b") == [table_b[2]]
    assert sorted(bm.free("c")) == sorted(table_c)


def test_invalid_arguments_raise_value_error():
    with pytest.raises(ValueError, match="num_pages"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="page_size"):
        BlockManager(4, 0)
    bm = BlockManager(4, 2)
    with pytest.raises(ValueError, match="empty prompt"):
        bm.add_sequence("a", [])
    bm.add_sequence("a", [1])
    with pytest.raises(ValueError, match="already registered"):
        bm.add_sequence("a", [1])
    with pytest.raises(ValueError, match="start=2, end=1"):
        bm.ensure_writable("a", 2, 1)
    with pytest.raises(ValueError, match="pages for 0"):
        bm.commit("a", [1])
    with pytest.raises(ValueError, match="unknown sequence 'z'"):
        bm.fork("z", "y")
    with pytest.raises(ValueError, match="unknown sequence 'z'"):
        bm.num_tokens_cached("z")
    with pytest.raises(ValueError, match="page 4"):
        bm.ref_count(4)
