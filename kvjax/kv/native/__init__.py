"""Native CPU attention: C++ decode and prefill kernels that read KV pages in place (XLA FFI).

On the CPU, the jnp blockwise path (`kvjax.kv.attention.paged_attention_blockwise`) gathers
each block of pages into a new buffer and transposes it for the matmuls, so a decode step moves
several times the bytes of the KV it reads. `paged_decode.cc` walks each row's block table and
reads every key and value straight from the page pool (the whole `[L, num_pages, P, K, D]`
buffer and the layer index, so no layer slice is copied either), all kv heads of a page
together, in chunks of rows' pages spread over XLA's intra-op threads (a long row is cut into
several chunks whose partial softmaxes are merged, so a few rows still keep every thread busy).
Codes are decoded eight channels at a time in registers, so the head dim must be a multiple of
8. It computes what `paged_decode_attention_reference` computes, a soft cap on the logits
(Gemma 2) and a sliding window included (a window is a traced int32 scalar, 0 for none, so one
program serves windowed and global layers; pages wholly before a row's window are not read).

The source is built once per machine and registered as the FFI target `kvjax_paged_decode`
(`kvjax.cpu_kernels`); `unavailable_reason()` says why it cannot be used (no compiler, a
failed build); the engine then keeps the jnp path.

Which states it reads (`kernels_for(kv)`, the same chooser signature as
`pallas_kernels.dispatch.kernels_for`):

  state                                         what the kernel reads
  PagedKV, float32 or bfloat16 pages            the pages
  QuantizedPagedKV, codec none (f32 / bf16)     the values
  QuantizedPagedKV, int8 with float32 scales    the int8 codes and the per-token scales
  QuantizedPagedKV, int8-g / int4 / int2 with   the packed codes, scales and zeros
    float32 metadata                            (all decoded in registers, never to a float
                                                copy of the context)
  QuestKV over one of the above                 its base (Quest narrows the block tables first)

Prefill chunks over float32 or bfloat16 pages go to `paged_prefill.cc`
(`paged_prefill_attention`): each row's keys are transposed once per layer into a float32
scratch, then tiles of 16 queries walk 32-key blocks up to their last position (causal blocks
past it are skipped, masks only on the diagonal) with an online softmax in registers and a
vectorized exp, reading values in place (bfloat16 widened in registers); it computes what
`paged_prefill_attention_reference` computes. Other pages (codes), and head dims other than
64 and 128, keep the blockwise jnp path (`prefill_reason`); rows of at most 8 queries
(speculative verify) use the decode kernel.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cpu_kernels
from kvjax.kv import attention as attention_ref

_SOURCE = pathlib.Path(__file__).with_name("paged_decode.cc")
_TARGET = "kvjax_paged_decode"
_PREFILL_SOURCE = pathlib.Path(__file__).with_name("paged_prefill.cc")
_PREFILL_TARGET = "kvjax_paged_prefill"
PREFILL_HEAD_DIMS = (64, 128)
MAX_GROUP = 32  # kMaxGroup: query heads (times queries per row) per kv head
HEAD_DIM_MULTIPLE = 8  # channels are decoded and multiplied eight at a time


def unavailable_reason() -> str | None:
    """None when the kernel is built and registered (building it on first call), else why not."""
    return cpu_kernels.register(_TARGET, _SOURCE, "KvjaxPagedDecode")


def targets_for(isa: cpu_kernels.Isa) -> tuple[str, str]:
    """Registers the decode and prefill kernels built for `isa` as FFI targets of their own
    (the AVX2 and generic branches on a CPU whose native build takes the AVX-512 ones);
    returns their names for the `target` argument of the two attention functions.

    Raises:
      ValueError: a build is unavailable on this machine.
    """
    targets = []
    for target, source, symbol in ((_TARGET, _SOURCE, "KvjaxPagedDecode"),
                                   (_PREFILL_TARGET, _PREFILL_SOURCE, "KvjaxPagedPrefill")):
        if isa is not cpu_kernels.Isa.NATIVE:
            target = f"{target}_{isa.name.lower()}"
        reason = cpu_kernels.register(target, source, symbol, isa)
        if reason is not None:
            raise ValueError(reason)
        targets.append(target)
    return targets[0], targets[1]


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           layer: jax.Array | int, block_tables: jax.Array,
                           kv_lens: jax.Array, *, q_lens: jax.Array | None = None,
                           k_scale: jax.Array | None = None,
                           v_scale: jax.Array | None = None, k_zero: jax.Array | None = None,
                           v_zero: jax.Array | None = None, bits: int = 8, group: int = 0,
                           sm_scale: float | None = None,
                           soft_cap: float | None = None, window: jax.Array | int = 0,
                           split_rows: bool = True, target: str = _TARGET,
                           return_lse: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention of one layer, read in place from all layers' pages.

    Args:
      q: [B, N, D] (D a multiple of 8), or [B, Q, N, D]: Q queries per row (a speculative
        verify row), of which the first q_lens[b] sit at positions kv_lens[b] - q_lens[b] + i
        and attend causally; the others get zeros.
      k_pages, v_pages: [L, num_pages, P, K, D] float32, bfloat16 or int8 (codes), or uint8
        [L, num_pages, P, K, D * bits / 8]: packed asymmetric codes (`codecs.pack_codes`).
      layer: the layer to read (a scalar, traced or not).
      block_tables: [B, W] int32; kv_lens: [B] int32 (0: a padded row, zeros out).
      q_lens: [B] int32 with [B, Q, N, D] queries (None: all Q).
      k_scale, v_scale: float32; [L, num_pages, P, K] with int8 codes (x = code * scale),
        [L, num_pages, P, K, D / group] with packed codes (x = zero + code * scale).
      k_zero, v_zero: float32 [L, num_pages, P, K, D / group], packed codes only.
      bits, group: the packed codes' width (8, 4 or 2) and channels per scale.
      sm_scale: softmax scale, 1/sqrt(D) by default.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
      window: a sliding window (int32 scalar, traced or not; <= 0: none): a query at position
        t sees keys t - window + 1 .. t, and pages wholly before that are not read.
      split_rows: whether a long row may be cut into chunks merged at the end (spreading a
        few rows over the threads); False: each row in one pass, so its result is bitwise
        the same whatever other rows the call holds (batch-invariant numerics).
      target: the FFI target to call (`targets_for`: a build for another ISA level).
      return_lse: also return each query head's log-sum-exp of its (scaled, capped) logits,
        [B, N] or [B, Q, N] float32 (-inf where it saw no token), as
        `kvjax.kv.attention.paged_attention_blockwise` does: attention over keys split between
        pools merges exactly (`kvjax.kv.attention.merge_partials`).
    Returns:
      q's shape and dtype; equal to `paged_decode_attention_reference` (Q = 1) or
      `paged_prefill_attention_reference` on layer `layer` of the decoded pages (with
      `sliding_window=window` where window > 0); with return_lse, (that, the log-sum-exp).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(reason)
    none = jnp.zeros((1,), jnp.float32)
    meta = [none if x is None else x for x in (k_scale, v_scale, k_zero, v_zero)]
    if any(x.dtype != jnp.float32 for x in meta):
        raise ValueError(f"scales and zeros must be float32, got {[str(x.dtype) for x in meta]}")
    if q.shape[-1] % HEAD_DIM_MULTIPLE:
        raise ValueError(f"head_dim={q.shape[-1]} is not a multiple of {HEAD_DIM_MULTIPLE}")
    scale = 1.0 / np.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    b, d, k_heads = q.shape[0], q.shape[-1], k_pages.shape[3]
    num_queries = q.shape[1] if q.ndim == 4 else 1
    n = q.shape[-2]
    # Each kv head's Q * G query heads side by side: [B, K * Q * G, D].
    flat = q.reshape(b, num_queries, k_heads, n // k_heads, d).transpose(0, 2, 1, 3, 4)
    if q_lens is None:
        q_lens = jnp.full((b,), num_queries, jnp.int32)
    heads = b * num_queries * n
    flat_out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((heads * (d + 1),), jnp.float32))(
        flat.reshape(b, num_queries * n, d).astype(jnp.float32), k_pages, v_pages, *meta,
        jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32),
        block_tables.astype(jnp.int32), kv_lens.astype(jnp.int32), jnp.asarray(q_lens, jnp.int32),
        sm_scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0), bits=np.int32(bits),
        group=np.int32(group), num_queries=np.int32(num_queries), split_rows=split_rows)
    # [B, K, Q, G, D] and [B, K, Q, G]: back to [B, Q, K, G(, D)], query heads in order.
    out = flat_out[:heads * d].reshape(b, k_heads, num_queries, n // k_heads, d)
    out = out.transpose(0, 2, 1, 3, 4).reshape(q.shape).astype(q.dtype)
    if not return_lse:
        return out
    lse = flat_out[heads * d:].reshape(b, k_heads, num_queries, n // k_heads)
    return out, lse.transpose(0, 2, 1, 3).reshape(q.shape[:-1])


def lse_decoder(*, soft_cap: float | None = None):
    """fn(kv, layer, q [B, N, D], block_tables [B, W], kv_lens [B]) -> (out [B, N, D], lse
    [B, N] float32): the decode kernel over any state it reads (`reason_for`), returning its
    log-sum-exp, for rows whose keys are split between pools (`kvjax.engine.host_rows`)."""

    def decode(kv, layer, q, block_tables, kv_lens):
        return paged_decode_attention(q, layer=layer, block_tables=block_tables,
                                      kv_lens=kv_lens, soft_cap=soft_cap, return_lse=True,
                                      **_pages(kv))

    return decode


# ---- which states the kernel reads -------------------------------------------------------

_FLOAT_PAGES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def codec_reason(codec) -> str | None:
    """None when the kernel reads pages stored by `codec`, else what it does not read."""
    from kvjax.kv.codecs import IdentityCodec, Int8Codec, IntCodec

    if isinstance(codec, IdentityCodec):
        return None if jnp.dtype(codec.dtype) in _FLOAT_PAGES else f"pages of dtype {codec.dtype}"
    if isinstance(codec, (Int8Codec, IntCodec)):
        if codec.metadata_dtype != "float32":
            return f"codec {codec.name!r} ({codec.metadata_dtype} scales)"
        return None
    return f"codec {codec.name!r}"


def _pages(kv) -> dict | str:
    """The `paged_decode_attention` arguments that hold `kv`'s pages, or why there are none."""
    from kvjax.kv import quest
    from kvjax.kv.codecs import IntCodec
    from kvjax.kv.quantized import QuantizedPagedKV
    from kvjax.kv.state import LatentPagedKV, PagedKV

    if isinstance(kv, LatentPagedKV):
        return ("MLA latent pages (one row per token that is both the key and, in its first "
                "kv_lora_rank columns, the value; the kernel reads K and V pages of their own)")
    if isinstance(kv, quest.QuestKV):
        return _pages(kv.base)
    if isinstance(kv, PagedKV):
        if kv.k_pages.dtype not in _FLOAT_PAGES:
            return f"pages of dtype {kv.k_pages.dtype}"
        return dict(k_pages=kv.k_pages, v_pages=kv.v_pages)
    if isinstance(kv, QuantizedPagedKV):
        if kv.codec != kv.value_codec:
            return f"different key and value codecs {sorted({kv.codec.name, kv.value_codec.name})}"
        reason = codec_reason(kv.codec)
        if reason is not None:
            return reason
        k, v = kv.k_stored, kv.v_stored
        if "values" in k:
            return dict(k_pages=k["values"], v_pages=v["values"])
        args = dict(k_pages=k["codes"], v_pages=v["codes"], k_scale=k["scale"],
                    v_scale=v["scale"])
        if isinstance(kv.codec, IntCodec):
            args.update(k_zero=k["zero"], v_zero=v["zero"], bits=kv.codec.bits,
                        group=kv.codec.group)
        return args
    return f"a {type(kv).__name__}"


def reason_for(kv) -> str | None:
    """None when the kernel reads `kv`'s decode rows, else a sentence saying why not."""
    pages = _pages(kv)
    if isinstance(pages, str):
        return f"the native CPU kernel does not read {pages}"
    head_dim = pages["k_pages"].shape[-1] * 8 // pages.get("bits", 8)
    if head_dim % HEAD_DIM_MULTIPLE:
        return (f"the native CPU kernel does not read head_dim={head_dim} (not a multiple of "
                f"{HEAD_DIM_MULTIPLE})")
    return unavailable_reason()


def prefill_unavailable_reason() -> str | None:
    """None when the prefill kernel is built and registered, else why not."""
    return cpu_kernels.register(_PREFILL_TARGET, _PREFILL_SOURCE, "KvjaxPagedPrefill")


def paged_prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            layer: jax.Array | int, block_tables: jax.Array,
                            kv_lens: jax.Array, q_lens: jax.Array, *,
                            sm_scale: float | None = None,
                            soft_cap: float | None = None, window: jax.Array | int = 0,
                            target: str = _PREFILL_TARGET) -> jax.Array:
    """Causal prefill attention of one layer, read in place from all layers' float32 or
    bfloat16 pages (float32 math).

    Args:
      q: [B, C, N, D], D in PREFILL_HEAD_DIMS; query i of row b sits at position
        kv_lens[b] - q_lens[b] + i and sees the keys up to it; queries past q_lens[b] get
        zeros.
      k_pages, v_pages: [L, num_pages, P, K, D] float32 or bfloat16 (both the same).
      layer: the layer to read (a scalar, traced or not).
      block_tables: [B, W] int32; kv_lens, q_lens: [B] int32.
      sm_scale: softmax scale, 1/sqrt(D) by default.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
      window: as in `paged_decode_attention` (keys before a row's first query's window are
        neither copied nor read).
      target: the FFI target to call (`targets_for`: a build for another ISA level).
    Returns:
      q's shape and dtype: `paged_prefill_attention_reference` on layer `layer` (with
      `sliding_window=window` where window > 0).
    Raises:
      ValueError: the kernel is unavailable, or pages or head dim it does not read.
    """
    reason = prefill_reason(dict(k_pages=k_pages, v_pages=v_pages))
    if reason is not None:
        raise ValueError(reason)
    scale = 1.0 / np.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_pages, v_pages, jnp.asarray(layer, jnp.int32),
        jnp.asarray(window, jnp.int32), block_tables.astype(jnp.int32), kv_lens.astype(jnp.int32),
        jnp.asarray(q_lens, jnp.int32), sm_scale=np.float32(scale),
        soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)


def prefill_reason(pages: dict) -> str | None:
    """None when `paged_prefill_attention` reads these `_pages` arguments, else why not (the
    engine then prefills with the blockwise jnp path)."""
    if (set(pages) != {"k_pages", "v_pages"} or pages["k_pages"].dtype not in _FLOAT_PAGES
            or pages["v_pages"].dtype != pages["k_pages"].dtype):
        return "the native prefill kernel reads float32 or bfloat16 pages only"
    if pages["k_pages"].shape[-1] not in PREFILL_HEAD_DIMS:
        return (f"the native prefill kernel reads head_dim in {PREFILL_HEAD_DIMS}, not "
                f"{pages['k_pages'].shape[-1]}")
    return prefill_unavailable_reason()


def prefill_reason_for(kv) -> str | None:
    """None when the engine prefills `kv`'s rows with the native prefill kernel, else why not."""
    pages = _pages(kv)
    if isinstance(pages, str):
        return f"the native CPU kernels do not read {pages}"
    return prefill_reason(pages)


def kernels_for(kv, *, soft_cap: float | None = None, split_rows: bool = True):
    """(kv, layer, window=None) -> (decode_fn, prefill_fn): the native decode, and the native
    prefill where it reads the pages (`prefill_reason`), else the blockwise jnp prefill, all
    with the attention logits soft-capped at `soft_cap` (None: not capped) and the layer's
    sliding `window` (an int32 scalar, traced or not; 0 or None: none). ValueError for a state
    the kernels do not read (`reason_for`). `split_rows`: as in `paged_decode_attention`, for
    the decode kernel.

    Same signatures as `paged_decode_attention_reference` / `..._prefill_..._reference` over
    the rows' own block tables (what `pallas_kernels.dispatch.kernels_for` returns), so the
    step and `kvjax.parallel.sharding.shard_kernels` use either alike.
    """
    reason = reason_for(kv)
    if reason is not None:
        raise ValueError(reason)

    def chooser(kv, layer, window=None):
        pages = _pages(kv)
        native_prefill = prefill_reason(pages) is None
        window = 0 if window is None else window

        def decode(q, block_tables, kv_lens):
            return paged_decode_attention(q, layer=layer, block_tables=block_tables,
                                          kv_lens=kv_lens, soft_cap=soft_cap, window=window,
                                          split_rows=split_rows, **pages)

        def prefill(q, block_tables, kv_lens, q_lens):
            queries = q.shape[1]
            if queries <= 8 and queries * q.shape[2] // pages["k_pages"].shape[3] <= MAX_GROUP:
                # A few queries per row (speculative verify rows): each KV byte read once.
                return paged_decode_attention(q, layer=layer, block_tables=block_tables,
                                              kv_lens=kv_lens, q_lens=q_lens,
                                              soft_cap=soft_cap, window=window, **pages)
            if native_prefill:
                return paged_prefill_attention(q, layer=layer, block_tables=block_tables,
                                               kv_lens=kv_lens, q_lens=q_lens,
                                               soft_cap=soft_cap, window=window, **pages)
            load = functools.partial(kv.load_pages, layer)
            return attention_ref.paged_attention_blockwise(
                q, load, block_tables, kv_lens, q_lens,
                pages_per_block=attention_ref.PREFILL_PAGES_PER_BLOCK, soft_cap=soft_cap,
                window=window)

        return decode, prefill

    return chooser
