"""PrefixCache: hash-chain lookups against a dict of token prefixes, LRU eviction, stability."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.memory import prefix_cache
from kvjax.memory.prefix_cache import HitLedger, PrefixCache, hash_page, hash_root


def _insert_chain(cache: PrefixCache, token_ids, cache_key: bytes, pages) -> list[bool]:
    """Indexes the full pages of `token_ids` as the block manager's commit does."""
    parent = hash_root(cache_key)
    inserted = []
    for i, page in enumerate(pages):
        parent = hash_page(parent, token_ids[i * cache.page_size : (i + 1) * cache.page_size])
        inserted.append(cache.insert(parent, page))
    return inserted


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.integers(1, 3),
    inserts=st.lists(
        st.tuples(st.sampled_from([b"a", b"b"]), st.lists(st.integers(0, 1), max_size=9)),
        max_size=6,
    ),
    query_key=st.sampled_from([b"a", b"b"]),
    query=st.lists(st.integers(0, 1), max_size=9),
)
def test_lookup_returns_the_longest_indexed_prefix(page_size, inserts, query_key, query):
    cache = PrefixCache(page_size)
    # Oracle: (key, token prefix ending on a page boundary) -> the first page inserted for it.
    page_by_prefix = {}
    next_page = 0
    for key, tokens in inserts:
        num_full = len(tokens) // page_size
        pages = list(range(next_page, next_page + num_full))
        next_page += num_full
        inserted = _insert_chain(cache, tokens, key, pages)
        for i, page in enumerate(pages):
            prefix = (key, tuple(tokens[: (i + 1) * page_size]))
            assert inserted[i] == (prefix not in page_by_prefix)
            page_by_prefix.setdefault(prefix, page)
    expected = []
    for i in range(len(query) // page_size):
        prefix = (query_key, tuple(query[: (i + 1) * page_size]))
        if prefix not in page_by_prefix:
            break
        expected.append(page_by_prefix[prefix])
    assert cache.lookup(query, query_key) == expected
    assert cache.lookup(np.asarray(query, np.int32), query_key) == expected


def test_cache_keys_never_share_and_chain_binds_the_prefix():
    cache = PrefixCache(2)
    _insert_chain(cache, [1, 2, 3, 4], b"tenant-a", [0, 1])
    assert cache.lookup([1, 2, 3, 4, 5], b"tenant-a") == [0, 1]
    assert cache.lookup([1, 2, 3, 4, 5], b"tenant-b") == []
    assert cache.lookup([1, 2, 3, 4, 5], b"") == []
    assert cache.lookup([9, 9, 3, 4], b"tenant-a") == []
    assert cache.lookup([1, 2, 3], b"tenant-a") == [0]


def test_insert_keeps_the_first_page_for_a_hash():
    cache = PrefixCache(2)
    assert _insert_chain(cache, [1, 2], b"", [5]) == [True]
    assert _insert_chain(cache, [1, 2], b"", [6]) == [False]
    assert _insert_chain(cache, [7, 7], b"", [5]) == [False]
    assert cache.lookup([1, 2], b"") == [5]
    assert not cache.is_indexed(6)
    assert cache.num_indexed() == 1


def test_evicts_least_recently_released_and_only_unreferenced_pages():
    cache = PrefixCache(1)
    _insert_chain(cache, [1, 2, 3, 4], b"", [10, 11, 12, 13])
    assert cache.evict_one() is None  # every page is still referenced
    assert cache.oldest_release() is None
    for now, page in enumerate((12, 11, 10)):
        cache.mark_evictable(page, now=float(now))
    assert cache.oldest_release() == 0.0  # page 12's
    cache.mark_in_use(12)  # a hit: 12 is referenced again
    assert cache.oldest_release() == 1.0  # page 11's
    cache.mark_evictable(12, now=3.0)  # released again: now the most recent
    assert cache.num_evictable() == 3
    assert [cache.evict_one() for _ in range(4)] == [11, 10, 12, None]
    assert cache.is_indexed(13) and not cache.is_indexed(10)
    # Evicted pages leave the index: the chain now stops at the first missing page.
    assert cache.lookup([1, 2, 3, 4], b"") == []


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "release", "evict", "keep"]),
                              st.integers(0, 2), st.integers(0, 11)), max_size=40))
def test_fair_share_evicts_from_the_owner_with_the_most_pages(ops):
    """Against a brute-force model: each eviction takes, among owners with an evictable page
    not kept, one holding the most indexed pages, and that owner's least recently released
    page; kept pages go last (in the order named), as under LRU."""
    cache = PrefixCache(1, prefix_cache.PrefixEviction.FAIR_SHARE)
    owner_of, released, kept, next_page = {}, [], [], 0  # released: LRU order
    for op, owner, arg in ops:
        if op == "insert":
            assert cache.insert(bytes([next_page]) * 16, next_page, owner=bytes([owner]))
            owner_of[next_page], next_page = owner, next_page + 1
        elif op == "release" and arg in owner_of and arg not in released:
            cache.mark_evictable(arg)
            released.append(arg)
        elif op == "keep":
            kept = [p for p in released if p % 3 == arg % 3]
            cache.keep(kept)
        elif op == "evict":
            counts = {o: sum(1 for v in owner_of.values() if v == o) for o in owner_of.values()}
            free = [p for p in released if p not in kept]
            if free:
                most = max(counts[owner_of[p]] for p in free)
                expected = next(p for p in free if counts[owner_of[p]] == most)
            else:
                expected = kept[0] if kept else None
            assert cache.evict_one() == expected
            if expected is not None:
                released.remove(expected)
                kept = [p for p in kept if p != expected]
                del owner_of[expected]


def test_reset_returns_only_evictable_pages():
    cache = PrefixCache(1)
    _insert_chain(cache, [1, 2, 3], b"", [0, 1, 2])
    cache.mark_evictable(2)
    cache.mark_evictable(0)
    assert cache.reset() == [2, 0]
    assert cache.num_indexed() == cache.num_evictable() == 0
    assert cache.lookup([1, 2, 3], b"") == []


def test_hashes_are_stable_across_processes():
    # Loads the module file alone: the kvjax package import would pull in jax.
    script = (
        "import importlib.util as u;"
        f"spec = u.spec_from_file_location('prefix_cache', {prefix_cache.__file__!r});"
        "m = u.module_from_spec(spec); spec.loader.exec_module(m);"
        "print(m.hash_page(m.hash_page(m.hash_root(b'salt'), [1, 2]), [70000, 3]).hex())"
    )
    expected = hash_page(hash_page(hash_root(b"salt"), [1, 2]), [70000, 3]).hex()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        assert result.stdout.strip() == expected


def test_hash_depends_on_parent_tokens_and_key():
    root = hash_root(b"a")
    assert hash_page(root, [1, 2]) != hash_page(root, [2, 1])
    assert hash_page(root, [1, 2]) != hash_page(hash_root(b"b"), [1, 2])
    assert hash_page(root, [1, 2]) != hash_page(hash_page(root, [1, 2]), [1, 2])
    assert hash_page(root, [1]) != hash_page(root, [1, 0])


def test_invalid_arguments_raise_value_error():
    with pytest.raises(ValueError, match="page_size"):
        PrefixCache(0)
    with pytest.raises(ValueError, match="str"):
        hash_root("salt")
    cache = PrefixCache(1)
    with pytest.raises(ValueError, match="page 3 is not in the prefix cache"):
        cache.mark_evictable(3)
    with pytest.raises(ValueError, match="page 3 is not in the prefix cache"):
        cache.hash_of(3)
    _insert_chain(cache, [1], b"", [3])
    with pytest.raises(ValueError, match="page 3 is not evictable"):
        cache.mark_in_use(3)
    cache.mark_evictable(3)
    with pytest.raises(ValueError, match="already evictable"):
        cache.mark_evictable(3)


def test_hit_ledger_allows_the_leading_pages_a_tenant_paid_for_and_forgets_the_oldest():
    ledger = HitLedger(capacity=3)
    chain = [b"p0", b"p1", b"p2"]
    assert ledger.allowed_pages("a", chain) == 0
    ledger.record("a", chain[:2])
    assert ledger.allowed_pages("a", chain) == 2 and ledger.allowed_pages("b", chain) == 0
    assert ledger.allowed_pages("a", [b"p1"]) == 1  # pages count, not positions
    ledger.record("b", [b"p0"])
    ledger.record("b", [b"p1"])  # over capacity: a's least recently used pair goes
    assert len(ledger) == 3 and ledger.allowed_pages("b", chain) == 2
    assert ledger.allowed_pages("a", chain) == 0  # its chain stops at the forgotten page
    with pytest.raises(ValueError):
        HitLedger(capacity=0)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 50_000), max_size=40), st.integers(0, 40), st.integers(1, 8))
def test_a_chain_extended_from_known_hashes_equals_the_chain_hashed_whole(tokens, cut, page):
    """A prefill's chunks extend the chain they hashed before (`known`): the result is the
    chain of the whole token list, hashed page by page from the root."""
    key = b"model|tok"
    known = prefix_cache.page_hash_chain(tokens[:cut], key, page)
    whole = [hash_root(key)]
    for start in range(0, len(tokens) - page + 1, page):
        whole.append(hash_page(whole[-1], tokens[start:start + page]))
    assert prefix_cache.page_hash_chain(tokens, key, page, known) == whole[1:]
