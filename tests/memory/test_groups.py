"""Two KV layer groups (global + sliding window) drawing pages from one pool, checked after
every operation against a brute-force model of what each group must hold."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax.memory.block_manager import RELEASED, AllocStatus
from kvjax.memory.groups import GroupedBlockManager

P, NUM_PAGES, WINDOWS = 4, 28, (0, 6)
BASES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
         [1, 2, 3, 4, 9, 9, 9, 9, 8, 8, 8, 8, 7, 7])


def first_needed(window: int, position: int) -> int:
    return max(0, position - window + 1) if window else 0


class TwoGroupMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = GroupedBlockManager(NUM_PAGES, P, WINDOWS)
        self.tokens: dict[str, list[int]] = {}  # sequence -> tokens whose KV is written
        self.start: dict[str, int] = {}  # sequence -> position its last write started at
        self.content: dict[tuple[int, int], tuple] = {}  # (group, page) -> tokens up to its end
        self.pending: dict[str, list[int]] = {}  # sequence -> prompt tokens not written yet
        self.count = 0

    def _expected_indices(self, seq: str, group: int) -> set[int]:
        n = len(self.tokens[seq])
        first = first_needed(WINDOWS[group], self.start[seq]) // P
        return set(range(first, -(-n // P)))

    @rule(base=st.sampled_from(BASES), length=st.integers(1, 18), cut=st.integers(0, 3))
    def add(self, base, length, cut):
        prompt = base[:length] + [20 + cut] * cut
        seq = f"s{self.count}"
        self.count += 1
        # The brute-force longest hit: every group holds, indexed, a page with the right
        # content for each page it needs.
        def holds(group, end):
            needed = range(first_needed(WINDOWS[group], end) // P, end // P)
            indexed = {tuple(c) for (g, page), c in self.content.items()
                       if g == group and self.alloc.groups[g].prefix_cache.is_indexed(page)}
            return all(tuple(prompt[:(i + 1) * P]) in indexed for i in needed)
        best = max((end for end in range(0, len(prompt), P)
                    if all(holds(g, end) for g in range(len(WINDOWS)))), default=0)
        hit = self.alloc.add_sequence(seq, prompt)
        assert hit == best
        self.tokens[seq] = prompt[:hit]
        self.start[seq] = hit
        for g, table in enumerate(self.alloc.block_tables(seq)):
            for i, page in enumerate(table):
                if page != RELEASED:  # an attached page holds the prompt's tokens
                    assert self.content[(g, page)] == tuple(prompt[:(i + 1) * P])
        self.pending[seq] = prompt[hit:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 7))
    def write(self, data, k):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        n = len(self.tokens[seq])
        new = self.pending[seq][:k] or [30 + n % 5] * k
        status, copies = self.alloc.ensure_writable(seq, n, n + len(new))
        self.start[seq] = n  # out-of-window pages go back even when the write must wait
        if status is not AllocStatus.OK:
            return
        for c in copies:  # copy-on-write: the destination now holds the source's content
            for g in range(len(WINDOWS)):
                if (g, c.src) in self.content:
                    self.content[(g, c.dst)] = self.content[(g, c.src)]
        self.tokens[seq] += new
        self.pending[seq] = self.pending[seq][len(new):]
        toks = self.tokens[seq]
        for g, table in enumerate(self.alloc.block_tables(seq)):
            for i in range(n // P, len(toks) // P):
                self.content[(g, table[i])] = tuple(toks[:(i + 1) * P])
        self.alloc.commit(seq, toks)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = f"s{self.count}"
        self.count += 1
        self.alloc.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.start[child] = self.start[parent]
        self.pending[child] = list(self.pending[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.alloc.free(seq)
        del self.tokens[seq], self.start[seq]

    @invariant()
    def each_group_holds_what_its_layers_read(self):
        for seq in self.tokens:
            for g, table in enumerate(self.alloc.block_tables(seq)):
                held = {i for i, page in enumerate(table) if page != RELEASED}
                assert held == self._expected_indices(seq, g), (seq, g, table)

    @invariant()
    def nothing_leaks_and_groups_never_share_a_page(self):
        used = [set() for _ in WINDOWS]
        for seq in self.tokens:
            for g, table in enumerate(self.alloc.block_tables(seq)):
                used[g] |= {page for page in table if page != RELEASED}
        cached = [{c.page for c in m.cached_pages()} for m in self.alloc.groups]
        held = [u | c for u, c in zip(used, cached, strict=True)]
        assert not held[0] & held[1]
        free = self.alloc.num_free_pages() - sum(len(c) for c in cached)
        assert len(held[0]) + len(held[1]) + free == NUM_PAGES


TwoGroupMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                             deadline=None)
TestTwoGroups = TwoGroupMachine.TestCase


def test_a_window_group_takes_a_hit_whose_older_pages_were_evicted():
    """A window's pages given back while its sequence ran are the oldest cached pages, so
    memory pressure evicts them first; a later prefix hit still finds what each group needs
    (the global group every page, the window group its last window's page)."""
    alloc = GroupedBlockManager(12, P, (0, 4))
    ticks = iter(range(1000))
    alloc.clock = lambda: next(ticks)
    prompt = list(range(1, 14))  # 13 tokens
    alloc.add_sequence("a", prompt)
    for start, end in ((0, 4), (4, 8), (8, 12), (12, 13)):
        assert alloc.ensure_writable("a", start, end)[0] is AllocStatus.OK
        alloc.commit("a", prompt[:end])
    assert alloc.block_tables("a")[1][:2] == [RELEASED, RELEASED]
    alloc.free("a")
    alloc.add_sequence("b", [50 + i for i in range(13)])
    assert alloc.ensure_writable("b", 0, 13)[0] is AllocStatus.OK  # evicts 2 cached pages
    window_pages = alloc.groups[1].prefix_cache.lookup_each(prompt[:12], b"")
    assert window_pages[:2] == [None, None] and window_pages[2] is not None
    assert len(alloc.groups[0].prefix_cache.lookup(prompt[:12], b"")) == 3
    assert alloc.add_sequence("c", prompt + [99]) == 12
    global_table, window_table = alloc.block_tables("c")
    assert RELEASED not in global_table and window_table[:2] == [RELEASED, RELEASED]


def test_without_room_nothing_changes_in_any_group():
    alloc = GroupedBlockManager(4, P, (0, 4))
    alloc.add_sequence("a", list(range(1, 10)))
    assert alloc.ensure_writable("a", 0, 9)[0] is AllocStatus.NO_PAGES  # 3 + 3 pages > 4
    assert alloc.block_tables("a") == [[], []] and alloc.num_free_pages() == 4


@settings(max_examples=40, deadline=None)
@hypothesis.given(data=st.data(), num_groups=st.integers(2, 4), length=st.integers(1, 30),
                  shared=st.integers(0, 30))
def test_each_group_keeps_its_own_tokens_and_holds_the_pages_of_its_budget(data, num_groups,
                                                                          length, shared):
    """`retain_groups` against a brute force: slot contents moved by the returned copies hold
    each group's kept tokens in order, every group holds ceil(kept / P) pages, a page another
    sequence shares is never written, and the pool loses no page."""
    num_pages = 2 * num_groups * (2 * -(-30 // P) + 1)
    alloc = GroupedBlockManager(num_pages, P, [0] * num_groups)
    tokens = list(range(100, 100 + length))
    other = tokens[:min(shared, length)] + [7] * max(0, length - shared)
    slots: dict[int, tuple] = {}  # device slot -> (group, token) written there
    for seq, toks in (("a", tokens), ("b", other)):
        alloc.add_sequence(seq, toks)
        status, copies = alloc.ensure_writable(seq, alloc.num_tokens_cached(seq), len(toks))
        assert status is AllocStatus.OK and not copies
        for g, table in enumerate(alloc.block_tables(seq)):
            for i, tok in enumerate(toks):
                slots.setdefault(table[i // P] * P + i % P, (g, tok))
        alloc.commit(seq, toks)
    b_pages = {p for table in alloc.block_tables("b") for p in table}
    before = dict(slots)
    keeps = [sorted(data.draw(st.sets(st.integers(0, length - 1), min_size=1)))
             for _ in range(num_groups)]
    status, moves, freed = alloc.retain_groups("a", keeps)
    assert status is AllocStatus.OK
    for src, dst in moves:
        values = [slots[int(s)] for s in src]  # every read before any write
        for d, value in zip(dst, values, strict=True):
            assert int(d) // P not in b_pages, "a shared page was written"
            slots[int(d)] = value
    for g, (table, keep) in enumerate(zip(alloc.block_tables("a"), keeps, strict=True)):
        assert len(table) == -(-len(keep) // P)
        assert [slots[table[i // P] * P + i % P] for i in range(len(keep))] == \
            [(g, tokens[i]) for i in keep]
    assert alloc.num_held_pages("a") == sum(-(-len(k) // P) for k in keeps)
    assert all(slots[s] == before[s] for s in before if s // P in b_pages)
    assert not set(freed) & b_pages
    held = {p for seq in ("a", "b") for table in alloc.block_tables(seq) for p in table}
    assert alloc.num_free_pages() == num_pages - len(held)
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_free_pages() == num_pages
def test_a_returning_sequence_takes_only_the_pages_its_windows_read():
    """A sequence coming back from host memory with 20 computed tokens needs every global page
    but only the window page its next query reads: 6 pages fit in 9 where writing all 20
    tokens in both groups (10 pages) does not; in 5 nothing changes."""
    alloc = GroupedBlockManager(9, P, (0, 4), enable_prefix_cache=False)
    alloc.add_sequence("a", list(range(1, 21)))
    assert alloc.ensure_writable("a", 0, 20)[0] is AllocStatus.NO_PAGES
    assert alloc.ensure_restored("a", 0, 20)[0] is AllocStatus.OK
    global_table, window_table = alloc.block_tables("a")
    assert RELEASED not in global_table and len(global_table) == 5
    assert window_table[:4] == [RELEASED] * 4 and window_table[4] != RELEASED
    assert alloc.num_free_pages() == 3
    alloc.free("a")
    assert alloc.num_free_pages() == 9
    small = GroupedBlockManager(5, P, (0, 4), enable_prefix_cache=False)
    small.add_sequence("a", list(range(1, 21)))
    assert small.ensure_restored("a", 0, 20)[0] is AllocStatus.NO_PAGES
    assert small.block_tables("a")[0] == [] and small.num_free_pages() == 5


def test_a_returning_sequence_gives_back_prefix_pages_behind_its_window():
    """Returning with 24 tokens on a 16-token prefix hit, the window group attaches the hit's
    last page, which its next query (at 24) no longer reads: it goes back to the cache and
    only the page of tokens 20..23 is new; the global group takes the two pages after the
    hit."""
    alloc = GroupedBlockManager(16, P, (0, 4))
    prompt = list(range(1, 17))
    alloc.add_sequence("a", prompt)
    assert alloc.ensure_writable("a", 0, 16)[0] is AllocStatus.OK
    alloc.commit("a", prompt)
    alloc.free("a")
    tokens = prompt + list(range(30, 39))
    assert alloc.add_sequence("b", tokens) == 16
    assert alloc.block_tables("b")[1][3] != RELEASED  # the hit's window page
    assert alloc.ensure_restored("b", 16, 24)[0] is AllocStatus.OK
    global_table, window_table = alloc.block_tables("b")
    assert RELEASED not in global_table and len(global_table) == 6
    assert window_table[:5] == [RELEASED] * 5 and window_table[5] != RELEASED
    assert alloc.num_held_pages("b") == 7
    alloc.free("b")
    assert alloc.num_free_pages() == 16


def test_groups_of_own_budgets_grow_each_at_its_own_length_in_a_full_pool():
    """In a pool the prompt fills, `retain_groups` compacts in place (a group's own pages take
    its kept tokens: no page more is needed); decode then appends to each group after its own
    kept tokens, addressed by group 0's positions, and pages_needed counts per group."""
    alloc = GroupedBlockManager(12, P, (0, 0, 0), enable_prefix_cache=False)
    alloc.add_sequence("a", list(range(1, 17)))
    assert alloc.ensure_writable("a", 0, 16)[0] is AllocStatus.OK
    assert alloc.num_free_pages() == 0
    keeps = [np.arange(16), np.array([0, 3, 5, 6, 9, 12, 13]), np.array([1, 15])]
    status, _, freed = alloc.retain_groups("a", keeps)
    assert status is AllocStatus.OK and len(freed) == 0 + 2 + 3
    assert [len(t) for t in alloc.block_tables("a")] == [4, 2, 1]
    # Group 0's 17th token opens a page; group 1's 8th and group 2's 3rd fit their last page.
    assert alloc.pages_needed("a", 17) == 1 + 0 + 0
    assert alloc.ensure_writable("a", 16, 17)[0] is AllocStatus.OK
    assert [len(t) for t in alloc.block_tables("a")] == [5, 2, 1]
    assert alloc.pages_needed("a", 19) == 0 + 1 + 1  # group 1 at 9 tokens, group 2 at 4
    assert alloc.ensure_writable("a", 17, 19)[0] is AllocStatus.OK
    assert [len(t) for t in alloc.block_tables("a")] == [5, 3, 2]
    alloc.free("a")
    assert alloc.num_free_pages() == 12


def test_a_compaction_in_a_full_pool_rewrites_an_old_page_instead_of_taking_a_new_one():
    """Keeping tokens 4-7 (old page 1, unmoved, now first) and 9 needs a second page; the old
    page at index 1 is taken, so another of the sequence's own old pages takes token 9: the
    full pool has none to give, and none is needed."""
    alloc = GroupedBlockManager(3, P, (0,), enable_prefix_cache=False)
    alloc.add_sequence("a", list(range(1, 11)))
    assert alloc.ensure_writable("a", 0, 10)[0] is AllocStatus.OK and alloc.num_free_pages() == 0
    (old,) = alloc.block_tables("a")
    status, ((src, dst),), freed = alloc.retain_groups("a", [np.array([4, 5, 6, 7, 9])])
    assert status is AllocStatus.OK and len(freed) == 1
    (table,) = alloc.block_tables("a")
    assert table[0] == old[1] and table[1] in (old[0], old[2])
    assert (src.tolist(), dst.tolist()) == ([old[2] * P + 1], [table[1] * P])  # token 9 -> 4
    alloc.free("a")
    assert alloc.num_free_pages() == 3


BUDGETS = (3, 6, 11)  # tokens each kv head keeps (head-major pages: one table per head)
HEAD_PAGES = 26


class PerHeadBudgetMachine(RuleBasedStateMachine):
    """Head-major tables with per-head budgets (AdaKV): every head appends each written token,
    a retention keeps at most its head's budget, and each head's table is checked against a
    brute-force count of the tokens it keeps."""

    def __init__(self):
        super().__init__()
        self.alloc = GroupedBlockManager(HEAD_PAGES, P, [0] * len(BUDGETS),
                                         enable_prefix_cache=False)
        self.kept: dict[str, list[int]] = {}  # sequence -> tokens each head keeps
        self.count = 0

    @rule(length=st.integers(1, 14))
    def add(self, length):
        seq = f"s{self.count}"
        self.count += 1
        self.alloc.add_sequence(seq, list(range(1, length + 1)))
        if self.alloc.ensure_writable(seq, 0, length)[0] is AllocStatus.OK:
            self.kept[seq] = [length] * len(BUDGETS)
        else:  # no room: nothing taken
            self.alloc.free(seq)

    @precondition(lambda self: self.kept)
    @rule(data=st.data(), k=st.integers(1, 6))
    def write(self, data, k):
        seq = data.draw(st.sampled_from(sorted(self.kept)))
        start = self.kept[seq][0]  # group 0's positions address every head
        free = self.alloc.num_free_pages()
        status, copies = self.alloc.ensure_writable(seq, start, start + k)
        assert not copies
        if status is AllocStatus.OK:
            self.kept[seq] = [n + k for n in self.kept[seq]]
        else:
            assert self.alloc.num_free_pages() == free  # all-or-nothing

    @precondition(lambda self: self.kept)
    @rule(data=st.data())
    def retain(self, data):
        seq = data.draw(st.sampled_from(sorted(self.kept)))
        keeps = [sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1,
                                          max_size=min(n, budget))))
                 for n, budget in zip(self.kept[seq], BUDGETS, strict=True)]
        held = self.alloc.num_held_pages(seq)
        status, _, freed = self.alloc.retain_groups(seq, keeps)
        assert status is AllocStatus.OK  # keeping fewer tokens never needs more pages
        self.kept[seq] = [len(keep) for keep in keeps]
        assert held - len(freed) == sum(-(-n // P) for n in self.kept[seq])

    @precondition(lambda self: self.kept)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.kept)))
        self.alloc.free(seq)
        del self.kept[seq]

    @invariant()
    def each_head_holds_the_pages_of_the_tokens_it_keeps(self):
        for seq, kept in self.kept.items():
            tables = self.alloc.block_tables(seq)
            assert [len(t) for t in tables] == [-(-n // P) for n in kept], (seq, kept)
            assert all(RELEASED not in t for t in tables)

    @invariant()
    def nothing_leaks_and_no_two_heads_share_a_page(self):
        pages = [p for seq in self.kept for t in self.alloc.block_tables(seq) for p in t]
        assert len(pages) == len(set(pages))
        assert len(pages) + self.alloc.num_free_pages() == HEAD_PAGES


PerHeadBudgetMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25,
                                                  deadline=None)
TestPerHeadBudgets = PerHeadBudgetMachine.TestCase


class PerHeadTablesMachine(RuleBasedStateMachine):
    """Many groups without windows or prefix caches (per-head tables): decode writes within a
    held page take `ensure_writable`'s fast path, and `block_table_array` is kept between
    calls. Oracle: the same operations on a manager whose groups have a window longer than any
    sequence (the general path, the same tables) and the tables' own lists."""

    NUM_GROUPS, BIG_WINDOW = 3, 10_000

    def __init__(self):
        super().__init__()
        num_pages = 3 * self.NUM_GROUPS * 8
        self.fast = GroupedBlockManager(num_pages, P, [0] * self.NUM_GROUPS,
                                        enable_prefix_cache=False)
        self.slow = GroupedBlockManager(num_pages, P, [self.BIG_WINDOW] * self.NUM_GROUPS,
                                        enable_prefix_cache=False)
        self.lengths: dict[str, int] = {}  # tokens group 0 holds
        self.offsets: dict[str, list[int]] = {}  # each group's length less group 0's
        self.count = 0

    def _both(self, method: str, *args):
        results = [getattr(m, method)(*args) for m in (self.fast, self.slow)]
        assert results[0] == results[1], (method, args, results)
        return results[0]

    @precondition(lambda self: len(self.lengths) < 3)
    @rule(length=st.integers(1, 14))
    def add(self, length):
        seq = f"s{self.count}"
        self.count += 1
        self._both("add_sequence", seq, list(range(length)))
        if self._both("ensure_writable", seq, 0, length)[0] is AllocStatus.OK:
            self.lengths[seq], self.offsets[seq] = length, [0] * self.NUM_GROUPS
        else:
            self._both("free", seq)

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), k=st.sampled_from([1, 1, 1, 2, 5]))
    def write(self, data, k):
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        n = self.lengths[seq]
        if self._both("ensure_writable", seq, n, n + k)[0] is AllocStatus.OK:
            self.lengths[seq] = n + k

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def retain(self, data):
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        n = self.lengths[seq]  # group 0 keeps every token, so its length stays n
        keeps = [list(range(n))] + [sorted(data.draw(st.sets(st.integers(0, n + d - 1),
                                                             min_size=1)))
                                    for d in self.offsets[seq][1:]]
        statuses = [m.retain_groups(seq, keeps)[0] for m in (self.fast, self.slow)]
        assert statuses == [AllocStatus.OK] * 2
        self.offsets[seq] = [len(keep) - n for keep in keeps]

    @precondition(lambda self: self.lengths and len(self.lengths) < 3)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.lengths)))
        child = f"s{self.count}"
        self.count += 1
        self._both("fork", parent, child)
        self.lengths[child] = self.lengths[parent]
        self.offsets[child] = list(self.offsets[parent])

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        self._both("free", seq)
        del self.lengths[seq]

    @invariant()
    def the_kept_arrays_are_the_tables_and_the_counts_the_groups(self):
        for seq in self.lengths:
            tables = self._both("block_tables", seq)
            expected = np.full((len(tables), max(map(len, tables))), RELEASED, np.int32)
            for g, table in enumerate(tables):
                expected[g, :len(table)] = table
            np.testing.assert_array_equal(self.fast.block_table_array(seq), expected)
            assert self.fast.num_held_pages(seq) == sum(
                m.num_held_pages(seq) for m in self.fast.groups)
        assert self.fast.num_used_pages() == sum(m.num_used_pages() for m in self.fast.groups)
        assert self.fast.num_used_pages() == self.slow.num_used_pages()
        assert self.fast.num_free_pages() == self.slow.num_free_pages()


PerHeadTablesMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25,
                                                  deadline=None)
TestPerHeadTables = PerHeadTablesMachine.TestCase
