"""Tests for kvjax.kv.codecs against numpy oracles of each quantizer."""

import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.kv import codecs

# Float32 rounding slack of the quantizers' arithmetic (XLA may fuse or reassociate it),
# relative to the largest magnitude involved. One quantization step is far larger.
F32_SLACK = 1e-6
# Attention over decoded K/V: jitted float32 vs numpy float64 on the same decoded arrays.
ATTENTION_ATOL = 1e-5
# Attention over int8 K/V vs exact K/V (Gaussian, D=64): stated relative-error bound.
INT8_ATTENTION_RTOL = 1e-2
# fp8 mantissa bits and subnormal spacing exponents: |err| <= 2**-(m+1)|x| + scale 2**-(s+1).
FP8_MANTISSA_BITS = {codecs.Fp8Format.E4M3: 3, codecs.Fp8Format.E5M2: 2}
FP8_SUBNORMAL_EXPONENT = {codecs.Fp8Format.E4M3: 9, codecs.Fp8Format.E5M2: 16}
ML_FP8 = {codecs.Fp8Format.E4M3: ml_dtypes.float8_e4m3fn,
          codecs.Fp8Format.E5M2: ml_dtypes.float8_e5m2}

NUM_KV_HEADS, HEAD_DIM = 3, 64


def gaussian(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def calibrated(fmt, samples):
    return codecs.Fp8Codec(fmt).calibrate(samples)


def all_codecs():
    """One instance of every codec and option family, fp8 calibrated on Gaussian samples."""
    samples = gaussian((64, NUM_KV_HEADS, HEAD_DIM), seed=99)
    return [
            codecs.get_codec("none"),
            codecs.get_codec("none", dtype="bfloat16"),
            codecs.get_codec("int8"),
            codecs.get_codec("int8", metadata_dtype="float16"),
            codecs.get_codec("int8", group=16),
            codecs.get_codec("int4"),
            codecs.get_codec("int4", group=16, metadata_dtype="float16"),
            codecs.get_codec("int2"),
            codecs.get_codec("int2", group=8),
            calibrated(codecs.Fp8Format.E4M3, samples),
            calibrated(codecs.Fp8Format.E5M2, samples),
            codecs.get_codec("fp8_e4m3", scaling="dynamic"),
            codecs.get_codec("fp8_e5m2", scaling="dynamic"),
            codecs.get_codec("kivi4"),
            codecs.get_codec("kivi2", metadata_dtype="float16"),
    ]


# Codecs are hashable, so jit caches one compilation per (codec, shape) across tests.
_encode = jax.jit(lambda codec, x: codec.encode(x), static_argnums=0)
_roundtrip = jax.jit(lambda codec, x: codec.decode(codec.encode(x)), static_argnums=0)


def roundtrip(codec, x):
    return np.asarray(_roundtrip(codec, x))


# Numpy oracles: each re-derives the dequantized value from the codec's documented formula.

def oracle_asymmetric(x, axis, bits):
    levels = 2**bits - 1
    lo = x.min(axis=axis, keepdims=True)
    scale = x.max(axis=axis, keepdims=True) / levels - lo / levels
    codes = np.clip(np.round((x - lo) / np.where(scale > 0, scale, 1)), 0, levels)
    return (lo + codes * scale).astype(np.float32)


def oracle_int_groups(x, bits, group):
    groups = x.reshape(*x.shape[:-1], -1, group)
    return oracle_asymmetric(groups, -1, bits).reshape(x.shape)


def oracle_kivi_keys(k, bits, group):
    groups = k.reshape(-1, group, *k.shape[1:])
    return oracle_asymmetric(groups, 1, bits).reshape(k.shape)


def oracle_decode(codec, x):
    """Dequantized x [T, K, D] float32 per the codec's definition (float32 metadata only)."""
    x = np.asarray(x, np.float32)
    if isinstance(codec, codecs.IdentityCodec):
        return x.astype(codec.dtype).astype(np.float32)
    if isinstance(codec, codecs.Int8Codec):
        scale = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
        return np.clip(np.round(x / np.where(scale > 0, scale, 1)), -127, 127) * scale
    if isinstance(codec, codecs.IntCodec | codecs.KiviCodec):
        return oracle_int_groups(x, codec.bits, codec.group)
    if codec.scaling is codecs.Fp8Scaling.DYNAMIC:
        scale = np.abs(x).max(axis=-1, keepdims=True) / np.float32(codec.fmt.max_value)
    else:
        scale = np.asarray(codec.scale, np.float32)[:, None]
    scaled = np.clip(x / np.where(scale > 0, scale, 1), -codec.fmt.max_value,
                     codec.fmt.max_value)
    return scaled.astype(ML_FP8[codec.fmt]).astype(np.float32) * scale


def element_scale(codec, stored):
    """The stored quantization step of every element, broadcast to [T, K, D]."""
    scale = np.asarray(stored["scale"], np.float32)
    if isinstance(codec, codecs.Int8Codec):
        return np.repeat(scale[..., None], stored["codes"].shape[-1], axis=-1)
    return np.repeat(scale, codec.group, axis=-1)


def attention_reference(q, k, v):
    """Dense softmax attention in float64: q [T, N, D], k and v [S, K, D] -> [T, N, D]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [S, N, D]
    logits = np.einsum("tnd,snd->tns", q, k) / math.sqrt(q.shape[-1])
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("tns,snd->tnd", weights, v)


@settings(max_examples=15, deadline=None)
@given(bits=st.sampled_from([2, 4]), lead=st.lists(st.integers(1, 3), max_size=2),
       runs=st.integers(1, 4), data=st.data())
def test_pack_unpack_roundtrip_and_layout(bits, lead, runs, data):
    per_byte = 8 // bits
    shape = (*lead, runs * per_byte)
    values = data.draw(hnp.arrays(np.uint8, shape, elements=st.integers(0, 2**bits - 1)))
    packed = np.asarray(codecs.pack_codes(values, bits))
    shifts = (np.arange(per_byte) * bits).astype(np.uint8)
    expected = (values.reshape(*lead, runs, per_byte) << shifts).sum(axis=-1).astype(np.uint8)
    np.testing.assert_array_equal(packed, expected)
    np.testing.assert_array_equal(np.asarray(codecs.unpack_codes(packed, bits)), values)
    raw = data.draw(hnp.arrays(np.uint8, (*lead, runs)))
    np.testing.assert_array_equal(
            np.asarray(codecs.pack_codes(codecs.unpack_codes(raw, bits), bits)), raw)


def test_pack_rejects_bad_widths_and_bits():
    with pytest.raises(ValueError, match="multiple of 4"):
        codecs.pack_codes(jnp.zeros((2, 6), jnp.uint8), 2)
    with pytest.raises(ValueError, match="bits=3"):
        codecs.unpack_codes(jnp.zeros((2, 6), jnp.uint8), 3)


@pytest.mark.parametrize(
        "codec", [c for c in all_codecs() if getattr(c, "metadata_dtype", "float32") == "float32"],
        ids=lambda c: c.name)
def test_decode_matches_numpy_oracle(codec):
    """The oracle models float32 metadata; float16 metadata is checked by the error bounds."""
    x = gaussian((40, NUM_KV_HEADS, HEAD_DIM), seed=1) * 3
    np.testing.assert_allclose(roundtrip(codec, x), oracle_decode(codec, x), rtol=0,
                               atol=F32_SLACK * np.abs(x).max())


@pytest.mark.parametrize("codec", all_codecs(), ids=lambda c: c.name)
def test_encode_matches_storage_spec_and_bytes_per_token(codec):
    num_slots = 64
    spec = codec.storage_spec(num_slots, NUM_KV_HEADS, HEAD_DIM)
    stored = _encode(codec, gaussian((num_slots, NUM_KV_HEADS, HEAD_DIM)))
    assert {k: (v.shape, v.dtype) for k, v in stored.items()} == {
            k: (v.shape, v.dtype) for k, v in spec.items()}
    spec_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in spec.values())
    assert codec.bytes_per_token(NUM_KV_HEADS, HEAD_DIM) == spec_bytes / num_slots
    if isinstance(codec, codecs.KiviCodec):
        key_spec = codec.key_storage_spec(num_slots, NUM_KV_HEADS, HEAD_DIM)
        key_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in key_spec.values())
        assert codec.bytes_per_token(NUM_KV_HEADS, HEAD_DIM) == key_bytes / num_slots


def test_bytes_per_token_values():
    heads, dim = NUM_KV_HEADS, HEAD_DIM
    assert codecs.get_codec("none").bytes_per_token(heads, dim) == heads * dim * 4
    assert codecs.get_codec("int8").bytes_per_token(heads, dim) == heads * (dim + 4)
    # int8 g32: 64 code bytes + 2 groups * (scale + zero) * 4 bytes per head.
    assert codecs.get_codec("int8", group=32).bytes_per_token(heads, dim) == heads * (64 + 16)
    # int4 g32: 32 code bytes + 2 groups * (scale + zero) * 4 bytes per head.
    assert codecs.get_codec("int4").bytes_per_token(heads, dim) == heads * (32 + 16)
    assert codecs.get_codec("kivi2", metadata_dtype="float16").bytes_per_token(
            heads, dim) == heads * (16 + 8)


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["int8", "int8-grouped", "int4", "int2"]),
       metadata_dtype=st.sampled_from(["float32", "float16"]),
       tokens=st.integers(1, 3), group=st.sampled_from([4, 8, 16]), data=st.data())
def test_int_codecs_error_within_half_step(name, metadata_dtype, tokens, group, data):
    options = {} if name == "int8" else {"group": group}
    name = name.split("-")[0]
    codec = codecs.get_codec(name, metadata_dtype=metadata_dtype, **options)
    elements = st.floats(-1e3, 1e3, width=32, allow_subnormal=False)
    x = data.draw(hnp.arrays(np.float32, (tokens, 2, 16), elements=elements))
    stored = _encode(codec, x)
    x_hat = np.asarray(jax.jit(codec.decode)(stored))
    bound = element_scale(codec, stored) / 2 + F32_SLACK * (np.abs(x).max() + 1e-30)
    assert np.all(np.abs(x - x_hat) <= bound)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("metadata_dtype", ["float32", "float16"])
def test_kivi_keys_per_channel_error_within_half_step(bits, metadata_dtype):
    codec = codecs.get_codec(f"kivi{bits}", group=8, metadata_dtype=metadata_dtype)
    # Channels with very different ranges: per-channel scales keep the small ones accurate.
    k = gaussian((24, NUM_KV_HEADS, HEAD_DIM), seed=2) * np.geomspace(1e-2, 1e2, HEAD_DIM)
    k = k.astype(np.float32)
    stored = jax.jit(codec.encode_key_group)(k)
    k_hat = np.asarray(jax.jit(codec.decode_keys)(stored))
    scale = np.repeat(np.asarray(stored["scale"], np.float32), 8, axis=0)  # [S, K, D]
    assert np.all(np.abs(k - k_hat) <= scale / 2 + F32_SLACK * np.abs(k).max())
    if metadata_dtype == "float32":
        np.testing.assert_allclose(k_hat, oracle_kivi_keys(k, bits, 8), rtol=0,
                                   atol=F32_SLACK * np.abs(k).max())
        # Row g of the metadata holds group g's per-channel minimum as its zero point.
        np.testing.assert_array_equal(np.asarray(stored["zero"]), k.reshape(3, 8, 3, 64).min(1))


def test_kivi_encode_key_group_rejects_partial_groups():
    codec = codecs.get_codec("kivi2", group=8)
    with pytest.raises(ValueError, match="multiple of group=8"):
        codec.encode_key_group(jnp.zeros((12, 1, 8)))
    with pytest.raises(ValueError, match="num_slots=12"):
        codec.key_storage_spec(12, 1, 8)


@pytest.mark.parametrize("fmt", list(codecs.Fp8Format))
@pytest.mark.parametrize("scaling", list(codecs.Fp8Scaling))
def test_fp8_relative_error_bound(fmt, scaling):
    x = gaussian((32, NUM_KV_HEADS, HEAD_DIM), seed=3) * np.array([1e-3, 1.0, 1e3])[:, None]
    x = x.astype(np.float32)
    codec = codecs.Fp8Codec(fmt, scaling)
    if scaling is codecs.Fp8Scaling.CALIBRATED:
        codec = codec.calibrate(x)
        scale = np.asarray(codec.scale, np.float32)[:, None]
    else:
        scale = np.asarray(codec.encode(x)["scale"])[..., None]
    x_hat = roundtrip(codec, x)
    bound = (2.0**-(FP8_MANTISSA_BITS[fmt] + 1) * np.abs(x)
             + scale * 2.0**-(FP8_SUBNORMAL_EXPONENT[fmt] + 1))
    assert np.all(np.abs(x - x_hat) <= bound * (1 + F32_SLACK))


def test_fp8_calibration_per_head_and_saturation():
    keys, values = gaussian((50, 3, 16), seed=4), gaussian((50, 3, 16), seed=5) * 4
    key_codec = codecs.get_codec("fp8_e4m3").calibrate(keys)
    value_codec = codecs.get_codec("fp8_e4m3").calibrate(values)
    np.testing.assert_allclose(key_codec.scale, np.abs(keys).max(axis=(0, 2)) / 448.0,
                               rtol=F32_SLACK)
    assert key_codec.name != value_codec.name
    # Beyond the calibrated amax the codes saturate at +-amax instead of becoming NaN.
    amax = np.abs(keys).max(axis=(0, 2))
    far = np.broadcast_to((np.array([10.0, -10.0, 1e6]) * amax)[None, :, None], (1, 3, 16))
    np.testing.assert_allclose(roundtrip(key_codec, far.astype(np.float32)),
                               np.sign(far) * amax[None, :, None], rtol=F32_SLACK)


def test_fp8_uncalibrated_or_mismatched_raises():
    codec = codecs.get_codec("fp8_e5m2")
    assert codec.name == "fp8_e5m2-uncalibrated"
    with pytest.raises(ValueError, match="calibrate"):
        codec.encode(jnp.ones((2, 3, 16)))
    with pytest.raises(ValueError, match="calibrate"):
        codec.decode({"codes": jnp.ones((2, 3, 16), jnp.float8_e5m2)})
    with pytest.raises(ValueError, match="calibrated for 3 kv heads"):
        codec.calibrate(gaussian((4, 3, 16))).encode(jnp.ones((2, 2, 16)))
    with pytest.raises(ValueError, match="not all-zero"):
        codec.calibrate(np.zeros((4, 3, 16)))
    with pytest.raises(ValueError, match="positive finite"):
        codecs.get_codec("fp8_e4m3", scale=[1.0, 0.0])


@pytest.mark.parametrize("codec", all_codecs(), ids=lambda c: c.name)
def test_zero_and_constant_inputs(codec):
    zeros = np.zeros((4, NUM_KV_HEADS, HEAD_DIM), np.float32)
    np.testing.assert_array_equal(roundtrip(codec, zeros), zeros)
    # Representable in bfloat16 and float16, and inside the fp8 calibration range.
    constant = np.broadcast_to(np.array([-1.5, 0.125, 1.75], np.float32)[None, :, None],
                               zeros.shape)
    x_hat = roundtrip(codec, constant)
    if isinstance(codec, codecs.IntCodec | codecs.KiviCodec | codecs.IdentityCodec):
        np.testing.assert_array_equal(x_hat, constant)
    elif isinstance(codec, codecs.Int8Codec):
        # A float16 scale is rounded up, by less than one float16 ulp (2**-10 relative).
        rtol = F32_SLACK if codec.metadata_dtype == "float32" else 2.0**-10
        np.testing.assert_allclose(x_hat, constant, rtol=rtol)
    else:
        np.testing.assert_allclose(x_hat, constant, rtol=2.0**-(FP8_MANTISSA_BITS[codec.fmt] + 1))


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "kivi2"])
@pytest.mark.parametrize("magnitude", [1e-30, 1e30, 1e37])
def test_int_codecs_extreme_ranges(name, magnitude):
    codec = codecs.get_codec(name)
    x = (gaussian((4, NUM_KV_HEADS, HEAD_DIM), seed=6) * np.float32(magnitude)).astype(np.float32)
    x[0, 0, :3] = [magnitude, -magnitude, 0.0]
    stored = _encode(codec, x)
    x_hat = roundtrip(codec, x)
    assert np.all(np.isfinite(x_hat))
    bound = element_scale(codec, stored) / 2 + F32_SLACK * np.abs(x).max()
    assert np.all(np.abs(x - x_hat) <= bound)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("offset", [1e3, -3e4])
def test_float16_metadata_bound_holds_for_narrow_ranges_far_from_zero(name, offset):
    # float16 cannot hold the group minimum exactly here; the outward rounding keeps the codes
    # covering the whole range so the half-step bound still holds for the stored metadata.
    codec = codecs.get_codec(name, metadata_dtype="float16")
    x = (offset + gaussian((4, NUM_KV_HEADS, HEAD_DIM), seed=15) * 1e-2).astype(np.float32)
    stored = _encode(codec, x)
    bound = element_scale(codec, stored) / 2 + F32_SLACK * np.abs(x).max()
    assert np.all(np.abs(x - roundtrip(codec, x)) <= bound)


@pytest.mark.parametrize("codec", all_codecs(), ids=lambda c: c.name)
def test_bfloat16_inputs_encode_as_their_float32_values(codec):
    x = jnp.asarray(gaussian((8, NUM_KV_HEADS, HEAD_DIM), seed=7), jnp.bfloat16)
    from_bf16 = _encode(codec, x)
    from_f32 = _encode(codec, x.astype(jnp.float32))
    for key in from_f32:
        np.testing.assert_array_equal(np.asarray(from_bf16[key]).view(np.uint8),
                                      np.asarray(from_f32[key]).view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_none_is_bit_exact(dtype):
    codec = codecs.get_codec("none", dtype=dtype)
    x = jnp.asarray(gaussian((8, NUM_KV_HEADS, HEAD_DIM), seed=8) * 100, dtype)
    stored = codec.encode(x)
    np.testing.assert_array_equal(np.asarray(stored["values"]).view(np.uint8),
                                  np.asarray(x).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(codec.decode(stored)), np.asarray(x, np.float32))


def test_names_differ_per_codec_and_options():
    samples = gaussian((8, NUM_KV_HEADS, HEAD_DIM))
    variants = [*all_codecs(), codecs.get_codec("int4", group=16),
                codecs.get_codec("kivi2", group=16, residual=64),
                codecs.get_codec("kivi2", residual=32), codecs.get_codec("kivi2", group=16),
                calibrated(codecs.Fp8Format.E4M3, samples), codecs.get_codec("fp8_e4m3")]
    names = [c.name for c in variants]
    assert len(set(names)) == len(names)
    assert codecs.get_codec("int4").name == "int4-g32"
    assert codecs.get_codec("kivi2").name == "kivi2-g32-r128"
    assert codecs.get_codec("int2", metadata_dtype="float16").name == "int2-g32-fp16meta"
    assert calibrated(codecs.Fp8Format.E4M3, samples).name.startswith("fp8_e4m3-s")


def test_get_codec_validates_names_and_options():
    with pytest.raises(ValueError, match="'int3'"):
        codecs.get_codec("int3")
    with pytest.raises(ValueError, match="residual"):
        codecs.get_codec("int4", residual=4)
    with pytest.raises(ValueError, match="group must be a positive int"):
        codecs.get_codec("int4", group=0)
    with pytest.raises(ValueError, match="residual must be"):
        codecs.get_codec("kivi4", residual=-1)
    with pytest.raises(ValueError, match="bfloat16"):
        codecs.get_codec("int8", metadata_dtype="bfloat16")
    with pytest.raises(ValueError, match="'static'"):
        codecs.get_codec("fp8_e4m3", scaling="static")
    with pytest.raises(ValueError, match="head_dim=48"):
        codecs.get_codec("int4").storage_spec(4, 1, 48)
    assert isinstance(codecs.get_codec("kivi2"), codecs.KVCodec)


@pytest.mark.parametrize("codec", all_codecs(), ids=lambda c: c.name)
def test_attention_over_decoded_kv(codec):
    num_tokens, num_heads = 4, 2 * NUM_KV_HEADS
    q = gaussian((num_tokens, num_heads, HEAD_DIM), seed=10)
    k, v = gaussian((96, NUM_KV_HEADS, HEAD_DIM), seed=11), gaussian((96, NUM_KV_HEADS,
                                                                       HEAD_DIM), seed=12)

    @jax.jit
    def attend(q, k_stored, v_stored):
        k_hat = jnp.repeat(codec.decode(k_stored), 2, axis=1)  # [S, N, D]
        v_hat = jnp.repeat(codec.decode(v_stored), 2, axis=1)  # [S, N, D]
        logits = jnp.einsum("tnd,snd->tns", q, k_hat) / math.sqrt(HEAD_DIM)  # [T, N, S]
        return jnp.einsum("tns,snd->tnd", jax.nn.softmax(logits, axis=-1), v_hat)  # [T, N, D]

    out = np.asarray(attend(q, _encode(codec, k), _encode(codec, v)))
    k_hat, v_hat = roundtrip(codec, k), roundtrip(codec, v)
    np.testing.assert_allclose(out, attention_reference(q, k_hat, v_hat), atol=ATTENTION_ATOL)
    if getattr(codec, "metadata_dtype", "float32") == "float32":
        np.testing.assert_allclose(out, attention_reference(q, oracle_decode(codec, k),
                                                            oracle_decode(codec, v)),
                                   atol=ATTENTION_ATOL)
    if isinstance(codec, codecs.Int8Codec):
        exact = attention_reference(q, k, v)
        assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < INT8_ATTENTION_RTOL


def test_kivi_num_quantized():
    codec = codecs.get_codec("kivi2", group=4, residual=6)
    lengths = np.arange(20)
    expected = [0] * 10 + [4] * 4 + [8] * 4 + [12] * 2
    assert [codec.num_quantized(int(n)) for n in lengths] == expected
    np.testing.assert_array_equal(np.asarray(codec.num_quantized(jnp.asarray(lengths))),
                                  expected)


@pytest.mark.parametrize("bits,group,residual", [(2, 4, 6), (4, 8, 0), (2, 4, 8)])
def test_kivi_reference_matches_incremental_model(bits, group, residual):
    """Append tokens one at a time; quantize a group once it is older than the residual."""
    codec = codecs.get_codec(f"kivi{bits}", group=group, residual=residual)
    num_slots, heads, dim = 30, 2, 8
    k_seq, v_seq = gaussian((num_slots, heads, dim), seed=13), gaussian((num_slots, heads, dim),
                                                                        seed=14)
    reference = jax.jit(lambda n: codecs.kivi_roundtrip_reference(k_seq, v_seq, n, codec))
    k_read, v_read = np.zeros_like(k_seq), np.zeros_like(v_seq)
    num_aged = 0
    for length in range(num_slots + 1):
        if length:
            k_read[length - 1], v_read[length - 1] = k_seq[length - 1], v_seq[length - 1]
        while length - (num_aged + group) >= residual:
            aged = slice(num_aged, num_aged + group)
            k_read[aged] = oracle_kivi_keys(k_seq[aged], bits, group)
            v_read[aged] = oracle_int_groups(v_seq[aged], bits, group)
            num_aged += group
        assert num_aged == codec.num_quantized(length)
        assert length - num_aged >= min(length, residual)
        k_ref, v_ref = reference(jnp.int32(length))
        atol = F32_SLACK * max(np.abs(k_seq).max(), np.abs(v_seq).max())
        np.testing.assert_allclose(np.asarray(k_ref), k_read, rtol=0, atol=atol)
        np.testing.assert_allclose(np.asarray(v_ref), v_read, rtol=0, atol=atol)
