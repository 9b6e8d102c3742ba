"""Moving KV pages: gather, scatter and zero them through a state's page leaves.

Every `KVState` views its per-page arrays as page leaves `[L, num_pages, ...]`
(`KVState.page_leaves`). A gathered set of n pages is a `PageBlob`: one array `[L, n, ...]` per
page leaf, in the state's leaf order, so swapping, tiers, snapshots and disaggregation move a
quantized pool's codes and scales, or Quest's summaries, exactly like exact K and V. The same
`take` and `put` index the sequence-slot leaves (`KVState.seq_slot_leaves`) by slot.

Index arrays may repeat an entry (padding to a power of two repeats the last one): gathering
twice is harmless and scattering the same data twice is idempotent. Indices past the end are
dropped by scatters, which is how warm-up compiles a scatter without changing the state.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kvjax.kv.state import KVState

PageBlob = list[jax.Array]  # one [L, n, ...] array per page leaf


def take(leaves: Sequence[jax.Array], index: jax.Array) -> PageBlob:
    """Entries `index` [n] of axis 1 of each leaf [L, N, ...] -> [L, n, ...] each."""
    return [x[:, index] for x in leaves]


def put(leaves: Sequence[jax.Array], index: jax.Array, blob: Sequence[jax.Array]
        ) -> list[jax.Array]:
    """Each leaf [L, N, ...] with entries `index` [n] of axis 1 set to blob's [L, n, ...].

    The blob is cast to each leaf's dtype; it may be numpy (a snapshot read from disk).
    """
    return [x.at[:, index].set(jnp.asarray(b, x.dtype))
            for x, b in zip(leaves, blob, strict=True)]


def gather_pages(kv: KVState, pages: jax.Array) -> PageBlob:
    """Pages [n] of every page leaf of `kv`: [L, num_pages, ...] -> [L, n, ...]."""
    return take(kv.page_leaves(), pages)


def scatter_pages(kv: KVState, pages: jax.Array, blob: Sequence[jax.Array]) -> KVState:
    """`kv` with pages [n] set to `blob` (a `gather_pages` result of a same-layout state)."""
    return kv.with_page_leaves(put(kv.page_leaves(), pages, blob))


def gather_seq_slots(kv: KVState, slots: jax.Array) -> PageBlob:
    """Slots [n] of every sequence-slot leaf of `kv` (KIVI windows): [L, n, ...] each."""
    return take(kv.seq_slot_leaves(), slots)


def scatter_seq_slots(kv: KVState, slots: jax.Array, blob: Sequence[jax.Array]) -> KVState:
    """`kv` with sequence slots [n] set to `blob` (a `gather_seq_slots` result)."""
    return kv.with_seq_slot_leaves(put(kv.seq_slot_leaves(), slots, blob))


def zero_pages(kv: KVState, pages: jax.Array) -> KVState:
    """`kv` with pages [n] zeroed in every page leaf (scrubbing freed pages)."""
    return kv.with_page_leaves([x.at[:, pages].set(0) for x in kv.page_leaves()])


def scrub(kv: KVState, pages: jax.Array, seq_slots: jax.Array) -> KVState:
    """`kv` with pages [n] zeroed in every page leaf and sequence slots [m] in every
    sequence-slot leaf (a `KVOpKind.SCRUB` op; either may be empty)."""
    if pages.shape[0]:
        kv = zero_pages(kv, pages)
    if seq_slots.shape[0]:
        kv = kv.with_seq_slot_leaves([x.at[:, seq_slots].set(0) for x in kv.seq_slot_leaves()])
    return kv


def blob_bytes_per_page(blob: Sequence[jax.Array]) -> int:
    """Bytes one page takes across the leaves of a blob of n pages, each [L, n, ...]."""
    num_pages = blob[0].shape[1]
    return sum(x.nbytes for x in blob) // num_pages
