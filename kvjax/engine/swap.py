"""Swapping a preempted sequence's KV pages to host memory and back, through jax memory kinds.

Pages travel page-first: a sequence's pages are gathered from every page leaf of the KV state
(`kvjax.kv.pages`) into one contiguous buffer per leaf, `[L, n, P, K, D]` for exact K and V,
then moved in a single transfer to `pinned_host` memory (`unpinned_host` where the backend
lacks it). Page counts are padded to powers of two so the gather and scatter programs compile
once per bucket. On a mesh each buffer keeps its sharding (the kv-head axis split over the
`tp` devices), in host memory and back: every device swaps its own heads.

Demoted copies (`KVCacheManager.swap_out(..., demote_bits=8 or 4)`, a KV controller's
decision): every float K/V leaf `[L, n, P, K, D]` travels and stays on the host encoded by a KV
codec (`demotion_codec`): `int8` (one scale per token and head) or `int4` (two codes a byte, a
scale and zero per 32 channels), about a quarter (an eighth) of float32's bytes. Swapping in
decodes them back into the pool's dtype, so the sequence continues from rounded K/V, exactly as
a pool of that codec would hold it (so the KL tables measured with those codecs price it).
Other leaves (codes and scales of a quantized pool, arena words) travel as they are.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import jit as kvjax_jit
from kvjax.kv import codecs
from kvjax.kv import pages as kv_pages
from kvjax.memory.ops import KVOp
from kvjax.memory.tiers.host import host_memory_kind
from kvjax.shapes import powers_of_2_up_to

DEMOTION_BITS = (8, 4)  # the precisions a swapped copy may take, larger first


def demotion_codec(bits: int, head_dim: int) -> tuple[str, dict]:
    """(codec name, options) a demoted copy at `bits` is encoded with: int8 (a scale per
    token and head), int4 (a scale and zero per gcd(32, D) channels)."""
    if bits == 8:
        return "int8", {}
    if bits == 4:
        return "int4", dict(group=math.gcd(32, head_dim))
    raise ValueError(f"demoted copies are 8 or 4 bits, got {bits!r}")


def _codec(bits: int, head_dim: int) -> codecs.KVCodec:
    name, options = demotion_codec(bits, head_dim)
    return codecs.get_codec(name, **options)


def demotes(x: jax.Array, bits: int = 8) -> bool:
    """Whether a page leaf travels encoded in a demoted copy at `bits`: float K/V
    [L, n, P, K, D] whose head dim the codec takes."""
    if not (x.ndim == 5 and jnp.issubdtype(x.dtype, jnp.floating)):
        return False
    try:
        _codec(bits, x.shape[-1]).bytes_per_token(x.shape[-2], x.shape[-1])
    except ValueError:
        return False
    return True


def demoted_nbytes(x: jax.Array, bits: int = 8) -> int:
    """Bytes of a page leaf in a demoted copy at `bits`."""
    if not demotes(x, bits):
        return x.nbytes
    tokens = x.size // (x.shape[-2] * x.shape[-1])
    return int(tokens * _codec(bits, x.shape[-1]).bytes_per_token(x.shape[-2], x.shape[-1]))


def demote_blob(blob: list[jax.Array], bits: int = 8) -> list[tuple[jax.Array, ...]]:
    """Each float K/V leaf as its codec's stored arrays (sorted by name); others as (x,)."""
    out = []
    for x in blob:
        if demotes(x, bits):
            stored = _codec(bits, x.shape[-1]).encode(x)
            out.append(tuple(stored[k] for k in sorted(stored)))
        else:
            out.append((x,))
    return out


def restore_blob(parts: list[tuple[jax.Array, ...]], dtypes: list, bits: int = 8
                 ) -> list[jax.Array]:
    """`demote_blob` undone: each encoded leaf decoded into its dtype."""
    out = []
    for p, dtype in zip(parts, dtypes, strict=True):
        if len(p) == 1:
            out.append(p[0])
            continue
        head_dim = p[0].shape[-1] * 8 // bits  # the codes: bits per channel
        codec = _codec(bits, head_dim)
        names = sorted(codec.storage_spec(1, 1, head_dim))  # the stored arrays, as encoded
        out.append(codec.decode(dict(zip(names, p, strict=True))).astype(dtype))
    return out


def tree_bytes(tree) -> int:
    """Bytes of a tree's arrays (or of their shapes and dtypes, from `jax.eval_shape`)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


class HostSwapSpace:
    """Host-memory copies of swapped-out sequences' pages, keyed by host slot.

    Its programs apply `KVOpKind.SWAP_OUT`, `SWAP_IN` and `SWAP_DROP` from their index
    arrays (the runner's `kv_programs`); the KV cache manager hands out the host slots and
    counts the bytes (`page_bytes`), so it never waits for a copy.
    """

    keeps_windows = False  # Pages are all a sequence's KV (see kvjax.engine.residual).

    def __init__(self):
        self._stored: dict[int, tuple | None] = {}  # host slot -> copy (None: no pages)
        self._page_bytes: dict[int, int] = {}  # bits -> bytes per page of a copy
        # Per-instance programs, so each engine counts its own compilations.
        self._gather = kvjax_jit.jit(kv_pages.gather_pages)
        self._scatter = kvjax_jit.jit(kv_pages.scatter_pages, donate_argnums=0)
        self._zero = kvjax_jit.jit(kv_pages.zero_pages, donate_argnums=0)
        self._demote = kvjax_jit.jit(demote_blob, static_argnums=1)
        self._restore = kvjax_jit.jit(restore_blob, static_argnums=(1, 2))
        self.memory_kind = host_memory_kind(jax.devices()[0], user="swapping")

    @property
    def num_compiles(self) -> int:
        return sum(f.num_compiles for f in (self._gather, self._scatter, self._zero,
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

    def swap_out(self, kv, op: KVOp):
        """`KVOpKind.SWAP_OUT`: keeps a copy of pool pages op.src (padded; the first
        len(op.pages) are the copy's) in host memory under op.host_slot, demoted to op.bits
        (8 or 4; 0: as stored). The pool is unchanged."""
        if not op.pages:
            self._stored[op.host_slot] = None
            return kv
        stored = self._gather(kv, np.asarray(op.src, np.int32))
        parts = self._demote(stored, op.bits) if op.bits else [(x,) for x in stored]
        flat = [x for p in parts for x in p]
        self._stored[op.host_slot] = ([self._to_host(x) for x in flat], [len(p) for p in parts],
                                      [x.dtype for x in stored], op.bits)
        return kv

    def swap_in(self, kv, op: KVOp):
        """`KVOpKind.SWAP_IN`: writes the copy's pages op.src into pool pages op.dst (padded
        index arrays; empty: none), and frees the copy."""
        copy = self._stored.pop(op.host_slot)
        if not op.dst:
            return kv
        stored, sizes, dtypes, bits = copy
        flat = kv_pages.take([self._to_device(x) for x in stored],
                             np.asarray(op.src, np.int32))
        parts = [tuple(flat[i - k:i]) for i, k in zip(itertools.accumulate(sizes), sizes,
                                                            strict=True)]
        blob = (self._restore(parts, tuple(dtypes), bits) if bits
                else [p[0] for p in parts])
        return self._scatter(kv, np.asarray(op.dst, np.int32), blob)

    def page_bytes(self, kv, bits: int = 0) -> int:
        """Bytes one page takes in a host copy at `bits` (0: as stored), from the shapes of
        `kv`'s leaves alone."""
        if bits not in self._page_bytes:
            def copy(kv):
                stored = kv_pages.gather_pages(kv, np.zeros(1, np.int32))
                return demote_blob(stored, bits) if bits else stored

            self._page_bytes[bits] = tree_bytes(jax.eval_shape(copy, kv))
        return self._page_bytes[bits]

    def window_bytes(self, kv) -> int:
        """Bytes of one sequence's window in a host copy: none here."""
        return 0

    def drop(self, key) -> None:
        """Frees the host copy under `key` (a host slot), if any."""
        self._stored.pop(key, None)

    def take_released_slots(self) -> list[int]:
        """Sequence slots freed since the last call whose state a scrub must zero: none here
        (pages are all a sequence's KV)."""
        return []

    def scrub(self, kv, pages: Sequence[int], seq_slots: Sequence[int] = ()):
        """Zeroes freed pages so no later reader could ever see their old content.

        pages, seq_slots: padded index arrays (`KVOpKind.SCRUB`); no sequence slots here."""
        if not len(pages):
            return kv
        return self._zero(kv, np.asarray(pages, np.int32))

    def warmup(self, kv, max_pages: int, *, swap: bool, scrub: bool,
               demote_bits: tuple[int, ...] = ()):
        """Compiles the swap and scrub programs for every padded count up to `max_pages` pages
        (and the demotions' to each of `demote_bits`).

        Their writes go to a page past the pool, which scatters drop: the state is unchanged.
        """
        for n in powers_of_2_up_to(max_pages):
            past = np.full(n, kv.num_pages, np.int32)
            if swap:
                gathered = self._gather(kv, np.zeros(n, np.int32))
                stored = [self._to_device((x, x.sharding)) for x in gathered]
                for bits in demote_bits:
                    self._restore(self._demote(stored, bits), tuple(x.dtype for x in stored),
                                  bits)
                kv = self._scatter(kv, past, stored)
            if scrub:
                kv = self._zero(kv, past)
        return kv
