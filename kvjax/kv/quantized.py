"""Quantized paged KV state: the page pool holds codec codes and metadata, not float K and V.

`QuantizedPagedKV` implements `kvjax.kv.state.KVState`, so the jitted step and the blockwise
attention use it unchanged: `write` encodes the step's new tokens inside the jitted step
(quantize on write), and `load_pages` gathers only the requested pages and decodes them to
float32. Its page leaves (codes and metadata) are page-major, `[L, num_pages, ...]`, so
swapping, scrubbing and copy-on-write treat it like any paged state; KIVI's windows are its
sequence-slot leaves.

Per-token codecs (int8, int4, int2, fp8_e4m3, fp8_e5m2, and none): each token's K and V are
encoded alone, from that token's own values, with the codec's per-token metadata; a page holds
the codec's `storage_spec` rows for its P tokens. fp8 runs in dynamic scaling mode by default
(a float32 scale per token per kv head, amax / fp8_max); with `scaling="calibrated"` the state
holds separate key and value codecs with static per-layer, per-kv-head scales
(`calibrate_fp8`; `Engine.calibrate_kv` computes them from a calibration set), and writing
through a state that has none raises ValueError.

KIVI (kivi4, kivi2; group g, residual R): keys per channel over each group of g consecutive
tokens of a sequence, values per token over g channels, and the most recent tokens exact. At
sequence length S, tokens [0, F) are read from the codes and [F, S) exactly, with
F = codec.num_quantized(S) = max(S - R, 0) // g * g (`codecs.kivi_roundtrip_reference`).
The layout, for page size P a multiple of g:

  * k_stored: key codes [L, num_pages, P, K, D*b/8] and key scale, zero
    [L, num_pages, P/g, K, D] (row j of a page is the metadata of its token group j);
  * v_stored: value codes [L, num_pages, P, K, D*b/8], scale, zero [L, num_pages, P, K, D/g];
  * k_residual, v_residual: [L, num_seq_slots, W, K, D] float32 with W = R + g, the exact
    window of each running sequence, position p at row p % W of the sequence's slot.

Pages hold codes only; the exact tokens live in the per-sequence windows, so the pool's
capacity is the codes' and the windows cost a fixed W tokens per sequence slot. The step
passes each row's slot (`StepInput.seq_slots`), and KIVI writes and reads go through
`write_rows` and `row_loader`, which see the rows' lengths and block tables. A write ages the
groups that cross F in this step (from the window, or straight from the step's input for
tokens the same step writes), scatters their codes and metadata into the pages, and stores
the new tokens that stay exact in the window. At most R + g - 1 tokens are exact at any time,
so W rows never collide. Within one step the new tokens are written before they are read, so
every query of a prefill chunk reads the state at the chunk's end (causally masked): groups
the chunk ages are read quantized even by its earlier queries.

A speculative verify row is a decode row of several tokens; the scheduler cuts it so that it
ages no group (a row that must age one verifies no drafts: `KVCacheManager.max_verify_tokens`),
so each of its queries reads the groups quantized that its own decode step would, and a rejected
draft never enters an aged group.

The window is per sequence, not per page, so the engine keeps it beside the pages
(`kvjax.engine.residual`): it assigns slots, copies a slot on fork, saves and restores it on
swap, and zeroes it on scrub. With R > 0 a full page's newest tokens may still be exact only:
the engine publishes a page to the prefix cache once all its tokens are quantized, and a row
that starts from h cached tokens reads [0, h) from their codes (its window holds none of them):
F = max(h, num_quantized(S)), the row's floor h in `StepInput.kv_floors`.

Retention compaction (`compact`): per-token codecs move each kept token's codes and metadata;
KIVI lays the kept tokens out again as a sequence of S' tokens (window [F', S'), key groups
below F' encoded again where their tokens changed, the floor back to 0).

Bytes per token (all L layers, K and V; m the metadata dtype's bytes, 4 by default):

    none (dtype bytes e)         2 L K D e
    int8, fp8_* (dynamic)        2 L K (D + m)          fp8 scale is always float32 (m = 4)
    fp8_* (calibrated)           2 L K D                the static scales cost nothing per token
    int4, int2 (bits b, group g) 2 L K (D b / 8 + 2 m D / g)
    kivi4, kivi2                 2 L K (D b / 8 + 2 m D / g)

plus, for KIVI, `residual_bytes` = 2 L num_seq_slots (R + g) K D 4 for the windows:
`nbytes()` equals num_pages * P * `kv_bytes_per_token` + `residual_bytes`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.config import ModelConfig
from kvjax.kv import codecs, layout
from kvjax.kv import spec as kv_spec
from kvjax.kv import state as kv_state

_KIVI = ("kivi2", "kivi4")
_FP8 = ("fp8_e4m3", "fp8_e5m2")
_WINDOW_DTYPE = jnp.float32
_ALL = slice(None)  # `layer` of _gather_rows and _scatter_rows: every layer


def _positive_int(field: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{field} must be a positive int, got {value!r}")
    return value


def make_codec(codec_name: str, **options: Any) -> codecs.KVCodec:
    """The codec this state uses for `codec_name` and `options` (see the module docstring).

    Differs from `codecs.get_codec` in two defaults: fp8 codecs use dynamic scaling and KIVI
    codecs use residual=0 (pass residual=32 or 128 for KIVI's exact window). A `page_size`
    option is accepted and ignored here (the pool checks it).
    """
    options.pop("page_size", None)
    if codec_name in _FP8:
        options.setdefault("scaling", codecs.Fp8Scaling.DYNAMIC)
    if codec_name in _KIVI:
        options.setdefault("residual", 0)
    return codecs.get_codec(codec_name, **options)


def is_kivi(codec: codecs.KVCodec) -> bool:
    return isinstance(codec, codecs.KiviCodec)


def is_layered(codec: codecs.KVCodec) -> bool:
    """Whether the codec's encode and decode take the layer (per-layer static fp8 scales)."""
    return isinstance(codec, codecs.Fp8Codec) and codec.scaling is codecs.Fp8Scaling.CALIBRATED


def _encode(codec: codecs.KVCodec, x: jax.Array, layer: jax.Array) -> dict[str, jax.Array]:
    return codec.encode(x, layer=layer) if is_layered(codec) else codec.encode(x)


def _decode(codec: codecs.KVCodec, stored: dict[str, jax.Array], layer: jax.Array
            ) -> jax.Array:
    return codec.decode(stored, layer=layer) if is_layered(codec) else codec.decode(stored)


def _check_page_size(codec: codecs.KVCodec, page_size: int) -> None:
    _positive_int("page_size", page_size)
    if is_kivi(codec) and page_size % codec.group:
        raise ValueError(f"page_size={page_size} is not a multiple of the KIVI group "
                         f"{codec.group}: a token group must not straddle pages")


def cache_spec(config: ModelConfig, page_size: int, codec_name: str, /, groups=None,
               **options: Any) -> kv_spec.KVCacheSpec:
    """The spec of `config`'s layer groups in a quantized pool of pages of `page_size` tokens.

    Bytes per token are the codec's codes and metadata, keys and values alike (KIVI's keys
    cost what its values do: 2 D / g metadata per token); a KIVI sequence slot holds the
    exact window, W rows of float32 keys and values per layer. `groups`: the pool's layer
    groups (`kvjax.kv.spec.LayerGroup`s), None: the model's.
    """
    codec = make_codec(codec_name, **options)
    _check_page_size(codec, page_size)
    return _cache_spec(config, codec, page_size, groups)


def _cache_spec(config: ModelConfig, codec: codecs.KVCodec, page_size: int, groups=None
                ) -> kv_spec.KVCacheSpec:
    window_itemsize = jnp.dtype(_WINDOW_DTYPE).itemsize
    return kv_spec.KVCacheSpec(tuple(
        kv_spec.group_spec(group, codec_name=codec.name, page_size=page_size,
                           tensor_bytes=codec.bytes_per_token,
                           seq_slot_bytes=window_size(codec) * group.format.values_per_token
                           * window_itemsize)
        for group in (config.kv_layer_groups() if groups is None else groups)))


def kv_bytes_per_token(config: ModelConfig, codec_name: str, /, *,
                       page_size: int | None = None, **options: Any) -> float:
    """Bytes one token takes in a quantized pool's pages: all layers, K and V, codes and metadata.

    Args:
        config: the model.
        codec_name: a registered codec name (`kvjax.kv.codecs.CODECS`).
        page_size: P, checked against the codec when given (KIVI needs a multiple of g).
        **options: the codec's options (as for `make_codec`).

    Returns:
        The exact bytes per token; KIVI's exact windows are on top (`residual_bytes`).
    """
    codec = make_codec(codec_name, **options)
    if page_size is not None:
        _check_page_size(codec, page_size)
    return _cache_spec(config, codec, page_size or _any_page_size(codec)).bytes_per_token


def window_size(codec: codecs.KVCodec) -> int:
    """W, the exact-window rows one KIVI sequence slot holds (0 for other codecs)."""
    return codec.residual + codec.group if is_kivi(codec) else 0


def num_seq_slots_for(codec_name: str, max_num_seqs: int, **options: Any) -> int:
    """Window slots an engine running `max_num_seqs` sequences needs (0 for non-KIVI codecs).

    One more than max_num_seqs: a group prefill holds its slot while it forks its samples.
    """
    return max_num_seqs + 1 if is_kivi(make_codec(codec_name, **options)) else 0


def residual_bytes(config: ModelConfig, num_seq_slots: int, codec_name: str, /,
                   **options: Any) -> int:
    """Bytes of the KIVI exact windows of `num_seq_slots` sequences (K and V, float32)."""
    codec = make_codec(codec_name, **options)
    spec = _cache_spec(config, codec, _any_page_size(codec))
    return int(spec.seq_slot_bytes * num_seq_slots)


def _any_page_size(codec: codecs.KVCodec) -> int:
    """A page size the codec accepts: bytes per token and per window do not depend on it."""
    return codec.group if is_kivi(codec) else 1


def _is_float8(dtype: Any) -> bool:
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1


def _float8_views(spec: dict[str, jax.ShapeDtypeStruct]) -> tuple[tuple[str, str], ...]:
    """(name, float8 dtype name) of the spec entries the pool holds as uint8 bytes."""
    return tuple((name, s.dtype.name) for name, s in spec.items() if _is_float8(s.dtype))


def _page_major(spec: dict[str, jax.ShapeDtypeStruct], num_layers: int, num_pages: int
                ) -> dict[str, jax.Array]:
    """Zeroed [L, num_pages, rows_per_page, ...] buffers from a spec with leading axis S.

    float8 entries are held as uint8 bytes: XLA:CPU scatters into a float8 array by converting
    the whole array, which made every write cost a pass over the pool.
    """
    return {name: jnp.zeros((num_layers, num_pages, s.shape[0] // num_pages, *s.shape[1:]),
                            jnp.uint8 if _is_float8(s.dtype) else s.dtype)
            for name, s in spec.items()}


def _scatter_rows(x: jax.Array, layer: jax.Array | slice, rows: jax.Array, values: jax.Array
                  ) -> jax.Array:
    """`kv_state.scatter_rows`, with float8 values stored as their bytes (`_page_major`)."""
    if _is_float8(values.dtype):
        values = jax.lax.bitcast_convert_type(values, jnp.uint8)
    return kv_state.scatter_rows(x, layer, rows, values)


def _gather_rows(x: jax.Array, layer: jax.Array | slice, rows: jax.Array) -> jax.Array:
    """Rows of `layer` of x [L, N, R, ...] at flat indices rows (any shape I) -> I + [...]
    ([L] + I + [...] for layer=_ALL)."""
    if isinstance(layer, slice):
        return x.reshape(x.shape[0], -1, *x.shape[3:])[layer, rows]
    return x[layer].reshape(-1, *x.shape[3:])[rows]


def _as_float8(gathered: dict[str, jax.Array], float8_views: tuple[tuple[str, str], ...]
               ) -> dict[str, jax.Array]:
    """Gathered storage entries with the ones held as uint8 bytes viewed as their float8."""
    views = dict(float8_views)
    return {name: jax.lax.bitcast_convert_type(x, views[name]) if name in views else x
            for name, x in gathered.items()}


def _gather_pages(stored: dict[str, jax.Array], layer: jax.Array, pages: jax.Array,
                  float8_views: tuple[tuple[str, str], ...]) -> dict[str, jax.Array]:
    """Rows of `pages` [B, n] of `layer`, each [B, n, R, ...], float8 entries as float8."""
    return _as_float8({name: x[layer, pages] for name, x in stored.items()}, float8_views)


@struct.dataclass
class QuantizedPagedKV:
    """A pool of quantized KV pages shared by all sequences (see the module docstring).

    Attributes:
        k_stored: the key storage, name -> [L, num_pages, rows, ...]: the codec's
            `storage_spec` (rows = P), or for KIVI its `key_storage_spec` (codes: rows = P,
            scale and zero: rows = P / g).
        v_stored: the value storage, name -> [L, num_pages, P, ...] (`storage_spec`).
        k_residual, v_residual: KIVI only (else None), [L, num_seq_slots, W, K, D] float32:
            each sequence slot's exact tokens, position p at row p % W.
        codec: the key codec (static); also the value codec unless `v_codec` is set.
        v_codec: the value codec when it differs (calibrated fp8: scales of their own), else
            None (static).
        float8_views: (name, float8 dtype name) of the storage entries held as uint8 bytes
            (static; fp8 codes), bitcast back after the gather.
    """

    k_stored: dict[str, jax.Array]
    v_stored: dict[str, jax.Array]
    k_residual: jax.Array | None
    v_residual: jax.Array | None
    codec: codecs.KVCodec = struct.field(pytree_node=False)
    v_codec: codecs.KVCodec | None = struct.field(pytree_node=False, default=None)
    float8_views: tuple[tuple[str, str], ...] = struct.field(pytree_node=False, default=())

    @property
    def value_codec(self) -> codecs.KVCodec:
        return self.codec if self.v_codec is None else self.v_codec

    @property
    def codec_name(self) -> str:
        """The codecs' names with all their options; part of the KV provenance fingerprint."""
        if self.v_codec is None:
            return self.codec.name
        return f"k:{self.codec.name}/v:{self.v_codec.name}"

    @property
    def needs_rows(self) -> bool:
        """Whether writes and reads need the step's rows (`write_rows`, `row_loader`): KIVI."""
        return is_kivi(self.codec)

    @property
    def num_pages(self) -> int:
        return next(iter(self.v_stored.values())).shape[1]

    @property
    def page_size(self) -> int:
        return next(iter(self.v_stored.values())).shape[2]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_seq_slots(self) -> int:
        return 0 if self.k_residual is None else self.k_residual.shape[1]

    @property
    def window(self) -> int:
        return window_size(self.codec)

    def check_ready(self) -> None:
        """Raises ValueError when the state cannot encode yet (calibrated fp8 without scales)."""
        for codec in (self.codec, self.value_codec):
            if is_layered(codec) and codec.scale is None:
                raise ValueError(f"kv codec {codec.name!r} runs in calibrated mode and has no "
                                 f"scales: call Engine.calibrate_kv(prompts) (or "
                                 f"quantized.calibrate_fp8) first, or pass scaling='dynamic'")

    def load_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K and V of `pages` [B, n] of `layer`, each [B, n, P, K, D] float32, from the codes.

        Only the requested pages are gathered and decoded. For KIVI this is the codes alone:
        tokens still in a sequence's exact window are read through `row_loader`.
        """
        k_stored = _gather_pages(self.k_stored, layer, pages, self.float8_views)
        v_stored = _gather_pages(self.v_stored, layer, pages, self.float8_views)
        v = _decode(self.value_codec, v_stored, layer)
        if is_kivi(self.codec):
            return self.codec.decode_keys(k_stored), v
        return _decode(self.codec, k_stored, layer), v

    def project_queries(self, layer: jax.Array, q: jax.Array) -> jax.Array:
        """Codes decode to whole keys: the queries as they are."""
        return q

    def row_loader(self, layer: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
                   seq_slots: jax.Array, kv_floors: jax.Array | None = None):
        """A page loader for KIVI rows: codes for aged tokens, the exact window for the rest.

        Args:
            layer: the layer.
            block_tables: [B, W_bt] int32, the rows' block tables.
            kv_lens: [B] int32, the rows' lengths after this step's write.
            seq_slots: [B] int32, the rows' window slots.
            kv_floors: [B] int32, positions below which rows read codes (`num_aged`), or None.

        Returns:
            (logical tables [B, W_bt], loader) for `paged_attention_blockwise`: the tables hold
            page indices within each row (0, 1, ...), which the loader maps through
            `block_tables` and to token positions, so it can read each position from the
            codes or from the row's window. Per-token codecs read by page alone: the rows'
            block tables and `load_pages`.
        """
        if not is_kivi(self.codec):
            return block_tables, functools.partial(self.load_pages, layer)
        page_size, window = self.page_size, self.window
        logical = jnp.broadcast_to(jnp.arange(block_tables.shape[1], dtype=jnp.int32),
                                   block_tables.shape)  # [B, W_bt]
        num_aged = self.num_aged(kv_lens, kv_floors)  # [B]

        def load(index: jax.Array) -> tuple[jax.Array, jax.Array]:
            pages = jnp.take_along_axis(block_tables, index, axis=1)  # [B, n]
            k, v = self.load_pages(layer, pages)  # [B, n, P, K, D]
            positions = index[..., None] * page_size + jnp.arange(page_size)  # [B, n, P]
            rows = seq_slots[:, None, None] * window + positions % window  # [B, n, P]
            is_aged = (positions < num_aged[:, None, None])[..., None, None]
            k_exact = _gather_rows(self.k_residual, layer, rows)  # [B, n, P, K, D]
            v_exact = _gather_rows(self.v_residual, layer, rows)
            return jnp.where(is_aged, k, k_exact), jnp.where(is_aged, v, v_exact)

        return logical, load

    def num_aged(self, lengths: jax.Array, kv_floors: jax.Array | None) -> jax.Array:
        """KIVI: F, the tokens of rows of these lengths read from the codes: the codec's
        num_quantized, or the row's floor when it is later (a prefix-cache hit of fully
        quantized pages, whose last R tokens no window holds)."""
        aged = self.codec.num_quantized(lengths)
        return aged if kv_floors is None else jnp.maximum(aged, kv_floors)

    def write(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array
              ) -> QuantizedPagedKV:
        """Encodes and writes k, v [T, K, D] of `layer` into flat slots [T] (-1: dropped).

        Per-token codecs only: KIVI writes need the rows (`write_rows`).
        """
        if is_kivi(self.codec):
            raise ValueError(f"{self.codec.name} writes need the step's rows: use write_rows")
        k_enc = _encode(self.codec, k, layer)  # each [T, ...]
        v_enc = _encode(self.value_codec, v, layer)
        return self.replace(
                k_stored={n: _scatter_rows(x, layer, slots, k_enc[n])
                          for n, x in self.k_stored.items()},
                v_stored={n: _scatter_rows(x, layer, slots, v_enc[n])
                          for n, x in self.v_stored.items()})

    def write_rows(self, layer: jax.Array, inp: Any, shape: Any, k: jax.Array, v: jax.Array
                   ) -> QuantizedPagedKV:
        """Writes one step's new tokens k, v [T, K, D] of `layer`, laid out by rows.

        Args:
            layer: the layer.
            inp: the step input (`kvjax.engine.step.StepInput`): block_tables [R, W_bt],
                kv_lens and q_lens [R], seq_slots [R], slot_mapping [T].
            shape: the step shape: row r's q_lens[r] tokens start at token row_starts[r]
                (`kvjax.kv.layout`), at most `row_chunk` of them.
            k, v: [T, K, D].
        """
        if not is_kivi(self.codec):
            return self.write(layer, inp.slot_mapping, k, v)
        starts, token_rows = inp.row_starts, inp.token_rows
        before = inp.kv_lens - inp.q_lens  # [R] tokens cached before this step
        aged_before = self.num_aged(before, inp.kv_floors)
        aged_after = self.num_aged(inp.kv_lens, inp.kv_floors)  # [R]
        per_row = (math.ceil(layout.row_chunk(shape) / self.codec.group)
                   if shape.num_prefill else 0)
        kv = self._age_groups(layer, inp, k, v, starts, before, aged_before, aged_after,
                              per_row, shape.num_decode, shape.num_prefill)
        # The new tokens that stay exact go to their sequence's window.
        offset = jnp.arange(k.shape[0], dtype=jnp.int32) - starts[token_rows]  # [T]
        positions = before[token_rows] + offset
        is_exact = (offset < inp.q_lens[token_rows]) & (positions >= aged_after[token_rows])
        rows = jnp.where(is_exact,
                         inp.seq_slots[token_rows] * self.window + positions % self.window, -1)
        return kv.replace(k_residual=_scatter_rows(kv.k_residual, layer, rows, k),
                          v_residual=_scatter_rows(kv.v_residual, layer, rows, v))

    def _age_groups(self, layer, inp, k, v, starts, before, aged_before, aged_after, per_row,
                    num_decode, num_prefill) -> QuantizedPagedKV:
        """Quantizes the groups each row ages in this step into its pages.

        A decode row ages at most one group, a prefill row of C tokens at most ceil(C / g):
        the static list of candidate groups has that many entries per row.
        """
        g, page_size, window = self.codec.group, self.page_size, self.window
        group_rows = np.concatenate([np.arange(num_decode),
                                     num_decode + np.repeat(np.arange(num_prefill), per_row)])
        group_index = np.concatenate([np.zeros(num_decode, np.int32),
                                      np.tile(np.arange(per_row), num_prefill)])
        if not group_rows.size:
            return self
        first = aged_before[group_rows] + jnp.asarray(group_index, jnp.int32) * g  # [E]
        is_aging = first < aged_after[group_rows]  # [E]
        positions = first[:, None] + jnp.arange(g, dtype=jnp.int32)  # [E, g]
        row_before = before[group_rows][:, None]  # [E, 1]
        # Tokens this step writes come from its input, older ones from the window.
        from_call = (positions >= row_before)[..., None, None]  # [E, g, 1, 1]
        call_index = jnp.clip(starts[group_rows][:, None] + positions - row_before, 0,
                              k.shape[0] - 1)  # [E, g]
        window_rows = inp.seq_slots[group_rows][:, None] * window + positions % window

        def group_of(x: jax.Array, residual: jax.Array) -> jax.Array:
            old = _gather_rows(residual, layer, window_rows)  # [E, g, K, D]
            return jnp.where(from_call, x[call_index].astype(jnp.float32), old)

        k_group, v_group = group_of(k, self.k_residual), group_of(v, self.v_residual)
        tables = inp.block_tables[group_rows]  # [E, W_bt]
        page_index = jnp.clip(positions // page_size, 0, tables.shape[1] - 1)
        pages = jnp.take_along_axis(tables, page_index, axis=1)  # [E, g]
        code_rows = jnp.where(is_aging[:, None], pages * page_size + positions % page_size, -1)
        meta_rows = jnp.where(is_aging, pages[:, 0] * (page_size // g) + first % page_size // g,
                              -1)  # [E]
        k_enc = self.codec.encode_key_group(k_group)  # codes [E, g, ...], scale [E, 1, K, D]
        v_enc = self.codec.encode(v_group)  # each [E, g, ...]
        k_stored = {"codes": _scatter_rows(self.k_stored["codes"], layer, code_rows,
                                           k_enc["codes"])}
        for name in ("scale", "zero"):
            k_stored[name] = _scatter_rows(self.k_stored[name], layer, meta_rows,
                                           k_enc[name][:, 0])  # [E, K, D] rows
        v_stored = {n: _scatter_rows(x, layer, code_rows, v_enc[n])
                    for n, x in self.v_stored.items()}
        return self.replace(k_stored=k_stored, v_stored=v_stored)

    def map_keys(self, slots: jax.Array, fn) -> QuantizedPagedKV:
        """Per-token codecs: the slots' keys are decoded, mapped (float32) and encoded again,
        a second rounding of each. KIVI refuses: its keys share scales over token groups."""
        if is_kivi(self.codec):
            raise ValueError(f"{self.codec.name} keys share scales over groups of tokens: one "
                             f"token's key cannot be rewritten alone")
        num_layers = next(iter(self.k_stored.values())).shape[0]

        def stored_rows(layer: int) -> dict[str, jax.Array]:
            return _as_float8({n: _gather_rows(x, jnp.int32(layer), slots)
                               for n, x in self.k_stored.items()}, self.float8_views)

        keys = jnp.stack([_decode(self.codec, stored_rows(layer), jnp.int32(layer))
                          for layer in range(num_layers)])  # [L, M, K, D]
        new = fn(keys)
        k_stored = dict(self.k_stored)
        for layer in range(num_layers):
            encoded = _encode(self.codec, new[layer], jnp.int32(layer))
            k_stored = {n: _scatter_rows(x, jnp.int32(layer), slots, encoded[n])
                        for n, x in k_stored.items()}
        return self.replace(k_stored=k_stored)

    def compact(self, plan: kv_state.Compaction, rotate: kv_state.Rotate | None
                ) -> QuantizedPagedKV:
        """Per-token codecs: moves the tokens' codes and metadata and rotates keys by
        `map_keys` (`kv_state.compact_token_rows`). KIVI: `_recode`."""
        if not is_kivi(self.codec):
            return kv_state.compact_token_rows(self, plan, rotate)
        return self._recode(plan, rotate)

    def _recode(self, plan: kv_state.Compaction, rotate: kv_state.Rotate | None
                ) -> QuantizedPagedKV:
        """KIVI compaction: the kept tokens, read as attention read them (codes below the old
        F, the window above), are laid out again as a sequence of S' tokens.

        With F' = num_quantized(S') (the floor is 0 afterwards): the window gets new indices
        [F', S'), and a key group below F' is encoded again from its tokens' values when any
        of them changed (moved, rotated, or read from the window before); a group whose tokens
        sit where they did and were codes keeps its codes, so pages the block manager reused
        unmoved (shared ones among them) are never written with other values. Re-encoding a
        group rounds its moved keys once more (their group's scale changes).
        """
        g, window, n = self.codec.group, self.window, plan.keep.shape[0]
        index = jnp.arange(n, dtype=jnp.int32)
        is_kept = plan.keep >= 0
        old_keep = jnp.maximum(plan.keep, 0)
        src = jnp.maximum(plan.kept_src, 0)
        from_codes = old_keep < self.num_aged(plan.old_len, plan.old_floor)  # [N]
        old_rows = plan.seq_slot * window + old_keep % window

        def read(stored: dict[str, jax.Array], residual: jax.Array, decode) -> jax.Array:
            exact = _gather_rows(residual, _ALL, old_rows)  # [L, N, K, D]
            return jnp.where(from_codes[None, :, None, None], decode(stored), exact)

        k = read(self.k_stored, self.k_residual, lambda s: self.codec.decode_key_tokens(
            _gather_rows(s["codes"], _ALL, src),
            _gather_rows(s["scale"], _ALL, src // g),
            _gather_rows(s["zero"], _ALL, src // g)))
        v = read(self.v_stored, self.v_residual, lambda s: self.value_codec.decode(
            {name: _gather_rows(x, _ALL, src) for name, x in s.items()}))
        if rotate is not None:
            k = jax.vmap(lambda keys: rotate(keys, plan.shifts))(k)
        new_aged = self.codec.num_quantized(plan.new_len)
        is_changed = (plan.kept_src != plan.kept_dst) | ~from_codes | (plan.shifts != 0)
        group_end = (jnp.arange(n // g, dtype=jnp.int32) + 1) * g
        is_recoded = is_changed.reshape(n // g, g).any(axis=1) & (group_end <= new_aged)
        code_rows = jnp.where(jnp.repeat(is_recoded, g), plan.kept_dst, -1)  # [N]
        meta_rows = jnp.where(is_recoded, plan.kept_dst[::g] // g, -1)  # [N / g]
        window_rows = jnp.where(is_kept & (index >= new_aged),
                                plan.seq_slot * window + index % window, -1)
        k_enc, v_enc = self.codec.encode_key_group(k), self.value_codec.encode(v)
        k_stored = {"codes": _scatter_rows(self.k_stored["codes"], _ALL, code_rows,
                                           k_enc["codes"])}
        for name in ("scale", "zero"):
            k_stored[name] = _scatter_rows(self.k_stored[name], _ALL, meta_rows, k_enc[name])
        return self.replace(
                k_stored=k_stored,
                v_stored={name: _scatter_rows(x, _ALL, code_rows, v_enc[name])
                          for name, x in self.v_stored.items()},
                k_residual=_scatter_rows(self.k_residual, _ALL, window_rows, k),
                v_residual=_scatter_rows(self.v_residual, _ALL, window_rows, v))

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> QuantizedPagedKV:
        """Copy-on-write: page dst[i] becomes a copy of page src[i] in all layers. src, dst: [C].

        Windows are per sequence, not per page: `copy_window` copies them.
        """
        def copy(x):
            return x.at[:, dst].set(x[:, src])

        return self.replace(k_stored=jax.tree.map(copy, self.k_stored),
                            v_stored=jax.tree.map(copy, self.v_stored))

    def pages_only(self) -> QuantizedPagedKV:
        """This state without its windows: a pytree of page leaves only."""
        return self.replace(k_residual=None, v_residual=None)

    def page_leaves(self) -> list[jax.Array]:
        """The key then value storage entries (by name), each [L, num_pages, rows, ...]."""
        return jax.tree.leaves((self.k_stored, self.v_stored))

    def with_page_leaves(self, leaves: Sequence[jax.Array]) -> QuantizedPagedKV:
        k_stored, v_stored = jax.tree.unflatten(jax.tree.structure((self.k_stored,
                                                                    self.v_stored)), leaves)
        return self.replace(k_stored=k_stored, v_stored=v_stored)

    def seq_slot_leaves(self) -> list[jax.Array]:
        """KIVI: the exact windows [k_residual, v_residual], each [L, num_seq_slots, W, K, D]."""
        return [] if self.k_residual is None else [self.k_residual, self.v_residual]

    def with_seq_slot_leaves(self, leaves: Sequence[jax.Array]) -> QuantizedPagedKV:
        if len(leaves) != len(self.seq_slot_leaves()):
            raise ValueError(f"{self.codec.name} holds {len(self.seq_slot_leaves())} "
                             f"sequence-slot leaves, got {len(leaves)}")
        if not leaves:
            return self
        k_residual, v_residual = leaves
        return self.replace(k_residual=k_residual, v_residual=v_residual)

    def copy_window(self, src: jax.Array, dst: jax.Array) -> QuantizedPagedKV:
        """Window slot dst becomes a copy of slot src (int32 scalars), in all layers."""
        return self.replace(k_residual=self.k_residual.at[:, dst].set(self.k_residual[:, src]),
                            v_residual=self.v_residual.at[:, dst].set(self.v_residual[:, src]))

    def nbytes(self) -> int:
        """Device bytes of every buffer: codes, metadata and windows."""
        return sum(x.nbytes for x in jax.tree.leaves(self))


def init_quantized_kv(config: ModelConfig, num_pages: int, page_size: int, codec_name: str, /,
                      *, num_seq_slots: int = 1, num_layers: int | None = None,
                      num_kv_heads: int | None = None, **options: Any) -> QuantizedPagedKV:
    """A zeroed quantized pool of `num_pages` pages of `page_size` tokens.

    Args:
        config: the model (L, K, D).
        num_pages: pages in the pool.
        page_size: P; a multiple of the group for KIVI.
        codec_name: a registered codec name.
        num_seq_slots: KIVI only: sequences whose exact windows the state holds.
        num_layers: layers a page holds (`KVCacheSpec.layers_per_table` for a model with
            several layer groups; None: every layer of the model).
        num_kv_heads: kv heads a page holds (1: head-major pages, `kvjax.kv.spec`; None: every
            kv head of the model).
        **options: the codec's options (as for `make_codec`); a `page_size` option, which
            `kv_bytes_per_token` takes, must equal `page_size`.
    """
    _positive_int("num_pages", num_pages)
    option_page_size = options.pop("page_size", page_size)
    if option_page_size != page_size:
        raise ValueError(f"codec option page_size={option_page_size!r} differs from the "
                         f"pool's page_size={page_size}")
    codec = make_codec(codec_name, **options)
    _check_page_size(codec, page_size)
    heads, head_dim = num_kv_heads or config.num_kv_heads, config.head_dim
    num_layers = config.num_layers if num_layers is None else num_layers
    num_slots = num_pages * page_size
    spec = codec.storage_spec(num_slots, heads, head_dim)
    v_stored = _page_major(spec, num_layers, num_pages)
    if not is_kivi(codec):
        return QuantizedPagedKV(k_stored=_page_major(spec, num_layers, num_pages),
                                v_stored=v_stored, k_residual=None, v_residual=None,
                                codec=codec, float8_views=_float8_views(spec))
    _positive_int("num_seq_slots", num_seq_slots)
    k_stored = _page_major(codec.key_storage_spec(num_slots, heads, head_dim), num_layers,
                           num_pages)
    window_shape = (num_layers, num_seq_slots, window_size(codec), heads, head_dim)
    return QuantizedPagedKV(
            k_stored=k_stored, v_stored=v_stored,
            k_residual=jnp.zeros(window_shape, _WINDOW_DTYPE),
            v_residual=jnp.zeros(window_shape, _WINDOW_DTYPE), codec=codec)


def calibrate_fp8(kv: QuantizedPagedKV, k_scale: np.ndarray, v_scale: np.ndarray
                  ) -> QuantizedPagedKV:
    """The state with calibrated fp8 key and value codecs of static scales [L, K] each.

    The pages keep their bytes, so call it on an empty pool (codes written under other scales
    would decode wrongly); the codec names, and with them the provenance, change with the
    scales.
    """
    if not is_layered(kv.codec):
        raise ValueError(f"calibrate_fp8 needs a calibrated-mode fp8 codec, got "
                         f"{kv.codec.name!r} (pass scaling='calibrated')")
    num_layers, heads = kv.v_stored["codes"].shape[0], kv.v_stored["codes"].shape[3]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if np.shape(scale) != (num_layers, heads):
            raise ValueError(f"{name} has shape {np.shape(scale)}, expected [L, K] = "
                             f"{(num_layers, heads)}")

    def codec_with(scale: np.ndarray) -> codecs.Fp8Codec:
        return codecs.Fp8Codec(kv.codec.fmt, codecs.Fp8Scaling.CALIBRATED,
                               tuple(tuple(float(s) for s in row) for row in np.asarray(scale)))

    return kv.replace(codec=codec_with(k_scale), v_codec=codec_with(v_scale))
