"""Shape buckets and padding: the one place kvjax rounds sizes so each bucket compiles once.

Every jitted program that takes a variable number of pages, slots, copies or rows pads that
number with `next_power_of_2` (or a `bucket` between bounds) and pads index arrays with
`pad_repeat_last`: repeating the last index makes gathers, scatters, copies and zeroings
idempotent, so the padding changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold num_tokens tokens."""
    return -(-num_tokens // page_size)


def bucket(n: int, minimum: int = 1, maximum: int = 1 << 30) -> int:
    """`next_power_of_2(n)` clipped to [minimum, maximum]."""
    return int(min(max(next_power_of_2(n), minimum), maximum))


def floor_power_of_2(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"floor_power_of_2 needs n >= 1, got {n}")
    return 1 << (int(n).bit_length() - 1)


def powers_of_2_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to and including `next_power_of_2(n)`: every padded size of n items."""
    return [1 << i for i in range(max(int(n) - 1, 0).bit_length() + 1)]


def geometric_buckets(start: int, cap: int, factor: int) -> list[int]:
    """start, start*factor, ... below cap, then cap itself (start is clipped to cap)."""
    sizes, n = [], min(start, cap)
    while n < cap:
        sizes.append(n)
        n *= factor
    return sizes + [cap]


def pad_repeat_last(indices: Sequence[int] | np.ndarray, size: int | None = None) -> np.ndarray:
    """int32 `indices` padded to `size` (default: the next power of two) by repeating the last.

    `indices` must be non-empty.
    """
    x = np.asarray(indices, np.int32).reshape(-1)
    if x.size == 0:
        raise ValueError("pad_repeat_last needs at least one index")
    n = next_power_of_2(x.size) if size is None else size
    if n < x.size:
        raise ValueError(f"cannot pad {x.size} indices to {n}")
    return np.concatenate([x, np.full(n - x.size, x[-1], np.int32)])
