"""Mixed-precision KV pages (DiffKV): one pool whose token rows each carry a precision class.

Every token row of a page stores its key and its value at a precision class of its own: exact
(the pool's float dtype), int8 (one scale per token and kv head) or int4 (a scale and a zero per
`group` channels), keys and values apart (DiffKV's K8V4: keys at 8 bits, values at 4). The
class of each row is data, two small int8 arrays beside the rows, so changing a class never
recompiles, and the classes move with the rows wherever rows move (swap, tiers, snapshots,
disaggregation, retention compaction):

    k_words, v_words   [L, num_pages, P, W] uint32   the row's codes and metadata as words
    k_bits, v_bits     [L, num_pages, P] int8        its class: 0 exact, 8, or 4 bits

A row holds W words, enough for its exact form; a coarser class fills the first words with its
codes then its metadata (`kvjax.kv.arena.to_words`) and leaves the rest zero. Writes store the
step's new tokens at the pool's write class (`write_bits`, exact by default, or K8V4 from the
start); `demote` re-encodes pages in place at a coarser class, never a finer one (a rounded row
cannot become exact again). Attention decodes each row at its class (`load_pages`), so the
blockwise attention and every mover use the state unchanged.

Bytes: the device buffers hold W words per row whatever the class, so demotion frees no device
memory by itself. What it frees is counted in bytes (`cache_spec`: bytes per token of each pair
of classes) by the host's `kvjax.memory.precision.PrecisionLedger`, which lends them to new
pages of a pool given more page slots than its byte budget buys at exact precision. Counting
bytes keeps a demoted page where it is (same page id, same block-table entry: no copy, no
second allocator of page sizes); class-sized sub-pages would return device memory too, at the
price of an allocator of several page sizes and a block-table rewrite per demotion.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.config import ModelConfig
from kvjax.kv import codecs
from kvjax.kv import state as kv_state
from kvjax.kv.arena import WORD, Entry, from_words, to_words
from kvjax.kv.spec import PRECISION_BITS, KVCacheSpec, coarseness, group_spec


def pool_name(dtype: str, group: int, write_bits: tuple[int, int]) -> str:
    """The pool's codec name (its provenance): exact dtype, int4 group and write class."""
    return f"mixed-{jnp.dtype(dtype).name}-g{group}-k{write_bits[0]}v{write_bits[1]}"


def class_codecs(dtype: str = "float32", group: int = 32) -> dict[int, codecs.KVCodec]:
    """bits -> the codec of that class: exact in `dtype`, int8 per token, int4 per `group`."""
    return {0: codecs.IdentityCodec(jnp.dtype(dtype).name), 8: codecs.Int8Codec(),
            4: codecs.IntCodec(4, group)}


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How each class lays a token row of one tensor out in W words (static).

    Attributes:
      words: W, words per row (the widest class).
      entries: per class (in `PRECISION_BITS` order), its stored entries at word offsets.
    """

    words: int
    entries: tuple[tuple[Entry, ...], ...]


def row_layout(class_codec: dict[int, codecs.KVCodec], num_kv_heads: int, head_dim: int
               ) -> RowLayout:
    """The row layout of one tensor of K heads of width D under each class's codec."""
    per_class = []
    for bits in PRECISION_BITS:
        entries, offset = [], 0
        for name, s in class_codec[bits].storage_spec(1, num_kv_heads, head_dim).items():
            shape = tuple(s.shape[1:])
            words = -(-math.prod(shape) * s.dtype.itemsize // WORD)
            entries.append(Entry(name, s.dtype.name, shape, words, offset))
            offset += words
        per_class.append(tuple(entries))
    words = max(e[-1].offset + e[-1].num_words for e in per_class)
    return RowLayout(words, tuple(per_class))


def _encode_rows(codec: codecs.KVCodec, entries: tuple[Entry, ...], words: int, x: jax.Array
                 ) -> jax.Array:
    """x [R, K, D] encoded by `codec` -> rows of words [R, words] (zero past its entries)."""
    stored = codec.encode(x)
    out = jnp.concatenate([to_words(stored[e.name], e.num_words) for e in entries], axis=-1)
    return jnp.pad(out, ((0, 0), (0, words - out.shape[-1])))


def _decode_rows(codec: codecs.KVCodec, entries: tuple[Entry, ...], w: jax.Array) -> jax.Array:
    """Rows of words [..., W] stored by `codec` -> [..., K, D] float32."""
    return codec.decode({e.name: from_words(w[..., e.offset:e.offset + e.num_words], e)
                         for e in entries})


def encode_at(class_codec, layout: RowLayout, x: jax.Array, bits: jax.Array) -> jax.Array:
    """x [R, K, D] -> words [R, W], row r at class bits[r] (an int array [R]: data)."""
    out = jnp.zeros((x.shape[0], layout.words), jnp.uint32)
    for c, entries in zip(PRECISION_BITS, layout.entries, strict=True):
        words = _encode_rows(class_codec[c], entries, layout.words, x)
        out = jnp.where((bits == c)[:, None], words, out)
    return out


def decode_at(class_codec, layout: RowLayout, w: jax.Array, bits: jax.Array) -> jax.Array:
    """Words [..., W] of rows at classes bits [...] -> [..., K, D] float32."""
    out = None
    for c, entries in zip(PRECISION_BITS, layout.entries, strict=True):
        x = _decode_rows(class_codec[c], entries, w)
        out = x if out is None else jnp.where((bits == c)[..., None, None], x, out)
    return out


def _coarser(a: jax.Array, b: jax.Array) -> jax.Array:
    """Elementwise the coarser of two class arrays (ranks: 0 < 8 < 4)."""
    rank = jnp.zeros(max(PRECISION_BITS) + 1, jnp.int32).at[jnp.asarray(PRECISION_BITS)].set(
        jnp.arange(len(PRECISION_BITS), dtype=jnp.int32))  # bits -> coarseness
    return jnp.where(rank[a] >= rank[b], a, b)


@struct.dataclass
class MixedPrecisionKV(kv_state.SlotAddressed):
    """A pool of pages whose token rows each carry a precision class (module docstring).

    Attributes:
      k_words, v_words: [L, num_pages, P, W] uint32, each row at its class.
      k_bits, v_bits: [L, num_pages, P] int8, the class of each row (0 exact, 8, 4).
      k_layout, v_layout: the row layouts (static).
      dtype: the exact class's dtype (static).
      group: the int4 class's channel group (static).
      write_bits: (key bits, value bits) newly written tokens take (static).
    """

    k_words: jax.Array
    v_words: jax.Array
    k_bits: jax.Array
    v_bits: jax.Array
    k_layout: RowLayout = struct.field(pytree_node=False)
    v_layout: RowLayout = struct.field(pytree_node=False)
    dtype: str = struct.field(pytree_node=False, default="float32")
    group: int = struct.field(pytree_node=False, default=32)
    write_bits: tuple[int, int] = struct.field(pytree_node=False, default=(0, 0))

    @property
    def codec_name(self) -> str:
        return pool_name(self.dtype, self.group, self.write_bits)

    @property
    def class_codec(self) -> dict[int, codecs.KVCodec]:
        return class_codecs(self.dtype, self.group)

    @property
    def num_pages(self) -> int:
        return self.k_words.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_words.shape[2]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def load_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K and V of `pages` [B, n] of `layer`, each [B, n, P, K, D] float32, every row
        decoded at its own class."""
        cc = self.class_codec
        k = decode_at(cc, self.k_layout, self.k_words[layer, pages], self.k_bits[layer, pages])
        v = decode_at(cc, self.v_layout, self.v_words[layer, pages], self.v_bits[layer, pages])
        return k, v

    def write(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array
              ) -> MixedPrecisionKV:
        """Writes k, v [T, K, D] of `layer` into flat slots [T] (-1: dropped), at the write
        class."""
        kb, vb = self.write_bits
        cc, t = self.class_codec, slots.shape[0]
        k_bits, v_bits = jnp.full((t,), kb, jnp.int8), jnp.full((t,), vb, jnp.int8)
        return self.replace(
            k_words=kv_state.scatter_rows(self.k_words, layer, slots,
                                          encode_at(cc, self.k_layout, k, k_bits)),
            v_words=kv_state.scatter_rows(self.v_words, layer, slots,
                                          encode_at(cc, self.v_layout, v, v_bits)),
            k_bits=_scatter_classes(self.k_bits, layer, slots, k_bits),
            v_bits=_scatter_classes(self.v_bits, layer, slots, v_bits))

    def demote(self, pages: jax.Array, k_bits: jax.Array, v_bits: jax.Array
               ) -> MixedPrecisionKV:
        """Pages [M] re-encoded in place in every layer: each row's key at the coarser of its
        class and k_bits, its value likewise (int scalars: data, so any class compiles once).
        Repeated pages (padding) are harmless: every read precedes every write."""
        rows = (pages[:, None] * self.page_size
                + jnp.arange(self.page_size, dtype=pages.dtype)).reshape(-1)  # [M * P]
        return self._demote_rows(rows, jnp.broadcast_to(k_bits, rows.shape),
                                 jnp.broadcast_to(v_bits, rows.shape))

    def _demote_rows(self, slots: jax.Array, k_bits: jax.Array, v_bits: jax.Array
                     ) -> MixedPrecisionKV:
        """Token rows at flat slots [R] re-encoded in place in every layer, row i's key at the
        coarser of its class and k_bits[i] ([R] ints), its value likewise. Rows never get
        finer. Private: rows change class a whole page at a time (`demote`), since the host's
        `PrecisionLedger` counts each page's bytes at one class."""
        cc = self.class_codec

        def recode(words, bits, layout, target):
            flat_w = words.reshape(words.shape[0], -1, words.shape[-1])  # [L, N * P, W]
            flat_b = bits.reshape(bits.shape[0], -1)  # [L, N * P]
            w, b = flat_w[:, slots], flat_b[:, slots]  # [L, R, W], [L, R]
            new_bits = _coarser(b.astype(jnp.int32), target.astype(jnp.int32)[None])
            x = decode_at(cc, layout, w, b)  # [L, R, K, D]
            new = encode_at(cc, layout, x.reshape(-1, *x.shape[-2:]), new_bits.reshape(-1))
            new = jnp.where((new_bits == b)[..., None], w, new.reshape(w.shape))
            return (flat_w.at[:, slots].set(new).reshape(words.shape),
                    flat_b.at[:, slots].set(new_bits.astype(b.dtype)).reshape(bits.shape))

        k_words, k_new = recode(self.k_words, self.k_bits, self.k_layout, k_bits)
        v_words, v_new = recode(self.v_words, self.v_bits, self.v_layout, v_bits)
        return self.replace(k_words=k_words, v_words=v_words, k_bits=k_new, v_bits=v_new)

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> MixedPrecisionKV:
        """Copy-on-write: page dst[i] becomes a copy of page src[i] (rows and classes)."""
        return self.with_page_leaves([x.at[:, dst].set(x[:, src]) for x in self.page_leaves()])

    def page_leaves(self) -> list[jax.Array]:
        """[k_words, v_words, k_bits, v_bits]: every leaf holds one row per token."""
        return [self.k_words, self.v_words, self.k_bits, self.v_bits]

    def with_page_leaves(self, leaves: Sequence[jax.Array]) -> MixedPrecisionKV:
        k_words, v_words, k_bits, v_bits = leaves
        return self.replace(k_words=k_words, v_words=v_words, k_bits=k_bits, v_bits=v_bits)

    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.page_leaves())


def importance_bits(scores: jax.Array, page_size: int, num_exact: int, num_int8: int
                    ) -> jax.Array:
    """DiffKV's classes by importance, a page at a time: of S tokens with `scores` [S]
    (higher: more important; e.g. observed attention, or -||k|| as kvpress's KNorm ranks keys)
    in pages of `page_size`, the `num_exact` pages holding the most important tokens (a page
    ranks by its most important token) stay exact, the next `num_int8` take int8 and the
    rest int4 -> bits [ceil(S / page_size)] int32, one class per page.

    Whole pages, not rows: the host's `PrecisionLedger` counts a page's bytes at one class,
    and one `demote` per class applies them; a token that must stay exact keeps the rest of
    its page exact too."""
    pad = -scores.shape[0] % page_size
    scores = jnp.pad(scores, (0, pad), constant_values=-jnp.inf)
    page_scores = scores.reshape(-1, page_size).max(axis=1)  # [num_pages]
    rank = jnp.argsort(jnp.argsort(-page_scores))  # 0: the most important page
    return jnp.where(rank < num_exact, 0, jnp.where(rank < num_exact + num_int8, 8, 4)
                     ).astype(jnp.int32)


def _scatter_classes(bits: jax.Array, layer: jax.Array, slots: jax.Array, values: jax.Array
                     ) -> jax.Array:
    """bits [L, N, P] with flat slots [T] of `layer` set to values [T] (-1: dropped)."""
    return kv_state.scatter_rows(bits[..., None], layer, slots, values[:, None])[..., 0]


def _check_config(config: ModelConfig, write_bits: tuple[int, int]) -> None:
    if config.mla is not None:
        raise ValueError(f"model {config.name!r} caches MLA latents; a mixed-precision pool "
                         f"holds K and V heads")
    coarseness(write_bits[0], "write key")
    coarseness(write_bits[1], "write value")


def init_mixed_kv(config: ModelConfig, num_pages: int, page_size: int, *,
                  dtype: str = "float32", group: int = 32, write_bits: tuple[int, int] = (0, 0)
                  ) -> MixedPrecisionKV:
    """A zeroed mixed-precision pool of `num_pages` pages of `page_size` tokens (every row
    exact zeros until written)."""
    if num_pages <= 0 or page_size <= 0:
        raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be positive")
    _check_config(config, write_bits)
    layout = row_layout(class_codecs(dtype, group), config.num_kv_heads, config.head_dim)
    rows = (config.num_layers, num_pages, page_size)
    return MixedPrecisionKV(
        k_words=jnp.zeros((*rows, layout.words), jnp.uint32),
        v_words=jnp.zeros((*rows, layout.words), jnp.uint32),
        k_bits=jnp.zeros(rows, jnp.int8), v_bits=jnp.zeros(rows, jnp.int8),
        k_layout=layout, v_layout=layout, dtype=jnp.dtype(dtype).name, group=group,
        write_bits=(int(write_bits[0]), int(write_bits[1])))


def cache_spec(config: ModelConfig, page_size: int, *, dtype: str = "float32", group: int = 32,
               write_bits: tuple[int, int] = (0, 0)) -> KVCacheSpec:
    """The spec of a mixed-precision pool: a token costs its write class's bytes; every pair
    of classes has its bytes per token (`KVSpec.class_token_bytes`). A row's class arrays (one
    byte each for K and V) count in every class."""
    _check_config(config, write_bits)
    cc = class_codecs(dtype, group)
    groups = config.kv_layer_groups()

    def per_layer(k_bits: int, v_bits: int) -> float:
        k, d = config.num_kv_heads, config.head_dim
        return cc[k_bits].bytes_per_token(k, d) + cc[v_bits].bytes_per_token(k, d) + 2

    classes = tuple(((kb, vb), per_layer(kb, vb))
                    for kb in PRECISION_BITS for vb in PRECISION_BITS)
    spec = KVCacheSpec(tuple(
        group_spec(g, codec_name=pool_name(dtype, group, write_bits), page_size=page_size,
                   tensor_bytes=[lambda h, w, b=b: cc[b].bytes_per_token(h, w) + 1
                                 for b in write_bits])
        for g in groups))
    spec.check_single_group()
    return spec.with_specs(lambda s: dataclasses.replace(s, class_token_bytes=classes))
