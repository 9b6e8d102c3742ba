"""The attention functions the engine's step calls when `attention_impl` is PALLAS.

`attention_fns()` returns (decode_fn, prefill_fn) with exactly the signatures of
`kvjax.kv.attention.paged_decode_attention_reference` and `paged_prefill_attention_reference`,
over plain float pages. `kernels_for(kv)` picks, from one table by state type, the kernels that
read a KV state the engine holds, and `layer_attention_fns(kv, layer)` binds them to a layer:

  state                                   decode                      prefill
  PagedKV, ContiguousKV (float pages)     paged_decode kernel         ragged_prefill kernel
  QuantizedPagedKV, int8 (per token or    quantized_decode kernel     jnp: dequantize the rows'
    group=g) / fp8 dynamic / int4 / int2  (codes read in the kernel)  pages, blockwise reference
  QuantizedPagedKV, KIVI or calibrated    ValueError (no kernel reads them)
    fp8
  LatentPagedKV (MLA latents)             ValueError (no kernel reads them; the step falls back
                                          to the blockwise jnp attention under AUTO)
  QuestKV(base)                           as its base: the Quest step narrows decode rows' block
                                          tables first; `quest_sparse_decode` instead hands the
                                          selection to the sparse_decode kernel

Each kernel runs compiled on GPU (Triton schedule), except fp8 codes on GPUs below sm_89 (no
float8 conversions: ValueError), and on TPU (Mosaic schedule), every codec of the table
included (the TPU kernel decodes float8 from its bytes). "GPU" and "TPU" are the target being
compiled for (`targets.current_platform`): the abstract mesh's device in a deviceless compile,
else the backend. On a CPU backend every kernel runs through the Pallas interpreter, which is
slow but computes the same values, so `attention_impl=pallas` works everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from kvjax.kv import attention as attention_ref
from kvjax.kv import quest
from kvjax.kv.quantized import QuantizedPagedKV
from kvjax.kv.state import ContiguousKV, KVState, LatentPagedKV, PagedKV
from pallas_kernels import targets
from pallas_kernels.paged_decode.kernel import pad_block_tables, paged_decode_attention
from pallas_kernels.quantized_decode.kernel import (
    CodeFormat,
    code_format,
    quantized_decode_attention,
)
from pallas_kernels.ragged_prefill.kernel import ragged_prefill_attention
from pallas_kernels.sparse_decode.kernel import sparse_decode_attention

# Pages per step of the jnp prefill fallback over quantized pages (the engine's value).
_FALLBACK_PAGES_PER_BLOCK = 8

DecodeFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
PrefillFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _interpret() -> bool:
    return targets.current_platform() == "cpu"


def attention_fns() -> tuple[Callable[..., jax.Array], Callable[..., jax.Array]]:
    """(decode_fn, prefill_fn) for the default backend, interpreted when it is the CPU."""
    interpret = _interpret()

    def decode_fn(
        q: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        block_tables: jax.Array,
        kv_lens: jax.Array,
        *,
        sm_scale: float | None = None,
        soft_cap: float | None = None,
        sliding_window: int | jax.Array | None = None,
    ) -> jax.Array:
        """q [B, N, D], pages [num_pages, P, K, D], block_tables [B, Pmax] -> [B, N, D]."""
        return paged_decode_attention(
            q, k_pages, v_pages, block_tables, kv_lens, sm_scale=sm_scale, soft_cap=soft_cap,
            sliding_window=sliding_window, interpret=interpret)

    def prefill_fn(
        q: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        block_tables: jax.Array,
        kv_lens: jax.Array,
        q_lens: jax.Array,
        *,
        sm_scale: float | None = None,
        soft_cap: float | None = None,
        sliding_window: int | jax.Array | None = None,
    ) -> jax.Array:
        """q [B, C, N, D], pages [num_pages, P, K, D], block_tables [B, Pmax] -> [B, C, N, D]."""
        return ragged_prefill_attention(
            q, k_pages, v_pages, block_tables, kv_lens, q_lens, sm_scale=sm_scale,
            soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret)

    return decode_fn, prefill_fn


def _quantized_codecs(kv: QuantizedPagedKV) -> tuple[Any, Any]:
    """(key codec, value codec) of a quantized state; ValueError when no kernel reads them."""
    k_codec, v_codec = kv.codec, kv.value_codec  # Separate only for calibrated fp8.
    for codec in (k_codec, v_codec):
        try:
            code_format(codec)
        except ValueError as e:
            raise ValueError(f"attention_impl=pallas cannot read this KV cache: {e}") from None
    if k_codec != v_codec:
        raise ValueError(f"attention_impl=pallas: keys ({k_codec.name}) and values "
                         f"({v_codec.name}) use different codecs; the kernel takes one")
    return k_codec, v_codec


def _float_pages_fns(kv: PagedKV | ContiguousKV, layer: jax.Array, soft_cap: float | None,
                     window: jax.Array | None) -> tuple[DecodeFn, PrefillFn]:
    decode_fn, prefill_fn = attention_fns()
    k_pages, v_pages = kv.layer_pages(layer)  # [num_pages, P, K, D] each
    return (lambda q, bt, lens: decode_fn(q, k_pages, v_pages, bt, lens, soft_cap=soft_cap,
                                          sliding_window=window),
            lambda q, bt, lens, q_lens: prefill_fn(q, k_pages, v_pages, bt, lens, q_lens,
                                                   soft_cap=soft_cap, sliding_window=window))


def _quantized_reason(kv: QuantizedPagedKV) -> str | None:
    try:
        codec, _ = _quantized_codecs(kv)
    except ValueError as e:
        return str(e)
    return fp8_gpu_reason(codec) if targets.current_platform() == "gpu" else None


def fp8_gpu_reason(codec: Any) -> str | None:
    """Why the GPU being compiled for cannot read `codec`'s codes (fp8 below sm_89), or None."""
    if code_format(codec) is not CodeFormat.FP8:
        return None
    reason = targets.fp8_unsupported_reason(targets.current_gpu())
    return None if reason is None else f"attention_impl=pallas: {reason}"


def _quantized_fns(kv: QuantizedPagedKV, layer: jax.Array, soft_cap: float | None,
                   window: jax.Array | None) -> tuple[DecodeFn, PrefillFn]:
    codec, _ = _quantized_codecs(kv)
    k_stored = {name: x[layer] for name, x in kv.k_stored.items()}  # [num_pages, P, ...]
    v_stored = {name: x[layer] for name, x in kv.v_stored.items()}
    decode = functools.partial(quantized_decode_attention, k_stored=k_stored,
                               v_stored=v_stored, codec=codec, soft_cap=soft_cap,
                               sliding_window=window, interpret=_interpret())

    def prefill(q, bt, lens, q_lens):
        # No quantized prefill kernel: the rows' pages are dequantized in jnp, block by block.
        return attention_ref.paged_attention_blockwise(
            q, functools.partial(kv.load_pages, layer),
            pad_block_tables(bt, _FALLBACK_PAGES_PER_BLOCK), lens, q_lens,
            pages_per_block=_FALLBACK_PAGES_PER_BLOCK, soft_cap=soft_cap, window=window)

    return (lambda q, bt, lens: decode(q, block_tables=bt, kv_lens=lens)), prefill


@dataclasses.dataclass(frozen=True)
class _StateKernels:
    """How the kernels read one KV state type.

    Attributes:
      reason: state -> why no kernel reads it on this backend, or None.
      layer_fns: (state, layer, soft_cap, window) -> (decode_fn, prefill_fn) over that layer,
        with the attention logits soft-capped at soft_cap (None: not capped) and the layer's
        sliding window (an int32 scalar, traced or not, 0: none; or None).
    """

    reason: Callable[[Any], str | None]
    layer_fns: Callable[[Any, jax.Array, float | None, jax.Array | None],
                        tuple[DecodeFn, PrefillFn]]


_FLOAT_PAGES = _StateKernels(reason=lambda kv: None, layer_fns=_float_pages_fns)
# Quest narrows the block tables before attention; its base's kernels read the pages.
_QUEST = _StateKernels(reason=lambda kv: unsupported_reason(kv.base),
                       layer_fns=lambda kv, layer, soft_cap, window: layer_attention_fns(
                           kv.base, layer, soft_cap=soft_cap, window=window))

_LATENT_REASON = ("the Pallas kernels read K and V pages of their own, while MLA latent pages "
                  "hold one row per token that is both the key and (its first kv_lora_rank "
                  "columns) the value")


def _no_layer_fns(kv: Any, layer: jax.Array, soft_cap: float | None):
    raise ValueError(_LATENT_REASON)


# The module docstring's table, by state type.
_KERNELS: dict[type, _StateKernels] = {
    PagedKV: _FLOAT_PAGES,
    ContiguousKV: _FLOAT_PAGES,
    QuantizedPagedKV: _StateKernels(reason=_quantized_reason, layer_fns=_quantized_fns),
    quest.QuestKV: _QUEST,
    LatentPagedKV: _StateKernels(reason=lambda kv: _LATENT_REASON, layer_fns=_no_layer_fns),
}


def _kernels_of(kv: Any) -> _StateKernels | None:
    for cls in type(kv).__mro__:
        if cls in _KERNELS:
            return _KERNELS[cls]
    return None


def unsupported_reason(kv: Any) -> str | None:
    """Why no kernel reads `kv` on this backend; None when `layer_attention_fns` can."""
    kernels = _kernels_of(kv)
    if kernels is None:
        return f"attention_impl=pallas has no kernel for a {type(kv).__name__}"
    return kernels.reason(kv)


def kernels_for(kv: KVState, *, soft_cap: float | None = None
                ) -> Callable[..., tuple[DecodeFn, PrefillFn]]:
    """The kernel chooser for states like `kv` (same type and codecs): (state, layer,
    window=None) -> fns, soft-capping attention logits at `soft_cap` (None: not capped) and
    applying the layer's sliding window (an int32 scalar, traced or not, 0: none).

    Chosen once per engine step program; raises ValueError for a state no kernel reads,
    before anything is traced.
    """
    reason = unsupported_reason(kv)
    if reason is not None:
        raise ValueError(reason)
    layer_fns = _kernels_of(kv).layer_fns
    return lambda state, layer, window=None: layer_fns(state, layer, soft_cap, window)


def layer_attention_fns(kv: Any, layer: jax.Array, *, soft_cap: float | None = None,
                        window: jax.Array | None = None) -> tuple[DecodeFn, PrefillFn]:
    """(decode_fn, prefill_fn) over one layer of `kv`, for the state's layout (module table).

    decode_fn(q [B, N, D], block_tables [B, W], kv_lens [B]) -> [B, N, D];
    prefill_fn(q [B, C, N, D], block_tables, kv_lens, q_lens [B]) -> [B, C, N, D].
    Raises ValueError for a state no kernel reads, before anything is traced.
    """
    return kernels_for(kv, soft_cap=soft_cap)(kv, layer, window)


def quest_sparse_decode(kv: quest.QuestKV, layer: jax.Array, q: jax.Array,
                        block_tables: jax.Array, kv_lens: jax.Array, num_read: int
                        ) -> jax.Array:
    """Quest decode through the sparse kernel: select each row's pages, read only those.

    Same pages and result as `quest.narrow_decode_rows` followed by dense decode attention
    (what the engine's Quest step does), without building the narrowed block tables.

    Args:
      kv: a QuestKV over float pages (PagedKV); q: [B, N, D]; block_tables: [B, W] int32;
      kv_lens: [B] int32; num_read: pages each row reads (static).
    Returns:
      [B, N, D] in q's dtype.
    """
    if _kernels_of(kv.base) is not _FLOAT_PAGES:
        raise ValueError(f"quest_sparse_decode reads float pages; the base state is a "
                         f"{type(kv.base).__name__} (use narrowed tables with its decode kernel)")
    num_read = min(num_read, block_tables.shape[1])
    key_min = kv.key_min[layer][block_tables]  # [B, W, K, D]
    key_max = kv.key_max[layer][block_tables]
    scores = quest.page_bounds(q, key_min, key_max).max(axis=-1)  # [B, W]
    page_indices, _ = quest.select_pages(scores, kv_lens, kv.page_size, num_read)
    k_pages, v_pages = kv.base.layer_pages(layer)
    return sparse_decode_attention(q, k_pages, v_pages, block_tables, kv_lens, page_indices,
                                   interpret=_interpret())
