"""Draft methods against brute-force definitions: prompt lookup and the sparse draft's pages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.scheduler.spec import NgramDrafter, SparseSelfDrafter, SpecConfig, make_drafter


def _ngram_brute_force(tokens, num, max_ngram, min_ngram):
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        # The most recent earlier occurrence that ends before the last token.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + num]
    return []


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30), num=st.integers(1, 5),
       max_ngram=st.integers(1, 4))
def test_ngram_proposes_the_continuation_of_the_latest_longest_match(tokens, num, max_ngram):
    drafter = NgramDrafter(max_ngram=max_ngram, min_ngram=1)
    assert drafter.propose(tokens, num) == _ngram_brute_force(tokens, num, max_ngram, 1)


@settings(max_examples=200, deadline=None)
@given(kv_len=st.integers(1, 80), page_size=st.sampled_from([1, 2, 4, 16]),
       num_sinks=st.integers(0, 20), window=st.integers(1, 40))
def test_sparse_draft_reads_sinks_and_window_pages(kv_len, page_size, num_sinks, window):
    """The concatenated pages' first `length` slots are the sink pages' tokens, then every
    token from the window's first page through the draft token itself (the last)."""
    num_pages = -(-kv_len // page_size)
    table = np.arange(100, 100 + num_pages + 3, dtype=np.int32)  # spare pages past the end
    pages, length = SparseSelfDrafter(num_sinks, window).draft_reads(table, kv_len, page_size)
    slots = [(int(p), i) for p in pages for i in range(page_size)][:length]
    token_of = {(int(table[t // page_size]), t % page_size): t for t in range(kv_len)}
    read = [token_of[s] for s in slots]
    assert read == sorted(set(read)) and read[-1] == kv_len - 1
    sinks = -(-num_sinks // page_size) * page_size
    assert set(range(min(sinks, kv_len))) <= set(read)  # whole sink pages
    assert set(range(max(kv_len - window, 0), kv_len)) <= set(read)  # the window
    # Nothing else but whole pages around the window's start.
    assert len(read) <= min(kv_len, sinks + window + 2 * page_size)


def test_bad_settings_raise_value_error():
    with pytest.raises(ValueError, match="spec.method"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpecConfig("ngram", num_draft_tokens=0)
    with pytest.raises(ValueError, match="min_ngram"):
        SpecConfig("ngram", options=dict(min_ngram=3, max_ngram=2))
    with pytest.raises(ValueError, match="bad options"):
        make_drafter("sparse_self", sinks=4)
