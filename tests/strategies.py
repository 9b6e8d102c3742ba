"""Hypothesis strategies shared by the fuzz tests of the Python API and the HTTP server."""

from __future__ import annotations

import hypothesis.strategies as st

# Text a hostile client sends: lone surrogates (legal in JSON and in Python strings, not
# encodable as UTF-8), control characters, overlong names, and ordinary text.
HOSTILE_TEXT = st.one_of(
    st.text(max_size=6),
    st.text(st.characters(categories=["Cs", "Cc"]), min_size=1, max_size=4),
    st.tuples(st.text(max_size=3), st.sampled_from(["\ud800", "\udfff", "\x00", "\x1b", "\x7f"]),
              st.text(max_size=3)).map("".join),
    st.sampled_from(["", "x" * 300, "tenant-a", "\u00e9t\u00e9"]),
)
