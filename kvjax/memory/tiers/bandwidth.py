"""A calibration probe: device <-> host bandwidth in either transfer layout."""

from __future__ import annotations

import math
import time

import jax
import numpy as np

from kvjax import jit as kvjax_jit
from kvjax.kv import pages as kv_pages
from kvjax.memory.tiers.config import TransferLayout
from kvjax.memory.tiers.host import host_memory_kind


def measure_transfer_bandwidth(kv, num_pages: int, layout: TransferLayout, *,
                               repeats: int = 3) -> dict[str, float]:
    """Device <-> host bandwidth (bytes/s) for `num_pages` pages of `kv` moved in `layout`.

    Page-first: one gather into [L, n, ...] and one transfer per direction. Per page: n
    gathers and n transfers. Each direction is timed to completion, best of `repeats`.
    """
    leaves = kv.page_leaves()
    kind = host_memory_kind(next(iter(leaves[0].devices())))
    pages = np.arange(min(num_pages, leaves[0].shape[1]), dtype=np.int32)
    groups = [pages] if layout is TransferLayout.PAGE_FIRST else [pages[i:i + 1] for i in pages]

    gather = kvjax_jit.jit(kv_pages.take)

    def to_host(x):
        return np.asarray(x) if kind is None else jax.device_put(
            x, x.sharding.with_memory_kind(kind))

    def down():
        out = [[to_host(x) for x in gather(leaves, g)] for g in groups]
        jax.block_until_ready(out)
        return out

    def up(host):
        out = [[jax.device_put(x, s.sharding.with_memory_kind("device"))
                for x, s in zip(h, leaves, strict=True)] for h in host]
        jax.block_until_ready(out)

    host = down()  # warm-up: compiles the gathers
    up(host)
    d2h, h2d = math.inf, math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        host = down()
        t1 = time.perf_counter()
        up(host)
        t2 = time.perf_counter()
        d2h, h2d = min(d2h, t1 - t0), min(h2d, t2 - t1)
    nbytes = sum(x.nbytes for h in host for x in jax.tree.leaves(h))
    return dict(bytes=nbytes, device_to_host_bytes_per_s=nbytes / d2h,
                host_to_device_bytes_per_s=nbytes / h2d)
