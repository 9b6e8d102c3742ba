"""Paged decode attention over quantized KV pages, dequantized inside the kernel.

Same leading arguments as `reference.quantized_decode_attention_reference`: q [B, N, D], then
one layer's key and value storage in the layout of `kvjax.kv.quantized.QuantizedPagedKV`
(`{name: x[layer] for name, x in kv.k_stored.items()}`), block_tables [B, Pmax] int32 and
kv_lens [B] int32, with the codec (static) saying how to read the codes:

  format   codec                      codes                       metadata
  INT8     Int8Codec                  int8 [num_pages, P, K, D]   scale [num_pages, P, K]
  FP8      Fp8Codec, dynamic scaling  float8 (or its uint8 bytes, scale [num_pages, P, K]
                                      as the pool holds them)
                                      [num_pages, P, K, D]
  PACKED   IntCodec (int8 group=g,    uint8 [num_pages, P, K,     scale, zero
           int4, int2)                D * bits / 8]               [num_pages, P, K, D / group]

The pages are read only as codes and metadata; the float K and V never exist in memory.

Per-token scales (INT8, FP8): x_hat[s, d] = codes[s, d] * scale[s], so the scale factors out of
both matmuls: logits = (q . codes) * scale_k and out = (p * scale_v) . codes_v. The codes are
exact in bfloat16 (|int8| <= 127 and every float8 value are bf16 values), so with bf16 queries
the matmuls take bf16 operands with float32 accumulation and the logits are exact products
summed in float32; with float32 queries they run in float32.

Asymmetric codes with a scale and zero per channel group (PACKED: 8-bit codes with
`group=g`, packed 4- and 2-bit codes): byte j of a token holds channels c*j .. c*j + c - 1
(c = 8 / bits codes per byte, lowest bits first; c = 1 for 8-bit codes). Phase i of every
byte (bits [i*bits, (i+1)*bits)) is channel c*j + i, so the kernel unpacks phase i as one
[S_blk, D / c] slab, dequantizes it with its group's scale and zero, and multiplies it with the
query's channels i, i + c, ... (split outside the kernel): logits = sum_i q_i . x_i. The value
output comes out phase-major, [c, D / c], and is put back in channel order after the kernel.
No in-kernel interleave is needed.

Softmax state and accumulation are float32 (`paged_decode.kernel.fold_logits`). Slots at or
past kv_lens, whose codes or metadata may hold anything (NaN scales included), are masked in
the logits and zeroed (codes and scales) before the value matmul.

Schedules (`paged_decode.Schedule`, default per backend): LOOPED (GPU, Pallas Triton), grid
(B, K, splits), each program gathering a compute block's pages through the block table, with
the scales factored out of the matmuls as above; PIPELINED (TPU, Mosaic), `pipelined.py`:
`paged_decode`'s scalar-prefetch pipeline over code and metadata pages, dequantizing in VMEM
in the layouts Mosaic tiles. Both also run in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kvjax.kv import codecs
from pallas_kernels import targets
from pallas_kernels.paged_decode.kernel import (
    Schedule,
    cap_logits,
    check_paged_args,
    check_triton_block,
    decode_blocking,
    decode_visible,
    default_schedule,
    finish_decode,
    fold_logits,
    fold_split,
    grouped_queries,
    looped_decode_call,
    matmul_nn,
    matmul_nt,
    max_block_tokens,
    padded_group,
    split_block_range,
    window_rows,
)
from pallas_kernels.quantized_decode import pipelined
from pallas_kernels.quantized_decode.formats import CodeFormat


def code_format(codec: codecs.KVCodec) -> CodeFormat:
    """The kernel's format for `codec`; ValueError for a codec it cannot read."""
    if isinstance(codec, codecs.Int8Codec):
        return CodeFormat.INT8
    if isinstance(codec, codecs.Fp8Codec):
        if codec.scaling is not codecs.Fp8Scaling.DYNAMIC:
            raise ValueError(f"codec {codec.name!r}: the quantized decode kernel reads fp8 with "
                             "dynamic (per-token) scales only")
        return CodeFormat.FP8
    if isinstance(codec, codecs.IntCodec):  # int8 with group=g, int4, int2
        return CodeFormat.PACKED
    raise ValueError(f"codec {getattr(codec, 'name', codec)!r} has no quantized decode kernel "
                     "(supported: int8 with or without group=, fp8_* dynamic, int4, int2; KIVI "
                     "keeps per-channel key groups and an exact window, which this kernel "
                     "does not read)")


def storage_names(fmt: CodeFormat) -> tuple[str, ...]:
    """The storage entries the kernel reads, in the order it takes them."""
    return ("codes", "scale", "zero") if fmt is CodeFormat.PACKED else ("codes", "scale")


def check_storage(stored: dict[str, jax.Array], codec: codecs.KVCodec, *, what: str
                  ) -> tuple[int, int, int, int]:
    """Validates one tensor's storage against the codec; returns (num_pages, P, K, D)."""
    fmt = code_format(codec)
    missing = sorted(set(storage_names(fmt)) - set(stored))
    if missing:
        raise ValueError(f"{what} storage lacks {missing} for codec {codec.name!r}; has "
                         f"{sorted(stored)}")
    codes = stored["codes"]
    if codes.ndim != 4:
        raise ValueError(f"{what} codes {codes.shape} must be [num_pages, P, K, D_codes]")
    num_pages, p, k_heads, width = codes.shape
    head_dim = width * 8 // codec.bits if fmt is CodeFormat.PACKED else width
    spec = codec.storage_spec(num_pages * p, k_heads, head_dim)
    for name in storage_names(fmt):
        want = (num_pages, p) + spec[name].shape[1:]
        if stored[name].shape != want:
            raise ValueError(f"{what} {name} has shape {stored[name].shape}, codec "
                             f"{codec.name!r} stores {want}")
    return num_pages, p, k_heads, head_dim


def _phases(fmt: CodeFormat, codec: codecs.KVCodec) -> int:
    """Codes per byte: the number of channel phases the kernel handles separately."""
    return 8 // codec.bits if fmt is CodeFormat.PACKED else 1


def _unpack_phases(packed: jax.Array, scale: jax.Array, zero: jax.Array, *, bits: int,
                   group: int) -> list[jax.Array]:
    """Dequantized channel phases of packed codes, each [S, D / c] float32.

    packed: [S, D / c] uint8; scale, zero: [S, D / group] float32. Phase i holds channels
    i, i + c, ...; channel c * j + i belongs to group j // (group / c).
    """
    per_byte = 8 // bits
    s, width = packed.shape
    num_groups = scale.shape[1]
    mask = jnp.uint8(2**bits - 1)
    phases = []
    for i in range(per_byte):
        codes = ((packed >> jnp.uint8(i * bits)) & mask).astype(jnp.float32)  # [S, D/c]
        codes = codes.reshape(s, num_groups, group // per_byte)
        x = zero[:, :, None] + codes * scale[:, :, None]  # [S, D/g, g/c]
        phases.append(x.reshape(s, width))
    return phases


def _quantized_decode_kernel(bt_ref, len_ref, *refs, fmt: CodeFormat, phases: int,
                             bits: int, group: int, fp8_dtype, pages_per_block: int,
                             page_size: int, num_splits: int, sm_scale: float,
                             soft_cap: float | None, windowed: bool):
    """One (row, kv head, split) program over quantized pages: dequantize, fold, repeat."""
    sliding_window = None
    if windowed:  # this row's window [1]
        win_ref, *refs = refs
        sliding_window = win_ref[0]
    q_refs, refs = refs[:phases], refs[phases:]
    num_meta = len(storage_names(fmt))
    k_refs, v_refs = refs[:num_meta], refs[num_meta:2 * num_meta]
    o_ref, m_ref, l_ref = refs[2 * num_meta:]
    block_tokens = pages_per_block * page_size
    kv_len = len_ref[0]
    lo, hi = split_block_range(kv_len, pl.program_id(2), block_tokens=block_tokens,
                               num_splits=num_splits, sliding_window=sliding_window)
    qs = [r[...] for r in q_refs]  # each [Gp, D / phases]
    # Codes are exact in bf16; with f32 queries the matmuls stay f32.
    compute = jnp.bfloat16 if qs[0].dtype == jnp.bfloat16 else jnp.float32

    def gather(ref_group, page_ids):
        """The block's storage rows: codes [S_blk, width], metadata [S_blk, ...] f32."""
        codes = ref_group[0][page_ids]
        codes = codes.reshape(block_tokens, codes.shape[-1])
        meta = [r[page_ids].astype(jnp.float32) for r in ref_group[1:]]
        meta = [x.reshape(block_tokens, *x.shape[2:]) for x in meta]
        if fmt is CodeFormat.FP8 and codes.dtype == jnp.uint8:
            codes = lax.bitcast_convert_type(codes, fp8_dtype)
        return codes, meta

    def fold(block, carry):
        page_ids = bt_ref[pl.ds(block * pages_per_block, pages_per_block)]  # [pages]
        pos = block * block_tokens + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        in_seq, visible = decode_visible(pos, kv_len, sliding_window)  # [1, S_blk]
        live = in_seq.reshape(block_tokens, 1)
        k_codes, k_meta = gather(k_refs, page_ids)
        v_codes, v_meta = gather(v_refs, page_ids)
        if fmt is CodeFormat.PACKED:
            k_parts = _unpack_phases(k_codes, *k_meta, bits=bits, group=group)
            v_parts = [jnp.where(live, x, 0.0).astype(compute)
                       for x in _unpack_phases(v_codes, *v_meta, bits=bits, group=group)]
            s = sum(matmul_nt(qi, ki.astype(compute)) for qi, ki in zip(qs, k_parts, strict=True))
            s = cap_logits(s * sm_scale, soft_cap)  # [Gp, S_blk]
            def value_matmul(p):
                outs = tuple(matmul_nn(p.astype(compute), v) for v in v_parts)
                return outs[0] if phases == 1 else outs  # fold_split's carry: 8-bit, one phase

            return fold_logits(s, visible, carry, value_matmul)
        k_scale = k_meta[0].reshape(1, block_tokens)  # [1, S_blk]
        v_scale = jnp.where(in_seq, v_meta[0].reshape(1, block_tokens), 0.0)
        v_codes = jnp.where(live, v_codes.astype(compute), jnp.zeros((), compute))
        s = matmul_nt(qs[0], k_codes.astype(compute)) * (k_scale * sm_scale)  # [Gp, S_blk]
        s = cap_logits(s, soft_cap)
        return fold_logits(s, visible, carry,
                           lambda p: matmul_nn((p * v_scale).astype(compute), v_codes))

    width = qs[0].shape[1]
    fold_split(o_ref, m_ref, l_ref, lo=lo, hi=hi, fold=fold, rows=qs[0].shape[0],
               widths=(width,) * phases)



def _looped_partials(q, pools, block_tables, kv_lens, *, fmt: CodeFormat, codec, gp: int,
                     phases: int, bits: int, group: int, fp8_dtype, pages_per_block: int,
                     num_splits: int, sm_scale: float, soft_cap: float | None,
                     windows: jax.Array | None, interpret: bool):
    """Partials [B, splits, K, Gp, D] (phase-major) and max, sum on the GPU schedule."""
    d = q.shape[2]
    p, k_heads = pools[0].shape[1:3]
    if not interpret and fmt is CodeFormat.FP8 and targets.current_platform() == "gpu":
        # Refused here: below sm_89 the compiler aborts the process instead of failing.
        reason = targets.fp8_unsupported_reason(targets.current_gpu())
        if reason is not None:
            raise ValueError(f"codec {codec.name!r}: {reason}")
    if not interpret:
        check_triton_block(rows=gp, head_dim=d // phases, pages_per_block=pages_per_block,
                           page_size=p)
    qg = grouped_queries(q, k_heads, gp)  # [B, K, Gp, D]
    kernel = functools.partial(
        _quantized_decode_kernel, fmt=fmt, phases=phases, bits=bits, group=group,
        fp8_dtype=fp8_dtype, pages_per_block=pages_per_block, page_size=p,
        num_splits=num_splits, sm_scale=sm_scale, soft_cap=soft_cap,
        windowed=windows is not None)
    return looped_decode_call(
        kernel, tables=[block_tables], kv_lens=kv_lens,
        queries=[qg[..., i::phases] for i in range(phases)],  # channel phases, [B, K, Gp, D/c]
        pools=pools, out_dim=d, num_splits=num_splits, interpret=interpret,
        name=f"quantized_decode_{fmt.value}", windows=windows)


def quantized_decode_attention(
    q: jax.Array,
    k_stored: dict[str, jax.Array],
    v_stored: dict[str, jax.Array],
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    codec: codecs.KVCodec,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    schedule: Schedule | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention over quantized pages: query b sits at position kv_lens[b] - 1.

    Args:
      q: [B, N, D].
      k_stored, v_stored: one layer's storage, name -> [num_pages, P, K, ...] (module table).
      block_tables: [B, Pmax] int32; entries past a sequence's length may hold any valid page.
      kv_lens: [B] int32; 0 marks a padded row (its output is zeros).
      codec: the pool's codec (static): Int8Codec, dynamic Fp8Codec or IntCodec.
      sm_scale, soft_cap, sliding_window: as `paged_decode.paged_decode_attention`.
      pages_per_compute_block: pages dequantized and folded per step (about 128 tokens).
      num_splits: split-K partitions of each sequence's live blocks (default per backend).
      schedule: PIPELINED (TPU) or LOOPED (GPU); default per backend.
      interpret: run through the Pallas interpreter (any backend, CPU included).
    Returns:
      [B, N, D] in q's dtype.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [B, N, D], got shape {q.shape}")
    fmt = code_format(codec)
    shape = check_storage(k_stored, codec, what="key")
    if check_storage(v_stored, codec, what="value") != shape:
        raise ValueError(f"key storage {shape} and value storage "
                         f"{check_storage(v_stored, codec, what='value')} differ")
    pages = jax.ShapeDtypeStruct(shape, jnp.float32)  # [num_pages, P, K, D] as dequantized
    check_paged_args(q, pages, pages, block_tables, kv_lens, soft_cap=soft_cap,
                     sliding_window=sliding_window,
                     pages_per_compute_block=pages_per_compute_block)
    b, n, d = q.shape
    _, p, k_heads, _ = shape
    phases = _phases(fmt, codec)
    if fmt is CodeFormat.PACKED and codec.group % phases:
        raise ValueError(f"codec {codec.name!r}: group {codec.group} is not a multiple of the "
                         f"{phases} codes per byte")
    schedule = default_schedule() if schedule is None else schedule
    pipelined_schedule = schedule is Schedule.PIPELINED
    gp = n // k_heads if pipelined_schedule else padded_group(n // k_heads, interpret)
    # The codes are dequantized to the compute dtype in shared memory: size blocks by it.
    block_tables, pages_per_block, num_splits = decode_blocking(
        block_tables, batch=b, num_kv_heads=k_heads, page_size=p,
        pages_per_compute_block=pages_per_compute_block, num_splits=num_splits,
        max_block_tokens=max_block_tokens(
            rows=gp, head_dim=d, dtype=jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32,
            interpret=interpret or pipelined_schedule))
    names = storage_names(fmt)
    pools = [k_stored[x] for x in names] + [v_stored[x] for x in names]
    options = dict(bits=getattr(codec, "bits", 8), group=getattr(codec, "group", d),
                   fp8_dtype=codec.fmt.dtype if fmt is CodeFormat.FP8 else None,
                   pages_per_block=pages_per_block, num_splits=num_splits,
                   sm_scale=1.0 / np.sqrt(d) if sm_scale is None else sm_scale,
                   soft_cap=soft_cap)
    if pipelined_schedule:
        if fmt is CodeFormat.FP8:  # The TPU kernel decodes float8 from its bytes.
            pools = [lax.bitcast_convert_type(x, jnp.uint8) if x.dtype == options["fp8_dtype"]
                     else x for x in pools]
        *accs, row_max, row_sum = pipelined.pipelined_partials(
            [q[..., i::phases] for i in range(phases)], pools[:len(names)],
            pools[len(names):], block_tables, kv_lens, fmt=fmt,
            windows=window_rows(sliding_window, b), interpret=interpret, **options)
        acc = jnp.concatenate(accs, axis=-1)  # [B, splits, K, G, D], phase-major
    else:
        acc, row_max, row_sum = _looped_partials(
            q, pools, block_tables, kv_lens, fmt=fmt, codec=codec, gp=gp, phases=phases,
            windows=window_rows(sliding_window, b), interpret=interpret, **options)
    # Phase-major [.., c, D/c] back to channel order [.., D / c, c].
    acc = acc.reshape(*acc.shape[:-1], phases, d // phases)
    acc = jnp.swapaxes(acc, -1, -2).reshape(*acc.shape[:-2], d)
    return finish_decode(acc, row_max, row_sum, q=q, num_kv_heads=k_heads)
