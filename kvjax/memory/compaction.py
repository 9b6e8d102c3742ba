"""Where a retention decision's kept tokens go: the compacted page layout of a sequence's
block table (`BlockManager.retain`), as pure functions of the table and the kept positions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np


class RetainLayout(NamedTuple):
    """The new layout of a sequence's kept positions.

    Attributes:
        reused: new page index -> the old page index holding its tokens at the same offsets
            (kept unmoved).
        own: new page index -> the index of a private old page it rewrites (the same index
            where it can, else another old page the layout leaves unused).
        num_alloc: new pages to take from the free list.
    """

    reused: dict[int, int]
    own: dict[int, int]
    num_alloc: int


def retain_layout(old: Sequence[int], num_tokens: int, keep: np.ndarray, page_size: int,
                  is_shared: Callable[[int], bool]) -> RetainLayout:
    """The layout `BlockManager.retain` gives `keep` [S'] (strictly increasing positions in
    [0, num_tokens)) of a sequence whose table is `old`; `is_shared(page)`: whether another
    table or the prefix cache holds the page (then it is never written)."""
    if keep.ndim != 1 or len(keep) == 0:
        raise ValueError(f"keep must be a non-empty 1-D list of positions, got {keep!r}")
    if keep[0] < 0 or keep[-1] >= num_tokens or np.any(np.diff(keep) <= 0):
        raise ValueError(f"keep must be strictly increasing positions in "
                         f"[0, {num_tokens}), got {keep.tolist()}")
    p = page_size
    num_new_pages = -(-len(keep) // p)
    reused = {}  # new page index -> old page index holding its tokens at the same offsets
    for j in range(num_new_pages):
        segment = keep[j * p : (j + 1) * p]
        if segment[0] % p == 0 and segment[-1] - segment[0] == len(segment) - 1:
            reused[j] = int(segment[0] // p)
    taken = set(reused.values())
    spare = [i for i in range(len(old)) if i not in taken and not is_shared(old[i])]
    own = {j: j for j in range(num_new_pages) if j not in reused and j in spare}
    # Pages the same index cannot give take the other spare ones: keeping fewer tokens then
    # never needs a page from the free list unless shared pages must be left unwritten.
    rest = [j for j in range(num_new_pages) if j not in reused and j not in own]
    own.update(zip(rest, [i for i in spare if i not in own.values()], strict=False))
    return RetainLayout(reused, own, num_new_pages - len(reused) - len(own))


def compact(old: Sequence[int], keep: np.ndarray, page_size: int, layout: RetainLayout,
            allocate: Callable[[], int]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(new table, src, dst): the compacted table (new pages from `allocate`) and the token
    slot moves (page * P + offset) that fill it, only those that change a slot."""
    p = page_size
    num_new_pages = -(-len(keep) // p)
    table = [old[layout.reused[j]] if j in layout.reused else old[layout.own[j]]
             if j in layout.own else allocate() for j in range(num_new_pages)]
    moved = np.array([j not in layout.reused for j in range(num_new_pages)])  # [pages]
    positions = np.flatnonzero(np.repeat(moved, p)[: len(keep)])  # new positions to fill
    src = np.array(old, np.int64)[keep[positions] // p] * p + keep[positions] % p
    dst = np.array(table, np.int64)[positions // p] * p + positions % p
    changed = src != dst
    return table, src[changed], dst[changed]
