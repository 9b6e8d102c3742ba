"""The TPU (Mosaic) schedule of the quantized decode kernel: `paged_decode`'s PIPELINED driver
over code and metadata pages.

Each page of a compute block is one BlockSpec per storage entry (codes, scale, zero), all K kv
heads of the page, DMA'd by the pipeline from the scalar-prefetched block table. The kernel
works in the layouts Mosaic tiles without relayouts:

  * Per-token scales (INT8, FP8) arrive as [S_blk, K]: kv head h's column is [S_blk, 1], one
    token per sublane, so the codes are dequantized in VMEM (`codes * scale`, a lane
    broadcast) before both matmuls. Factoring the scale out of the logits, as the GPU schedule
    does, would need it lane-major ([1, S_blk]): a transpose per block.
  * Float8 codes are decoded from their bytes with 32-bit integer ops (sign, exponent and
    mantissa fields into a float32's bits), so no float8 type reaches Mosaic: v5e has none.
    Only a NaN or inf byte decodes differently (to a finite value); the codecs saturate, so
    no written token holds one, and slots without a token are masked.
  * Grouped codes (int8 with group=g, packed int4 and int2) are widened to int32 before the
    shifts (none for 8-bit codes, one phase); phase i of every byte
    is channels i, i + c, ..., multiplied with the matching query channels (split outside the
    kernel), as on GPU. The per-group scale and zero, [S_blk, D / group], are spread over a
    phase's lanes by selects on a lane iota, not by a lane-splitting reshape.

Softmax state and accumulation are float32; bf16 queries take bf16 dequantized codes with
float32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_decode.kernel import (
    cap_logits,
    fold_logits,
    matmul_nn,
    matmul_nt,
    pipelined_decode_call,
    table_block_masks,
    table_walk,
)
from pallas_kernels.quantized_decode.formats import CodeFormat


def float8_bytes_to_float32(codes: jax.Array, dtype) -> jax.Array:
    """Float8 bytes (int32 in [0, 256)) -> their float32 values, for a float8 `dtype` with an
    exponent bias and subnormals (float8_e4m3fn, float8_e5m2). NaN and inf bytes decode to
    finite values."""
    info = jnp.finfo(dtype)
    mantissa_bits, bias = info.nmant, 1 - info.minexp
    exponent = (codes >> mantissa_bits) & ((1 << (7 - mantissa_bits)) - 1)
    mantissa = codes & ((1 << mantissa_bits) - 1)
    normal = lax.bitcast_convert_type(
        ((exponent + (127 - bias)) << 23) | (mantissa << (23 - mantissa_bits)), jnp.float32)
    subnormal = mantissa.astype(jnp.float32) * (2.0 ** (1 - bias - mantissa_bits))
    magnitude = jnp.where(exponent == 0, subnormal, normal)
    return jnp.where((codes >> 7) == 1, -magnitude, magnitude)


def _spread_groups(meta: jax.Array, *, width: int, lanes_per_group: int) -> jax.Array:
    """[S, D / group] -> [S, width]: lane j of a phase takes its group's (j // lanes_per_group)
    value."""
    group_of_lane = lax.broadcasted_iota(jnp.int32, (1, width), 1) // lanes_per_group
    out = jnp.broadcast_to(meta[:, 0:1], (meta.shape[0], width))
    for j in range(1, meta.shape[1]):
        out = jnp.where(group_of_lane == j, meta[:, j:j + 1], out)
    return out


def _head_phases(codes: jax.Array, meta: list[jax.Array], h: int, *, fmt: CodeFormat,
                 bits: int, group: int, fp8_dtype) -> list[jax.Array]:
    """Kv head h's dequantized channel phases, each [S_blk, D / c] float32.

    codes: [S_blk, K, D / c]; meta: float32 scale (and zero), [S_blk, K] per token or
    [S_blk, K, D / group] per group.
    """
    codes_h = codes[:, h]  # [S_blk, D / c]
    if fmt is CodeFormat.INT8:
        return [codes_h.astype(jnp.float32) * meta[0][:, h:h + 1]]
    if fmt is CodeFormat.FP8:
        values = float8_bytes_to_float32(codes_h.astype(jnp.int32), fp8_dtype)
        return [values * meta[0][:, h:h + 1]]
    per_byte = 8 // bits
    ints = codes_h.astype(jnp.int32)
    width = ints.shape[1]
    scale, zero = (_spread_groups(x[:, h], width=width, lanes_per_group=group // per_byte)
                   for x in meta)  # [S_blk, D / c]
    return [zero + ((ints >> (i * bits)) & (2**bits - 1)).astype(jnp.float32) * scale
            for i in range(per_byte)]


def pipelined_partials(queries: list[jax.Array], k_pools: list[jax.Array],
                       v_pools: list[jax.Array], block_tables: jax.Array, kv_lens: jax.Array, *,
                       fmt: CodeFormat, bits: int, group: int, fp8_dtype,
                       pages_per_block: int, num_splits: int, sm_scale: float,
                       soft_cap: float | None, windows: jax.Array | None, interpret: bool
                       ) -> tuple[jax.Array, ...]:
    """Quantized decode partials on the TPU schedule.

    Args:
      queries: the channel phases of q, [B, N, D / c] each (one for INT8 and FP8).
      k_pools, v_pools: storage entries (`storage_names` order), [num_pages, P, K, ...] each;
        float8 codes as their uint8 bytes.
      block_tables: [B, W] int32, padded to whole compute blocks; kv_lens: [B] int32.
      windows: [B] int32 per-row sliding windows, or None.
    Returns:
      One partial output [B, splits, K, G, D / c] per phase, then softmax max and sum
      [B, splits, K, G, 1].
    """
    p = k_pools[0].shape[1]
    width = block_tables.shape[1]
    compute = jnp.bfloat16 if queries[0].dtype == jnp.bfloat16 else jnp.float32
    dequantize = lambda codes, meta, h: _head_phases(  # noqa: E731
        codes, meta, h, fmt=fmt, bits=bits, group=group, fp8_dtype=fp8_dtype)

    def fold_block(row, block, scalar_refs, blocks):
        visible, in_seq_col = table_block_masks(row, block, scalar_refs, pages_per_block * p)
        k_codes, *k_meta = blocks[:len(k_pools)]
        v_codes, *v_meta = blocks[len(k_pools):]
        k_meta = [x.astype(jnp.float32) for x in k_meta]
        v_meta = [x.astype(jnp.float32) for x in v_meta]

        def head_fold(h, q_rows, carry):
            k_parts = dequantize(k_codes, k_meta, h)
            # Slots without a token may hold NaN scales: zero them before the value matmul.
            v_parts = [jnp.where(in_seq_col, x, 0.0).astype(compute)
                       for x in dequantize(v_codes, v_meta, h)]
            s = sum(matmul_nt(qi, ki.astype(compute))
                    for qi, ki in zip(q_rows, k_parts, strict=True))  # [G, S_blk]
            s = cap_logits(s * sm_scale, soft_cap)
            return fold_logits(s, visible, carry,
                               lambda p: tuple(matmul_nn(p.astype(compute), v) for v in v_parts))
        return head_fold

    block_range, page_of = table_walk(page_size=p, pages_per_block=pages_per_block,
                                      num_splits=num_splits, width=width)
    scalars = [block_tables.reshape(-1), kv_lens.astype(jnp.int32)]
    return pipelined_decode_call(
        fold_block, scalars=scalars + ([] if windows is None else [windows]), queries=queries,
        pools=[*k_pools, *v_pools], block_range=block_range, page_of=page_of,
        pages_per_block=pages_per_block, widths=tuple(x.shape[2] for x in queries),
        num_splits=num_splits, steps=pl.cdiv(pl.cdiv(width, pages_per_block), num_splits),
        interpret=interpret, name=f"quantized_decode_{fmt.value}_pipelined")
