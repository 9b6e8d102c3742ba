"""Swapping a preempted sequence's KV pages to host memory and back, through jax memory kinds.

Pages travel page-first: a sequence's pages are gathered from every page leaf of the KV state
(`kvjax.kv.pages`) into one contiguous buffer per leaf, `[L, n, P, K, D]` for exact K and V,
then moved in a single transfer to `pinned_host` memory (`unpinned_host` where the backend
lacks it). Page counts are padded to powers of two so the gather and scatter programs compile
once per bucket. On a mesh each buffer keeps its sharding (the kv-head axis split over the
`tp` devices), in host memory and back: every device swaps its own heads.

Demoted copies (`swap_out(..., demote=True)`, a KV controller's decision): every float K/V
leaf `[L, n, P, K, D]` travels and stays on the host as int8 codes with one float32 scale per
token and head (absmax over D), about a quarter of float32's bytes; swapping in decodes them
back into the pool's dtype, so the sequence continues from rounded K/V. Other leaves (codes
and scales of a quantized pool, arena words) travel as they are.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kv import pages as kv_pages
from kvjax.memory.tiers.host import host_memory_kind
from kvjax.shapes import pad_repeat_last, powers_of_2_up_to


def demotes(x: jax.Array) -> bool:
    """Whether a page leaf travels int8 in a demoted copy (float K/V [L, n, P, K, D])."""
    return x.ndim == 5 and jnp.issubdtype(x.dtype, jnp.floating)


def demoted_nbytes(x: jax.Array) -> int:
    """Bytes of a page leaf in a demoted copy: int8 codes and a float32 scale per row of D."""
    return x.size + x.size // x.shape[-1] * 4 if demotes(x) else x.nbytes


def demote_blob(blob: list[jax.Array]) -> list[tuple[jax.Array, ...]]:
    """Each float K/V leaf as (int8 codes, float32 scales [L, n, P, K, 1]); others as (x,)."""
    out = []
    for x in blob:
        if not demotes(x):
            out.append((x,))
            continue
        scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True) / 127.0
        safe = jnp.where(scale > 0, scale, 1.0)
        codes = jnp.clip(jnp.round(x.astype(jnp.float32) / safe), -127, 127).astype(jnp.int8)
        out.append((codes, scale))
    return out


def restore_blob(parts: list[tuple[jax.Array, ...]], dtypes: list) -> list[jax.Array]:
    """`demote_blob` undone: codes * scale in each leaf's dtype."""
    return [p[0] if len(p) == 1 else (p[0].astype(jnp.float32) * p[1]).astype(dtype)
            for p, dtype in zip(parts, dtypes, strict=True)]


class HostSwapSpace:
    """Host-memory copies of swapped-out sequences' pages, keyed by sequence id."""

    keeps_windows = False  # Pages are all a sequence's KV (see kvjax.engine.residual).

    def __init__(self):
        self._stored: dict[str, tuple[object, int]] = {}
        # Per-instance programs, so each engine counts its own compilations.
        self._gather = jax.jit(kv_pages.gather_pages)
        self._scatter = jax.jit(kv_pages.scatter_pages, donate_argnums=0)
        self._zero = jax.jit(kv_pages.zero_pages, donate_argnums=0)
        self._demote = jax.jit(demote_blob)
        self._restore = jax.jit(restore_blob, static_argnums=1)
        self.memory_kind = host_memory_kind(jax.devices()[0], user="swapping")

    @property
    def num_compiles(self) -> int:
        return sum(f._cache_size() for f in (self._gather, self._scatter, self._zero,
                                              self._demote, self._restore))

    def _to_host(self, x: jax.Array) -> tuple[object, jax.sharding.Sharding]:
        """x in host memory (numpy where the backend has no host memory kind), with the
        sharding it goes back to."""
        if self.memory_kind is not None:
            return jax.device_put(x, x.sharding.with_memory_kind(self.memory_kind)), x.sharding
        if x.is_fully_addressable:
            return np.asarray(x), x.sharding
        return x, x.sharding  # Shards of other processes: host memory is device memory here.

    @staticmethod
    def _to_device(stored: tuple[object, jax.sharding.Sharding]) -> jax.Array:
        x, sharding = stored
        return jax.device_put(x, sharding.with_memory_kind("device"))

    def swap_out(self, kv, seq_id: str, pages: list[int], *, demote: bool = False) -> int:
        """Copies `pages` (in block-table order) to host memory, int8 with `demote`; returns
        bytes moved."""
        padded = pad_repeat_last(pages)
        stored = self._gather(kv, padded)
        parts = self._demote(stored) if demote else [(x,) for x in stored]
        flat = [x for p in parts for x in p]
        self._stored[seq_id] = ([self._to_host(x) for x in flat], len(pages),
                                [len(p) for p in parts], [x.dtype for x in stored])
        return kv_pages.blob_bytes_per_page(flat) * len(pages)

    def swap_in(self, kv, seq_id: str, pages: list[int], first: int) -> tuple[object, int]:
        """Writes stored pages [first:] into the sequence's new `pages[first:]`; frees the copy."""
        stored, n, sizes, dtypes = self._stored.pop(seq_id)
        targets = pages[first:n]
        if not targets:
            return kv, 0
        idx = pad_repeat_last(list(range(first, n)))
        flat = kv_pages.take([self._to_device(x) for x in stored], idx)
        parts = [tuple(flat[i - k:i]) for i, k in zip(itertools.accumulate(sizes), sizes,
                                                            strict=True)]
        blob = (self._restore(parts, tuple(dtypes)) if max(sizes) > 1
                else [p[0] for p in parts])
        kv = self._scatter(kv, pad_repeat_last(targets), blob)
        return kv, kv_pages.blob_bytes_per_page(flat) * len(targets)

    def drop(self, seq_id: str) -> None:
        self._stored.pop(seq_id, None)

    def scrub(self, kv, pages: list[int]):
        """Zeroes freed pages so no later reader could ever see their old content."""
        if not pages:
            return kv
        return self._zero(kv, pad_repeat_last(sorted(pages)))

    def warmup(self, kv, max_pages: int, *, swap: bool, scrub: bool, demote: bool = False):
        """Compiles the swap and scrub programs for every padded count up to `max_pages` pages
        (and the int8 demotion's with `demote`).

        Their writes go to a page past the pool, which scatters drop: the state is unchanged.
        """
        for n in powers_of_2_up_to(max_pages):
            past = np.full(n, kv.num_pages, np.int32)
            if swap:
                gathered = self._gather(kv, np.zeros(n, np.int32))
                stored = [self._to_device((x, x.sharding)) for x in gathered]
                if demote:
                    stored = self._restore(self._demote(stored), tuple(x.dtype for x in stored))
                kv = self._scatter(kv, past, stored)
            if scrub:
                kv = self._zero(kv, past)
        return kv
