"""Quantized paged KV state: the page pool holds codec codes and metadata, not float K and V.

`QuantizedPagedKV` has the methods of `PagedKV` (`write`, `load_pages`, `copy_pages`,
`nbytes`, `num_pages`, `page_size`), so the jitted step and the blockwise attention use it
unchanged: `write` encodes the step's new tokens inside the jitted step (quantize on write),
and `load_pages` gathers only the requested pages and decodes them to float32. Every array
leaf is page-major, `[L, num_pages, ...]`, so swapping, scrubbing and copy-on-write treat it
like any paged state.

Per-token codecs (int8, int4, int2, fp8_e4m3, fp8_e5m2, and none): each token's K and V are
encoded alone, from that token's own values, with the codec's per-token metadata; a page holds
the codec's `storage_spec` rows for its P tokens. fp8 codecs run in dynamic scaling mode (a
float32 scale per token per kv head, amax / fp8_max); calibrated fp8 is refused, since it would
need separate per-head scales for K and V and this state takes one set of options.

KIVI (kivi4, kivi2): keys per channel over each group of g consecutive tokens of a sequence,
values per token over g channels. The layout, for page size P a multiple of g:

  * k_stored: key codes [L, num_pages, P, K, D*b/8] and key scale, zero
    [L, num_pages, P/g, K, D] (row j of a page is the metadata of its token group j);
  * v_stored: value codes [L, num_pages, P, K, D*b/8], scale, zero [L, num_pages, P, K, D/g];
  * k_window, v_window: [L, num_pages, g, K, D] float32, the exact copy of the page's open
    (incomplete) token group, offset o of the page at row o % g;
  * num_quantized: [L, num_pages] int32, how many leading tokens of the page are quantized.

A group is quantized by the very `write` that stores its last token (offset o with
o % g == g - 1): that write gathers the group's g exact tokens (those written by the same call
straight from its input, earlier ones from the window), encodes keys with `encode_key_group`
and values with `encode`, and scatters codes and metadata into the page. `load_pages` reads
offsets below num_quantized from the codes and the open group from the window. So a sequence
of length S reads tokens [0, S // g * g) quantized and the rest, at most g - 1 tokens, exactly:
the KIVI codec with residual=0 (`kivi_roundtrip_reference` with codec.residual == 0). A
residual window R > 0 would have to age a group out when the sequence reaches R tokens past
it, often in a later page; `write` only sees the new tokens' slots, not the block table that
links a page to the next, so this state refuses residual > 0 (and defaults it to 0).

Inside one step the new tokens are written before they are attended to, so a prefill query
sees every group its chunk completes (even the part after it) quantized, while a decode query
sees its own open group exactly: KIVI quality depends a little on how a prompt is chunked.

Bytes per token (all L layers, K and V; m the metadata dtype's bytes, 4 by default):

    none (dtype bytes e)         2 L K D e
    int8, fp8_* (dynamic)        2 L K (D + m)          fp8 scale is always float32 (m = 4)
    int4, int2 (bits b, group g) 2 L K (D b / 8 + 2 m D / g)
    kivi4, kivi2                 2 L K (D b / 8 + 2 m D / g)  +  L (8 g K D + 4) / P

The KIVI term after the plus is the float32 window (g tokens of K and V per page) and the page
counter, spread over the page's P tokens, so `kv_bytes_per_token` needs the page size for KIVI.
The figure is exact: `nbytes()` equals num_pages * P * `kv_bytes_per_token`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.config import ModelConfig
from kvjax.kv import codecs

_KIVI = ("kivi2", "kivi4")
_FP8 = ("fp8_e4m3", "fp8_e5m2")
_WINDOW_DTYPE = jnp.float32


def _positive_int(field: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{field} must be a positive int, got {value!r}")
    return value


def make_codec(codec_name: str, **options: Any) -> codecs.KVCodec:
    """The codec this state uses for `codec_name` and `options` (see the module docstring).

    Differs from `codecs.get_codec` in two defaults: fp8 codecs use dynamic scaling and KIVI
    codecs use residual=0; calibrated fp8 and KIVI with residual > 0 raise ValueError.
    """
    if codec_name in _FP8:
        scaling = codecs.Fp8Scaling(options.setdefault("scaling", codecs.Fp8Scaling.DYNAMIC))
        if scaling is not codecs.Fp8Scaling.DYNAMIC:
            raise ValueError(f"scaling={scaling.value!r}: the quantized paged state runs fp8 "
                             f"with scaling='dynamic' only (no per-tensor calibration)")
    if codec_name in _KIVI and options.setdefault("residual", 0) != 0:
        raise ValueError(f"residual={options['residual']!r}: the quantized paged state keeps "
                         f"only each page's open token group exact (residual=0)")
    return codecs.get_codec(codec_name, **options)


def _is_kivi(codec: codecs.KVCodec) -> bool:
    return isinstance(codec, codecs.KiviCodec)


def _check_page_size(codec: codecs.KVCodec, page_size: int) -> None:
    _positive_int("page_size", page_size)
    if _is_kivi(codec) and page_size % codec.group:
        raise ValueError(f"page_size={page_size} is not a multiple of the KIVI group "
                         f"{codec.group}: a token group must not straddle pages")


def kv_bytes_per_token(config: ModelConfig, codec_name: str, /, *,
                       page_size: int | None = None, **options: Any) -> float:
    """Bytes one token takes in a quantized pool: all layers, K and V, codes and metadata.

    Args:
        config: the model.
        codec_name: a registered codec name (`kvjax.kv.codecs.CODECS`).
        page_size: P; required for KIVI, whose per-page exact window is part of the cost.
        **options: the codec's options (as for `make_codec`).

    Returns:
        The exact bytes per token, so num_pages * P * this == `QuantizedPagedKV.nbytes()`.
    """
    codec = make_codec(codec_name, **options)
    per_token = 2 * config.num_layers * codec.bytes_per_token(config.num_kv_heads,
                                                              config.head_dim)
    if not _is_kivi(codec):
        if page_size is not None:
            _check_page_size(codec, page_size)
        return float(per_token)
    if page_size is None:
        raise ValueError(f"codec {codec.name!r} needs page_size (pass it with the codec "
                         f"options): its exact window costs per page, not per token")
    _check_page_size(codec, page_size)
    window = 2 * codec.group * config.num_kv_heads * config.head_dim * 4  # K and V, float32
    per_page = config.num_layers * (window + jnp.dtype(jnp.int32).itemsize)
    return float(per_token + per_page / page_size)


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


def _scatter_rows(x: jax.Array, layer: jax.Array, rows: jax.Array, values: jax.Array
                  ) -> jax.Array:
    """Sets rows of `layer` in page-major x [L, num_pages, R, ...]; rows index page * R + r.

    rows: any integer shape I; values: I + x.shape[3:]. Rows outside [0, num_pages * R),
    -1 among them, are dropped.
    """
    num_layers, num_pages, per_page = x.shape[:3]
    if _is_float8(values.dtype):
        values = jax.lax.bitcast_convert_type(values, jnp.uint8)
    flat = x.reshape(num_layers, num_pages * per_page, *x.shape[3:])
    rows = jnp.where((rows >= 0) & (rows < num_pages * per_page), rows, num_pages * per_page)
    flat = flat.at[layer, rows].set(values.astype(x.dtype), mode="drop")
    return flat.reshape(x.shape)


def _gather_pages(stored: dict[str, jax.Array], layer: jax.Array, pages: jax.Array,
                  float8_views: tuple[tuple[str, str], ...]) -> dict[str, jax.Array]:
    """Rows of `pages` [B, n] of `layer`, each [B, n, R, ...], float8 entries as float8."""
    views = dict(float8_views)
    gathered = {name: x[layer, pages] for name, x in stored.items()}  # each [B, n, R, ...]
    return {name: jax.lax.bitcast_convert_type(x, views[name]) if name in views else x
            for name, x in gathered.items()}


@struct.dataclass
class QuantizedPagedKV:
    """A pool of quantized KV pages shared by all sequences (see the module docstring).

    Attributes:
        k_stored: the key storage, name -> [L, num_pages, rows, ...]: the codec's
            `storage_spec` (rows = P), or for KIVI its `key_storage_spec` (codes: rows = P,
            scale and zero: rows = P / g).
        v_stored: the value storage, name -> [L, num_pages, P, ...] (`storage_spec`).
        k_window, v_window: KIVI only (else None), [L, num_pages, g, K, D] float32: the exact
            tokens of each page's open group, page offset o at row o % g.
        num_quantized: KIVI only (else None), [L, num_pages] int32: leading tokens of each
            page read from the codes; the next g are read from the window.
        codec: the codec (static).
        float8_views: (name, float8 dtype name) of the storage entries held as uint8 bytes
            (static; fp8 codes), bitcast back after the gather.
    """

    k_stored: dict[str, jax.Array]
    v_stored: dict[str, jax.Array]
    k_window: jax.Array | None
    v_window: jax.Array | None
    num_quantized: jax.Array | None
    codec: codecs.KVCodec = struct.field(pytree_node=False)
    float8_views: tuple[tuple[str, str], ...] = struct.field(pytree_node=False, default=())

    @property
    def codec_name(self) -> str:
        """The codec's name with all its options; part of the KV provenance fingerprint."""
        return self.codec.name

    @property
    def num_pages(self) -> int:
        return next(iter(self.v_stored.values())).shape[1]

    @property
    def page_size(self) -> int:
        return next(iter(self.v_stored.values())).shape[2]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def load_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K and V of `pages` [B, n] of `layer`, each [B, n, P, K, D] float32.

        Only the requested pages are gathered and decoded.
        """
        k_stored = _gather_pages(self.k_stored, layer, pages, self.float8_views)
        v = self.codec.decode(_gather_pages(self.v_stored, layer, pages, self.float8_views))
        if not _is_kivi(self.codec):
            return self.codec.decode(k_stored), v
        k = self.codec.decode_keys(k_stored)  # [B, n, P, K, D]
        rows = jnp.arange(self.page_size) % self.codec.group  # [P]
        k_exact = self.k_window[layer, pages][:, :, rows]  # [B, n, P, K, D]
        v_exact = self.v_window[layer, pages][:, :, rows]
        offsets = jnp.arange(self.page_size, dtype=jnp.int32)
        is_quantized = offsets < self.num_quantized[layer, pages][..., None]  # [B, n, P]
        is_quantized = is_quantized[..., None, None]  # [B, n, P, 1, 1]
        return (jnp.where(is_quantized, k, k_exact.astype(jnp.float32)),
                jnp.where(is_quantized, v, v_exact.astype(jnp.float32)))

    def write(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array
              ) -> QuantizedPagedKV:
        """Encodes and writes k, v [T, K, D] of `layer` into flat slots [T] (-1: dropped).

        Slots of one write are distinct, and a sequence writes its positions in order, each
        page's offsets from where it left off: the contract of the engine's slot mapping.
        """
        if _is_kivi(self.codec):
            return self._write_kivi(layer, slots, k, v)
        k_enc, v_enc = self.codec.encode(k), self.codec.encode(v)  # each [T, ...]
        return self.replace(
                k_stored={n: _scatter_rows(x, layer, slots, k_enc[n])
                          for n, x in self.k_stored.items()},
                v_stored={n: _scatter_rows(x, layer, slots, v_enc[n])
                          for n, x in self.v_stored.items()})

    def _write_kivi(self, layer: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array
                    ) -> QuantizedPagedKV:
        """`write` for KIVI: window the open groups, quantize the groups this call completes."""
        g, page_size, num_pages = self.codec.group, self.page_size, self.num_pages
        num_tokens = slots.shape[0]
        is_valid = (slots >= 0) & (slots < self.num_slots)
        slots = jnp.where(is_valid, slots, self.num_slots)  # [T]; past the pool: dropped
        page, offset = slots // page_size, slots % page_size  # [T]
        in_group = offset % g
        token = jnp.arange(num_tokens, dtype=jnp.int32)

        def written_here(index: jax.Array, slot: jax.Array) -> jax.Array:
            """Whether token `index` of this call exists and was written to `slot`."""
            inside = (index >= 0) & (index < num_tokens)
            return inside & (slots[jnp.clip(index, 0, num_tokens - 1)] == slot)

        # Each token's group as it stands after this call: members written by this call come
        # from its input, the others from the window (stale rows past the group's end are
        # never read: they lie beyond the sequence length).
        arange_g = jnp.arange(g, dtype=jnp.int32)
        members = (token - in_group)[:, None] + arange_g  # [T, g] token indices
        member_slots = (slots - in_group)[:, None] + arange_g  # [T, g]
        from_call = written_here(members, member_slots)[..., None, None]  # [T, g, 1, 1]
        member_index = jnp.clip(members, 0, num_tokens - 1)
        window_page = jnp.minimum(page, num_pages - 1)

        def group_of(x: jax.Array, window: jax.Array) -> jax.Array:
            old = window[layer, window_page].astype(jnp.float32)  # [T, g, K, D]
            return jnp.where(from_call, x[member_index].astype(jnp.float32), old)

        k_group, v_group = group_of(k, self.k_window), group_of(v, self.v_window)

        # A group whose last token is in this call is quantized now (by that token); the
        # call's last token in a group left open writes the whole group back to the window.
        # Writing groups, not single tokens, makes the window update depend on the read of
        # the old rows, so XLA updates the window in place rather than copying all of it.
        closes = is_valid & (in_group == g - 1)  # [T]
        is_last_of_call = ~written_here(token + 1, slots + 1)  # [T]
        keeps_open = is_valid & (in_group < g - 1) & is_last_of_call  # [T]
        window_rows = jnp.where(keeps_open[:, None], page[:, None] * g + arange_g, -1)  # [T, g]
        k_enc = self.codec.encode_key_group(k_group)  # codes [T, g, ...], scale [T, 1, K, D]
        v_enc = self.codec.encode(v_group)  # each [T, g, ...]
        code_rows = jnp.where(closes[:, None], member_slots, -1)  # [T, g]
        meta_rows = jnp.where(closes, page * (page_size // g) + offset // g, -1)  # [T]
        k_stored = {"codes": _scatter_rows(self.k_stored["codes"], layer, code_rows,
                                           k_enc["codes"])}
        for name in ("scale", "zero"):
            k_stored[name] = _scatter_rows(self.k_stored[name], layer, meta_rows,
                                           k_enc[name][:, 0])  # [T, K, D] rows
        v_stored = {n: _scatter_rows(x, layer, code_rows, v_enc[n])
                    for n, x in self.v_stored.items()}

        # Groups before a written offset's group are complete and already quantized; the
        # latest offset of each page decides, which also resets a reused page's count.
        count = jnp.where(is_valid, (offset + 1) // g * g, -1)  # [T]
        latest = jnp.full((num_pages,), -1, jnp.int32).at[page].max(count, mode="drop")
        num_quantized = self.num_quantized.at[layer].set(
                jnp.where(latest >= 0, latest, self.num_quantized[layer]))  # [num_pages]
        return self.replace(
                k_stored=k_stored, v_stored=v_stored,
                k_window=_scatter_rows(self.k_window, layer, window_rows, k_group),
                v_window=_scatter_rows(self.v_window, layer, window_rows, v_group),
                num_quantized=num_quantized)

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> QuantizedPagedKV:
        """Copy-on-write: page dst[i] becomes a copy of page src[i] in all layers. src, dst: [C]."""
        return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), self)

    def nbytes(self) -> int:
        """Device bytes of every buffer: codes, metadata, windows and counters."""
        return sum(x.nbytes for x in jax.tree.leaves(self))


def init_quantized_kv(config: ModelConfig, num_pages: int, page_size: int, codec_name: str, /,
                      **options: Any) -> QuantizedPagedKV:
    """A zeroed quantized pool of `num_pages` pages of `page_size` tokens.

    Args:
        config: the model (L, K, D).
        num_pages: pages in the pool.
        page_size: P; a multiple of the group for KIVI.
        codec_name: a registered codec name.
        **options: the codec's options (as for `make_codec`); a `page_size` option, which
            `kv_bytes_per_token` takes for KIVI, must equal `page_size`.
    """
    _positive_int("num_pages", num_pages)
    option_page_size = options.pop("page_size", page_size)
    if option_page_size != page_size:
        raise ValueError(f"codec option page_size={option_page_size!r} differs from the "
                         f"pool's page_size={page_size}")
    codec = make_codec(codec_name, **options)
    _check_page_size(codec, page_size)
    num_layers, heads, head_dim = config.num_layers, config.num_kv_heads, config.head_dim
    num_slots = num_pages * page_size
    spec = codec.storage_spec(num_slots, heads, head_dim)
    v_stored = _page_major(spec, num_layers, num_pages)
    if not _is_kivi(codec):
        return QuantizedPagedKV(k_stored=_page_major(spec, num_layers, num_pages),
                                v_stored=v_stored, k_window=None, v_window=None,
                                num_quantized=None, codec=codec,
                                float8_views=_float8_views(spec))
    k_stored = _page_major(codec.key_storage_spec(num_slots, heads, head_dim), num_layers,
                           num_pages)
    window_shape = (num_layers, num_pages, codec.group, heads, head_dim)
    return QuantizedPagedKV(
            k_stored=k_stored, v_stored=v_stored,
            k_window=jnp.zeros(window_shape, _WINDOW_DTYPE),
            v_window=jnp.zeros(window_shape, _WINDOW_DTYPE),
            num_quantized=jnp.zeros((num_layers, num_pages), jnp.int32), codec=codec)
