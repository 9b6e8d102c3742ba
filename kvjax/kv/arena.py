"""One device arena of byte frames holding the KV pages of several models.

A frame is a fixed number of 32-bit words, the same for every model that shares the arena; a
model's page is one frame, so a frame freed by one model can become a page of another. Models
differ in layers, heads, head dim, dtype and codec, so each fits as many tokens in a frame as
its bytes per token allow: its page size P is derived from the frame, not configured.

Inside a frame a model lays its page out layer by layer, `words_per_layer` words each; a layer
holds one block per stored entry (keys, then values; for a quantized codec its codes and its
scales), each block P token rows of that entry's words:

    arena [F, W] uint32
    frame f as model m's page: [L, Wl] (the first L * Wl words; the rest unused)
    layer l: [k entries..., v entries...], entry e: [P, n_e] words, token row p at p * n_e

`ArenaKV` is a model's view of the arena and implements `KVState` for codecs that store each
token alone (exact float K/V, int8 / int4 / int2 / fp8 per token); it encodes with the codec,
bitcasts the codes and scales to words and scatters them by flat slot, so one step writes only
its own tokens and reads only the pages in its block tables.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.config import ModelConfig
from kvjax.kv import codecs
from kvjax.kv import state as kv_state
from kvjax.kv.quantized import _decode, _encode, is_kivi, make_codec
from kvjax.kv.spec import KVCacheSpec, group_spec

WORD = 4  # bytes per arena word (uint32)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One stored entry of one tensor (K or V): `shape` per token in `dtype`, `num_words` words
    per token row, at word `offset` of the layer's block."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    num_words: int
    offset: int


@dataclasses.dataclass(frozen=True)
class FrameLayout:
    """How one model lays its pages out in the arena's frames (static).

    Attributes:
      num_layers: L.
      page_size: P, tokens per frame for this model.
      words_per_layer: Wl, words of one layer's block in a frame.
      k_entries, v_entries: the entries of keys and values, offsets within a layer.
    """

    num_layers: int
    page_size: int
    words_per_layer: int
    k_entries: tuple[Entry, ...]
    v_entries: tuple[Entry, ...]

    @property
    def words_per_token(self) -> int:
        """Words one token takes in one layer, K and V."""
        return sum(e.num_words for e in (*self.k_entries, *self.v_entries))

    @property
    def used_words(self) -> int:
        """Words of a frame this model's page uses (L * Wl)."""
        return self.num_layers * self.words_per_layer


def _token_entries(codec: codecs.KVCodec, num_kv_heads: int, head_dim: int
                   ) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(name, dtype, per-token shape, words) of each entry the codec stores per token."""
    if is_kivi(codec):
        raise ValueError(f"codec {codec.name!r} stores keys per channel group across tokens; "
                         f"an arena frame stores each token's row alone")
    out = []
    for name, s in codec.storage_spec(1, num_kv_heads, head_dim).items():
        shape = tuple(s.shape[1:])
        nbytes = math.prod(shape) * s.dtype.itemsize
        out.append((name, s.dtype.name, shape, -(-nbytes // WORD)))
    return out


def frame_layout(config: ModelConfig, k_codec: codecs.KVCodec, v_codec: codecs.KVCodec,
                 frame_words: int) -> FrameLayout:
    """The layout of `config`'s pages in frames of `frame_words` words (ValueError: none fits)."""
    heads, head_dim, num_layers = config.num_kv_heads, config.head_dim, config.num_layers
    k_raw = _token_entries(k_codec, heads, head_dim)
    v_raw = _token_entries(v_codec, heads, head_dim)
    words_per_token = sum(e[3] for e in (*k_raw, *v_raw))
    page_size = frame_words // (num_layers * words_per_token)
    if page_size < 1:
        raise ValueError(f"a frame of {frame_words * WORD} bytes holds no token of a model with "
                         f"{num_layers} layers and {words_per_token * WORD} bytes per token "
                         f"and layer")
    entries, offset = [], 0
    for raw in (k_raw, v_raw):
        group = []
        for name, dtype, shape, words in raw:
            group.append(Entry(name, dtype, shape, words, offset))
            offset += page_size * words
        entries.append(tuple(group))
    return FrameLayout(num_layers, page_size, frame_words // num_layers, *entries)


def to_words(x: jax.Array, num_words: int) -> jax.Array:
    """x [T, ...] of any dtype -> its bytes as uint32 words [T, num_words] (zero padded)."""
    t = x.shape[0]
    b = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(t, -1)  # [T, bytes]
    b = jnp.pad(b, ((0, 0), (0, num_words * WORD - b.shape[1])))
    return jax.lax.bitcast_convert_type(b.reshape(t, num_words, WORD), jnp.uint32)


def from_words(w: jax.Array, entry: Entry) -> jax.Array:
    """Words [..., n] (n = entry.num_words) -> the entry's values [..., *shape] in its dtype."""
    dtype = jnp.dtype(entry.dtype)
    lead = w.shape[:-1]
    b = jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(*lead, -1)  # [..., n * 4]
    b = b[..., :math.prod(entry.shape) * dtype.itemsize]
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(b.reshape(*lead, *entry.shape), dtype)
    return jax.lax.bitcast_convert_type(b.reshape(*lead, *entry.shape, dtype.itemsize), dtype)


def _codec_name(k_codec: codecs.KVCodec, v_codec: codecs.KVCodec) -> str:
    if k_codec == v_codec:
        return f"arena:{k_codec.name}"
    return f"arena:k:{k_codec.name}/v:{v_codec.name}"


@struct.dataclass
class ArenaKV(kv_state.SlotAddressed):
    """One model's pages in a shared arena (a `KVState`; see the module docstring).

    Page ids are frame ids: the model's allocator hands it frames of the shared pool, so its
    block tables index the arena directly.

    Attributes:
      arena: [F, W] uint32, every model's frames.
      layout: this model's `FrameLayout` (static).
      k_codec, v_codec: the codecs keys and values are stored with (static).
    """

    arena: jax.Array
    layout: FrameLayout = struct.field(pytree_node=False)
    k_codec: codecs.KVCodec = struct.field(pytree_node=False)
    v_codec: codecs.KVCodec = struct.field(pytree_node=False)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def num_pages(self) -> int:
        return self.arena.shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def codec_name(self) -> str:
        return _codec_name(self.k_codec, self.v_codec)

    def _entries(self, tensor: str) -> tuple[Entry, ...]:
        return self.layout.k_entries if tensor == "k" else self.layout.v_entries

    def _codec(self, tensor: str) -> codecs.KVCodec:
        return self.k_codec if tensor == "k" else self.v_codec

    def _row_words(self, layer: jax.Array, slots: jax.Array, tensors: str
                   ) -> tuple[jax.Array, jax.Array]:
        """(frame [M], word index [M, R]) of the rows of `slots` [M] in `layer` for the
        entries of `tensors` ('k', 'v' or 'kv'); invalid slots get frame F (dropped)."""
        p, wl = self.page_size, self.layout.words_per_layer
        valid = (slots >= 0) & (slots < self.num_slots)
        frame = jnp.where(valid, slots // p, self.num_pages)
        within = (slots % p)[:, None]  # [M, 1]
        idx = [e.offset + within * e.num_words + jnp.arange(e.num_words)
               for t in tensors for e in self._entries(t)]
        return frame, layer * wl + jnp.concatenate(idx, axis=1)  # [M, R]

    def _put(self, layer: jax.Array, slots: jax.Array, tensors: str, words: jax.Array
             ) -> ArenaKV:
        frame, idx = self._row_words(layer, slots, tensors)
        arena = self.arena.at[frame[:, None], idx].set(words, mode="drop")
        return self.replace(arena=arena)

    def _encode_words(self, tensor: str, x: jax.Array, layer: jax.Array) -> jax.Array:
        """x [T, K, D] -> the tensor's stored words per token [T, R_t]."""
        stored = _encode(self._codec(tensor), x, layer)
        return jnp.concatenate([to_words(stored[e.name], e.num_words)
                                for e in self._entries(tensor)], axis=1)

    def _decode_words(self, tensor: str, words: jax.Array, layer: jax.Array) -> jax.Array:
        """Stored words [..., R_t] of one tensor -> float32 [..., K, D]."""
        stored, at = {}, 0
        for e in self._entries(tensor):
            stored[e.name] = from_words(words[..., at:at + e.num_words], e)
            at += e.num_words
        return _decode(self._codec(tensor), stored, layer)

    def write(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array
              ) -> ArenaKV:
        """Writes k, v [T, K, D] of `layer` into flat slots [T] (-1: dropped)."""
        words = jnp.concatenate([self._encode_words("k", k, layer),
                                 self._encode_words("v", v, layer)], axis=1)  # [T, R]
        return self._put(layer, slots, "kv", words)

    def load_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K and V of `pages` [B, n] of `layer`, each [B, n, P, K, D] float32."""
        wl, p = self.layout.words_per_layer, self.page_size

        def block(page):  # one frame's layer block [Wl], read in place
            return jax.lax.dynamic_slice(self.arena, (page, layer * wl), (1, wl))[0]

        words = jax.vmap(jax.vmap(block))(pages)  # [B, n, Wl]
        out = []
        for tensor in "kv":
            parts = [words[..., e.offset:e.offset + p * e.num_words].reshape(
                *pages.shape, p, e.num_words) for e in self._entries(tensor)]
            out.append(self._decode_words(tensor, jnp.concatenate(parts, axis=-1), layer))
        return out[0], out[1]

    def read_rows(self, layer: jax.Array, slots: jax.Array, tensor: str) -> jax.Array:
        """The float32 [M, K, D] of one tensor ('k' or 'v') at flat slots [M] of `layer`."""
        frame, idx = self._row_words(layer, slots, tensor)
        words = self.arena[jnp.minimum(frame, self.num_pages - 1)[:, None], idx]
        return self._decode_words(tensor, words, layer)

    def map_keys(self, slots: jax.Array, fn: Callable[[jax.Array], jax.Array]) -> ArenaKV:
        """Keys of `slots` [M] in every layer replaced by fn(keys [L, M, K, D]), re-encoded."""
        layers = range(self.layout.num_layers)
        keys = fn(jnp.stack([self.read_rows(jnp.int32(i), slots, "k") for i in layers]))
        kv = self
        for i in layers:
            kv = kv._put(jnp.int32(i), slots, "k",
                         self._encode_words("k", keys[i], jnp.int32(i)))
        return kv

    def compact(self, plan: kv_state.Compaction, rotate: kv_state.Rotate | None) -> ArenaKV:
        """The plan's token moves (whole stored rows, every layer), then its key rotations."""
        kv = self
        rows = []
        for i in range(self.layout.num_layers):
            frame, idx = self._row_words(jnp.int32(i), plan.src, "kv")
            rows.append(self.arena[jnp.minimum(frame, self.num_pages - 1)[:, None], idx])
        for i, words in enumerate(rows):  # every read before any write
            kv = kv._put(jnp.int32(i), plan.dst, "kv", words)
        if rotate is None:
            return kv
        return kv.map_keys(plan.rot_slots, jax.vmap(lambda keys: rotate(keys, plan.rot_shifts)))

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> ArenaKV:
        """Copy-on-write: frame dst[i] becomes a copy of frame src[i]. src, dst: [C]."""
        return self.replace(arena=self.arena.at[dst].set(self.arena[src]))

    def _frames(self) -> jax.Array:
        """The arena as this model's pages [F, L, Wl]."""
        lay = self.layout
        return self.arena[:, :lay.used_words].reshape(self.num_pages, lay.num_layers,
                                                      lay.words_per_layer)

    def page_leaves(self) -> list[jax.Array]:
        """[pages as [L, F, Wl] words]: swap, tiers and snapshots move whole layer blocks."""
        return [self._frames().transpose(1, 0, 2)]

    def with_page_leaves(self, leaves: Sequence[jax.Array]) -> ArenaKV:
        (pages,) = leaves
        lay = self.layout
        flat = pages.transpose(1, 0, 2).reshape(self.num_pages, lay.used_words)
        return self.replace(arena=self.arena.at[:, :lay.used_words].set(flat))

    def nbytes(self) -> int:
        """Device bytes of the whole arena (shared with the other models)."""
        return self.arena.nbytes


def arena_codecs(config: ModelConfig, kv_dtype, codec_name: str, **options
                 ) -> tuple[codecs.KVCodec, codecs.KVCodec]:
    """(key codec, value codec) a model stores in an arena: its exact dtype for 'none', else
    the named per-token codec."""
    if codec_name == "none":
        codec = codecs.IdentityCodec(jnp.dtype(kv_dtype).name)
    else:
        codec = make_codec(codec_name, **options)
    return codec, codec


def init_arena(num_frames: int, frame_words: int) -> jax.Array:
    """A zeroed arena [num_frames, frame_words] uint32."""
    if num_frames <= 0 or frame_words <= 0:
        raise ValueError(f"num_frames={num_frames} and frame_words={frame_words} must be "
                         f"positive")
    return jnp.zeros((num_frames, frame_words), jnp.uint32)


def arena_cache_spec(config: ModelConfig, layout: FrameLayout, k_codec: codecs.KVCodec,
                     v_codec: codecs.KVCodec) -> KVCacheSpec:
    """The spec of `config`'s pages as `layout` puts them in frames: a token's words (codes and
    scales padded to whole words) per tensor, and a layer block's words past its P tokens."""
    (group,) = config.kv_layer_groups()  # FrameLayout lays out one group of every layer

    def words_bytes(entries: tuple[Entry, ...]):
        return lambda heads, width: float(sum(e.num_words for e in entries) * WORD)

    spare = layout.words_per_layer - layout.page_size * layout.words_per_token
    return KVCacheSpec((group_spec(
        group, codec_name=_codec_name(k_codec, v_codec), page_size=layout.page_size,
        tensor_bytes=(words_bytes(layout.k_entries), words_bytes(layout.v_entries)),
        page_extra_bytes=spare * WORD),))



