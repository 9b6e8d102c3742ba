"""Shared pieces of the kernel tests: the interpret switch, tolerances, poisoned page layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_decode import Schedule, default_schedule

# Interpreted on the CPU, compiled on a GPU (scripts/device_check.sh runs these files there).
INTERPRET = jax.default_backend() == "cpu"

# Kernel against its float32 oracle on the same (dequantized) pages.
TOLERANCES = {
    jnp.float32: dict(atol=2e-5, rtol=2e-5),
    # Softmax weights (times the value scale) are rounded to bf16 for the value matmul.
    jnp.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def runnable(schedule: Schedule) -> Schedule:
    """Each schedule compiles only on its own platform; the interpreter runs both."""
    if not INTERPRET and schedule is not default_schedule():
        pytest.skip(f"the {schedule.value} schedule does not compile on {jax.default_backend()}")
    return schedule


def block_pages(page_size: int, pages: int) -> int:
    """Pages per compute block: as asked, or enough for Triton's 16-token dots when compiled."""
    return pages if INTERPRET else max(pages, 16 // page_size)


def paged_layout(rng: np.random.Generator, kv_lens: list[int], page_size: int,
                 extra_entries: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A randomly permuted block table and which page slots hold a token.

    Returns (block_tables [B, Pmax] int32, holds_token [num_pages, P] bool). Each row has
    `extra_entries` stale table entries past its longest sequence's pages, and the pool has 3
    pages no row owns; every slot with holds_token False is to be filled with NaN.
    """
    b = len(kv_lens)
    pmax = -(-max(kv_lens) // page_size) + extra_entries
    num_pages = b * pmax + 3
    block_tables = rng.permutation(num_pages)[:b * pmax].reshape(b, pmax).astype(np.int32)
    holds_token = np.zeros((num_pages, page_size), bool)
    for row, length in enumerate(kv_lens):
        for t in range(length):
            holds_token[block_tables[row, t // page_size], t % page_size] = True
    return block_tables, holds_token


def max_abs_error(got: jax.Array, want: jax.Array) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))
