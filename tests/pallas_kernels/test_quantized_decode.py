"""The quantized paged decode kernel (CPU, Pallas interpret mode) against its oracle: the
codec's dequantized pages through the float32 jnp paged decode reference.

Every case uses a randomly permuted block table; in every slot that holds no token the scales
and zero points are NaN (and fp8 code bytes are NaN patterns), so a read the lengths do not
allow shows up as NaN in the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kv_cases import INTERPRET, TOLERANCES, block_pages, max_abs_error, paged_layout, runnable

from kvjax.kv import codecs
from kvjax.kv.attention import paged_decode_attention_reference
from pallas_kernels.paged_decode import Schedule
from pallas_kernels.quantized_decode import (
    CodeFormat,
    code_format,
    quantized_decode_attention,
    quantized_decode_attention_reference,
)
from pallas_kernels.quantized_decode.pipelined import float8_bytes_to_float32

_DYNAMIC = codecs.Fp8Scaling.DYNAMIC
CODECS = {
    "int8": codecs.Int8Codec(),
    "int8-fp16meta": codecs.Int8Codec("float16"),
    "fp8_e4m3": codecs.Fp8Codec(codecs.Fp8Format.E4M3, _DYNAMIC),
    "fp8_e5m2": codecs.Fp8Codec(codecs.Fp8Format.E5M2, _DYNAMIC),
    "int4": codecs.IntCodec(4, 32),
    "int2": codecs.IntCodec(2, 16),
    # Asymmetric 8-bit codes, a scale and zero per channel group (kv_codec_options group=).
    "int8-g32": codecs.get_codec("int8", group=32),
    "int8-g64": codecs.get_codec("int8", group=64),
}
# A NaN in both float8_e4m3fn and float8_e5m2 (exponent all ones, mantissa non-zero).
FP8_NAN_BYTE = 0x7F
# Max |kernel - exact float attention| on unit-normal data, per codec: the codec's own error.
EXACT_KV_BOUNDS = {"int8": 2e-2, "int8-g32": 2e-2, "fp8_e4m3": 1.5e-1, "int4": 3e-1}


def encode_pool(codec: codecs.KVCodec, x: np.ndarray, holds_token: np.ndarray
                ) -> dict[str, jax.Array]:
    """x [num_pages, P, K, D] -> storage as QuantizedPagedKV holds it, poisoned off-token."""
    stored = {name: np.array(a) for name, a in codec.encode(jnp.asarray(x)).items()}
    if code_format(codec) is CodeFormat.FP8:
        stored["codes"] = stored["codes"].view(np.uint8)  # the pool keeps fp8 as bytes
        stored["codes"][~holds_token] = FP8_NAN_BYTE
    for name in ("scale", "zero"):
        if name in stored:
            stored[name][~holds_token] = np.nan
    return {name: jnp.asarray(a) for name, a in stored.items()}


def make_case(seed: int, kv_lens: list[int], codec: codecs.KVCodec, *, page_size: int,
              num_kv_heads: int, group: int, head_dim: int, dtype) -> tuple[dict, dict]:
    """(kernel arguments, exact float pages) for one poisoned, permuted quantized pool."""
    rng = np.random.default_rng(seed)
    block_tables, holds_token = paged_layout(rng, kv_lens, page_size)
    shape = (holds_token.shape[0], page_size, num_kv_heads, head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    q = rng.standard_normal((len(kv_lens), num_kv_heads * group, head_dim))
    case = dict(q=jnp.asarray(q, dtype), k_stored=encode_pool(codec, k, holds_token),
                v_stored=encode_pool(codec, v, holds_token),
                block_tables=jnp.asarray(block_tables), kv_lens=jnp.asarray(kv_lens, jnp.int32))
    k[~holds_token], v[~holds_token] = np.nan, np.nan
    return case, dict(k_pages=jnp.asarray(k, jnp.float32), v_pages=jnp.asarray(v, jnp.float32))


def check_against_reference(case: dict, codec: codecs.KVCodec, dtype, **kwargs) -> jax.Array:
    options = {k: kwargs[k] for k in ("soft_cap", "sliding_window") if k in kwargs}
    want = quantized_decode_attention_reference(**case, codec=codec, **options)
    got = quantized_decode_attention(**case, codec=codec, interpret=INTERPRET, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOLERANCES[dtype])
    return got


def lengths(page_size: int) -> list[int]:
    """A single token, non-multiples of the page size, an exact multiple, a padded row."""
    return [1, 2 * page_size + 3, 0, 3 * page_size, page_size - 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("codec_name", ["int8", "fp8_e4m3", "int4", "int8-g32"])
def test_matches_dequantized_reference(codec_name, dtype):
    codec = CODECS[codec_name]
    case, _ = make_case(len(codec_name), lengths(4), codec, page_size=4, num_kv_heads=2,
                        group=3, head_dim=64, dtype=dtype)
    check_against_reference(case, codec, dtype, pages_per_compute_block=block_pages(4, 2),
                            num_splits=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec_name", ["int8-fp16meta", "fp8_e5m2", "int2", "int8-g64"])
def test_other_codecs_page_16(codec_name):
    codec = CODECS[codec_name]
    case, _ = make_case(3, [1, 37, 16], codec, page_size=16, num_kv_heads=1, group=4,
                        head_dim=64, dtype=jnp.bfloat16)
    check_against_reference(case, codec, jnp.bfloat16)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule,codec_name", [(Schedule.LOOPED, "int8"),
                                                 (Schedule.PIPELINED, "int4")],
                         ids=["looped-int8", "pipelined-int4"])
def test_soft_cap_sliding_window_and_split_k(schedule, codec_name):
    codec = CODECS[codec_name]
    case, _ = make_case(5, [1, 29, 6, 0, 97], codec, page_size=4, num_kv_heads=2, group=2,
                        head_dim=64, dtype=jnp.float32)
    check_against_reference(case, codec, jnp.float32, soft_cap=3.0, sliding_window=9,
                            pages_per_compute_block=block_pages(4, 2), num_splits=3,
                            schedule=runnable(schedule))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec_name", sorted(EXACT_KV_BOUNDS))
def test_close_to_exact_kv(codec_name):
    """Against attention over the unquantized pages: the codec's error, bounded per codec."""
    codec = CODECS[codec_name]
    case, exact = make_case(9, [70, 13], codec, page_size=16, num_kv_heads=2, group=2,
                            head_dim=64, dtype=jnp.float32)
    got = quantized_decode_attention(**case, codec=codec, interpret=INTERPRET)
    want = paged_decode_attention_reference(case["q"], exact["k_pages"], exact["v_pages"],
                                            case["block_tables"], case["kv_lens"])
    assert max_abs_error(got, want) <= EXACT_KV_BOUNDS[codec_name]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec_name,dtype", [("int8", jnp.float32), ("fp8_e4m3", jnp.bfloat16),
                                              ("fp8_e5m2", jnp.float32), ("int4", jnp.bfloat16),
                                              ("int2", jnp.float32),
                                              ("int8-g32", jnp.bfloat16)],
                         ids=["int8-f32", "fp8_e4m3-bf16", "fp8_e5m2-f32", "int4-bf16", "int2-f32",
                              "int8-g32-bf16"])
def test_pipelined_matches_dequantized_reference(codec_name, dtype):
    """The TPU schedule (dequantizing in VMEM, float8 decoded from its bytes) per format."""
    codec = CODECS[codec_name]
    case, _ = make_case(len(codec_name), lengths(4), codec, page_size=4, num_kv_heads=2,
                        group=3, head_dim=64, dtype=dtype)
    check_against_reference(case, codec, dtype, pages_per_compute_block=2, num_splits=2,
                            schedule=runnable(Schedule.PIPELINED))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_float8_bytes_decode_like_the_float8_type(name):
    """Every finite byte of the format decodes to its float8 value (ml_dtypes' conversion)."""
    dtype = CODECS[name].fmt.dtype
    raw = np.arange(256, dtype=np.uint8)
    want = raw.view(dtype).astype(np.float32)
    got = np.asarray(float8_bytes_to_float32(jnp.asarray(raw, jnp.int32), dtype))
    finite = np.isfinite(want)
    assert finite.sum() >= 240
    np.testing.assert_array_equal(got[finite], want[finite])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("codec_name", sorted(CODECS))
def test_full_product(codec_name, page_size, group, dtype):
    codec = CODECS[codec_name]
    case, _ = make_case(page_size * group, [1, 5 * page_size + 1, 0, 7, 8 * page_size], codec,
                        page_size=page_size, num_kv_heads=3, group=group, head_dim=64,
                        dtype=dtype)
    for pages, splits in ((1, 4), (4, 1)):
        check_against_reference(case, codec, dtype, soft_cap=30.0,
                                sliding_window=3 * page_size, num_splits=splits,
                                pages_per_compute_block=block_pages(page_size, pages))


def test_rejects_codecs_and_storage_it_cannot_read():
    case, _ = make_case(0, [5], CODECS["int8"], page_size=4, num_kv_heads=2, group=2,
                        head_dim=64, dtype=jnp.float32)
    with pytest.raises(ValueError, match="KIVI"):
        quantized_decode_attention(**case, codec=codecs.KiviCodec(4, 4, 0), interpret=True)
    calibrated = codecs.Fp8Codec(codecs.Fp8Format.E4M3, scale=(1.0, 1.0))
    with pytest.raises(ValueError, match="dynamic"):
        quantized_decode_attention(**case, codec=calibrated, interpret=True)
    with pytest.raises(ValueError, match="lacks"):
        quantized_decode_attention(**case, codec=CODECS["int4"], interpret=True)
    bad = {**case["v_stored"], "scale": case["v_stored"]["scale"][:, :2]}
    with pytest.raises(ValueError, match="scale has shape"):
        quantized_decode_attention(**{**case, "v_stored": bad}, codec=CODECS["int8"],
                                   interpret=True)
