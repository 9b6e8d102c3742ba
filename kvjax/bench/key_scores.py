"""Time of the all-query key scoring pass (`kvjax.kv.retention.key_scores_blockwise`): what
H2O and observed attention pay at prefill, every query of a chunk weighted.

Each setting scores a chunk of C queries against a context of S cached keys (the chunk's
last query at S - 1) with SmolLM2-135M's attention shape, once per query tile, alternating
the tiles call by call; a tile of C is the untiled pass (every query over every key block it
needs at once). Outputs of every tile are compared with the first tile's.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.decode import environment
from kvjax.kv.retention import key_scores_blockwise

COLUMNS = (("context", "S", "{}"), ("chunk", "C", "{}"), ("query_tile", "query tile", "{}"),
           ("ms", "ms (median)", "{:.1f}"), ("vs_untiled", "vs untiled", "{:.2f}"),
           ("max_rel_diff", "max rel diff vs untiled", "{:.1e}"))


@dataclasses.dataclass(frozen=True)
class Setup:
    """One scoring call's shape: query heads, kv heads, head dim, page size."""
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    page_size: int = 16
    repeats: int = 3


def time_setting(setup: Setup, context: int, chunk: int, tiles: list[int]) -> list[dict]:
    """Rows of one (context, chunk): per query tile its median time over `setup.repeats`
    calls, taking turns with the other tiles."""
    rng = np.random.default_rng(0)
    p, k, d = setup.page_size, setup.num_kv_heads, setup.head_dim
    num_pages = -(-context // (8 * p)) * 8  # the table a multiple of the 8-page key block
    keys = jnp.asarray(rng.normal(size=(num_pages, p, k, d)).astype(np.float32))
    tables = jnp.arange(num_pages, dtype=jnp.int32)[None]
    q = jnp.asarray(rng.normal(size=(1, chunk, setup.num_heads, d)).astype(np.float32))
    kv_lens, q_lens = jnp.array([context], jnp.int32), jnp.array([chunk], jnp.int32)
    weights = jnp.ones((1, chunk), jnp.float32)

    def load(ids):
        return keys[ids], keys[ids]

    calls, outputs, times = {}, {}, {t: [] for t in tiles}
    for tile in tiles:
        calls[tile] = jax.jit(lambda q, kv_lens, q_lens, w, tile=tile: key_scores_blockwise(
            q, load, tables, kv_lens, q_lens, w, max_kept_logits=0, query_tile=tile))
        outputs[tile] = np.asarray(calls[tile](q, kv_lens, q_lens, weights))
    for _ in range(setup.repeats):
        for tile in tiles:
            start = time.perf_counter()
            calls[tile](q, kv_lens, q_lens, weights).block_until_ready()
            times[tile].append(time.perf_counter() - start)
    base = tiles[0]
    rows = []
    for tile in tiles:
        ms = 1e3 * float(np.median(times[tile]))
        diff = np.abs(outputs[tile] - outputs[base]) / (np.abs(outputs[base]) + 1e-6)
        rows.append(dict(context=context, chunk=chunk, query_tile=tile, ms=ms,
                         max_rel_diff=float(diff.max())))
    for row in rows:
        row["vs_untiled"] = row["ms"] / rows[0]["ms"]
    return rows


def run(setup: Setup, settings: list[tuple[int, int]], tiles: list[int]) -> dict:
    """Every (context, chunk) setting, the untiled pass (tile = chunk) first."""
    env = environment()
    rows = {}
    for context, chunk in settings:
        for row in time_setting(setup, context, chunk, [chunk, *[t for t in tiles if t < chunk]]):
            rows[f"S={context} C={chunk} tile={row['query_tile']}"] = row
    env["load_average_end"] = list(os.getloadavg())
    return dict(env=env, setup=dataclasses.asdict(setup), rows=rows)
