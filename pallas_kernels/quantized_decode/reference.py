"""The oracle of the quantized decode kernel: dequantize the pages with the codec, then kvjax's
float32 jnp paged decode reference. Same leading arguments as the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.kv import codecs
from kvjax.kv.attention import paged_decode_attention_reference


def codec_view(stored: dict[str, jax.Array], codec: codecs.KVCodec) -> dict[str, jax.Array]:
    """The storage as `codec.decode` takes it: fp8 codes held as uint8 bytes bitcast back."""
    if isinstance(codec, codecs.Fp8Codec) and stored["codes"].dtype == jnp.uint8:
        return {**stored, "codes": jax.lax.bitcast_convert_type(stored["codes"], codec.fmt.dtype)}
    return stored


def quantized_decode_attention_reference(
    q: jax.Array,
    k_stored: dict[str, jax.Array],
    v_stored: dict[str, jax.Array],
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    codec: codecs.KVCodec,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Decode attention over the dequantized pages.

    Args:
      q: [B, N, D].
      k_stored, v_stored: one layer's storage, name -> [num_pages, P, K, ...] (the codec's
        `storage_spec` rows, page-major, as `QuantizedPagedKV` holds them).
      block_tables: [B, Pmax] int32; kv_lens: [B] int32.
      codec: the codec that wrote the storage.
    Returns:
      [B, N, D] in q's dtype.
    """
    k_pages = codec.decode(codec_view(k_stored, codec))  # [num_pages, P, K, D] float32
    v_pages = codec.decode(codec_view(v_stored, codec))
    return paged_decode_attention_reference(q, k_pages, v_pages, block_tables, kv_lens,
                                            sm_scale=sm_scale, soft_cap=soft_cap,
                                            sliding_window=sliding_window)
