"""Copying a cached chunk's KV into another sequence's slots at another position.

A chunk's keys hold RoPE at the chunk's own positions 0..L-1; in a prompt where the chunk starts
at position a, its token t sits at a + t. Rotating a key forward by a gives exactly the key at
a + t (RoPE is a rotation, R(a) R(t) = R(a + t), for a RoPE that `is_shift_invariant`);
values carry no position. The copy goes
through the KV-state protocol only (`load_pages` to read, `write` to store), so a per-token
codec decodes and encodes the tokens again and a summarized state (Quest) updates its
summaries as for any write.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import jit as kvjax_jit
from kvjax.models.rope import RoPE


def copy_rotated(kv, src_pages: jax.Array, offset: jax.Array, dst: jax.Array, shift: jax.Array,
                 key_scale: jax.Array, *, rope: RoPE):
    """Tokens offset.. of the pages src_pages [n] (read as one run of n * P slots) copied into
    slots dst [M] in every layer, keys turned forward by `shift` rotary positions and
    multiplied by `key_scale` (scalars). dst -1: nothing written. Each source page is read
    once per layer."""
    num_layers = kv.page_leaves()[0].shape[0]
    m = dst.shape[0]
    shifts = jnp.full((m,), shift, jnp.int32)
    rows = jnp.minimum(offset + jnp.arange(m), src_pages.shape[0] * kv.page_size - 1)

    def layer_copy(layer, kv):
        k, v = kv.load_pages(layer, src_pages[None])  # [1, n, P, K, D]
        k = k.reshape(-1, *k.shape[3:])[rows]  # [M, K, D]
        v = v.reshape(-1, *v.shape[3:])[rows]
        k = rope.rotate(k.astype(jnp.float32), shifts) * key_scale
        return kv.write(layer, dst, k, v.astype(jnp.float32))

    return jax.lax.fori_loop(0, num_layers, layer_copy, kv)


class ChunkCopier:
    """The jitted chunk copy (one program per padded token count); counts its compiles.

    A chunk's tokens first.. sit in its pages from page first // P on, at offset first % P,
    so the copy reads the pages it spans and nothing more."""

    def __init__(self, rope: RoPE):
        self._copy = kvjax_jit.jit(functools.partial(copy_rotated, rope=rope),
                             donate_argnums=0)

    @property
    def num_compiles(self) -> int:
        return self._copy.num_compiles

    def copy(self, kv, src_pages: np.ndarray, offset: int, dst: np.ndarray, shift: int,
             key_scale: float):
        """Copies tokens offset.. of src_pages [n // P + 1] (offset < page size) into dst
        slots [n] (-1: nothing), n a power of two (`kvjax.memory.ops.ChunkLoadPlan`)."""
        return self._copy(kv, np.asarray(src_pages, np.int32), np.int32(offset),
                          np.asarray(dst, np.int32), np.int32(shift), np.float32(key_scale))
