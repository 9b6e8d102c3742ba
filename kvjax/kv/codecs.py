"""Quantized KV codecs: the form in which one layer's keys or values are stored.

A codec turns the new tokens' keys or values, x: [T, K, D] (float32 or bfloat16), into a dict
of arrays whose leading axis is T (codes plus per-token metadata); the KV state scatters those
rows into its token slots with the slot mapping. Inside the reference attention the gathered
dict (leading axis S, any batch axes before it) goes back through `decode` to float32
[S, K, D]. Every array a codec stores is described by `storage_spec`, so the paged state can
allocate one buffer per key with the same leading slot axis and gather all of them with the
same block tables. Codecs are frozen, hashable dataclasses: pass them to `jax.jit` as static
configuration; all array methods are pure jnp with static shapes.

Keys and values. One codec describes one tensor (K or V) of one layer, and `bytes_per_token`
counts that one tensor. `none`, `int8`, `int4` and `int2` use the same codec for K and V.
`fp8_*` codecs in calibrated mode hold static scales per kv head (or per layer and kv head),
so keys and values get two instances calibrated separately (`calibrate(keys)`,
`calibrate(values)`, or `Engine.calibrate_kv` over a calibration set); their names differ by
the scale digest and both go into the provenance fingerprint. KIVI codecs treat K
and V differently (see `KiviCodec`); their per-token byte cost is the same for both.

Registered codecs (`get_codec(name, **options)`):

    registry    codes                      metadata per kv head             codec.name
    none        storage dtype [S, K, D]    none                             none-float32
    int8        int8 [S, K, D], symmetric  scale [S, K]                     int8
    int8 group= uint8 [S, K, D]            scale, zero [S, K, D // group]   int8-g32
    int4        uint8 [S, K, D // 2]       scale, zero [S, K, D // group]   int4-g32
    int2        uint8 [S, K, D // 4]       scale, zero [S, K, D // group]   int2-g32
    fp8_e4m3    float8_e4m3fn [S, K, D]    calibrated: static [K] or [L, K] fp8_e4m3-s<digest>
                                           dynamic: scale [S, K]            fp8_e4m3-dyn
    fp8_e5m2    float8_e5m2 [S, K, D]      as fp8_e4m3                      fp8_e5m2-...
    kivi4/2     see `KiviCodec`                                             kivi2-g32-r128
    lowrank     keys only: coordinates [S, K, r] float32 or int8 (+ scale)   lowrank-r16-b<digest>
                in a calibrated basis (`LowRankCodec`)

Metadata (scales and zero points) is float32 unless `metadata_dtype="float16"` is chosen,
which halves its cost, appends "-fp16meta" to the name, and limits inputs to the finite
float16 range (|x| < 65504): outside it the metadata overflows to inf and decoding yields
non-finite values. Float16 metadata is rounded outward (zero point down, scale up) before the
codes are computed, so the error bound below holds for the stored metadata.

Error bounds (elementwise, for finite inputs with |x| < 1e38):
    int8, int4, int2, kivi: |x - decode(encode(x))| <= scale / 2 + float32 rounding, with the
        stored scale of the element's group.
    fp8: |x - x_hat| <= 2**-(m + 1) * |x| + scale * 2**-(s + 1), m the mantissa bits (3 for
        e4m3, 2 for e5m2), 2**-s the subnormal spacing (2**-9 for e4m3, 2**-16 for e5m2), as
        long as |x| <= scale * fp8_max; larger values saturate to +-scale * fp8_max.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import resolve_dtype

_METADATA_DTYPES = ("float32", "float16")
_PACKED_BITS = (2, 4, 8)


@runtime_checkable
class KVCodec(Protocol):
    """How one tensor (K or V) of one layer is stored per token slot."""

    @property
    def name(self) -> str:
        """A string naming the codec and all its options; part of the KV provenance."""
        ...

    def storage_spec(
            self, num_slots: int, num_kv_heads: int, head_dim: int
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """The arrays (each with leading axis S = num_slots) one layer's storage needs."""
        ...

    def encode(self, x: jax.Array) -> dict[str, jax.Array]:
        """[..., T, K, D] -> the `storage_spec` keys, each with leading axes [..., T]."""
        ...

    def decode(self, stored: dict[str, jax.Array]) -> jax.Array:
        """The `storage_spec` keys with leading axes [..., S] -> [..., S, K, D] float32."""
        ...

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        """Bytes of codes and metadata one token of one tensor (K or V) takes in one layer."""
        ...


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """Packs unsigned `bits`-bit codes along the last axis, 8 // bits codes per byte.

    Code j of each run of 8 // bits codes occupies bits [j * bits, (j + 1) * bits) of its
    byte, so the first code sits in the lowest bits. Bits above `bits` are dropped.

    Args:
        codes: [..., D] integer codes in [0, 2**bits); D divisible by 8 // bits.
        bits: 2 or 4.

    Returns:
        [..., D * bits // 8] uint8.
    """
    per_byte = _codes_per_byte(bits)
    if codes.shape[-1] % per_byte:
        raise ValueError(
                f"last axis {codes.shape[-1]} is not a multiple of {per_byte} ({bits}-bit codes)")
    runs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], -1, per_byte)  # [..., D/c, c]
    runs = runs & jnp.uint8(2**bits - 1)
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(bits)
    # The shifted fields do not overlap, so their sum is their bitwise or.
    return jnp.sum(runs << shifts, axis=-1, dtype=jnp.uint8)  # [..., D/c]


def unpack_codes(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack_codes`: [..., D * bits // 8] uint8 -> [..., D] uint8 in [0, 2**bits)."""
    per_byte = _codes_per_byte(bits)
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(bits)
    fields = (packed[..., None] >> shifts) & jnp.uint8(2**bits - 1)  # [..., D/c, c]
    return fields.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)  # [..., D]


def _codes_per_byte(bits: int) -> int:
    if bits not in _PACKED_BITS:
        raise ValueError(f"bits={bits!r} cannot be packed; expected one of {_PACKED_BITS}")
    return 8 // bits


def _check_metadata_dtype(metadata_dtype: str) -> None:
    if metadata_dtype not in _METADATA_DTYPES:
        raise ValueError(
                f"metadata_dtype={metadata_dtype!r}; expected one of {_METADATA_DTYPES}")


def _metadata_suffix(metadata_dtype: str) -> str:
    return "" if metadata_dtype == "float32" else "-fp16meta"


def _check_positive_int(field: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{field} must be a positive int, got {value!r}")


def _check_input(x: jax.Array, head_dim_multiple: int, what: str) -> None:
    if x.ndim < 3:
        raise ValueError(f"{what} expects [..., T, K, D], got shape {x.shape}")
    if x.shape[-1] % head_dim_multiple:
        raise ValueError(
                f"head_dim {x.shape[-1]} is not a multiple of {head_dim_multiple} ({what})")


def _round_outward(value: jax.Array, dtype: str, up: bool) -> jax.Array:
    """Rounds float32 `value` to `dtype`, toward +inf if `up` else toward -inf."""
    if dtype == "float32":
        return value
    rounded = value.astype(dtype)
    wrong_side = rounded.astype(jnp.float32) < value if up else rounded.astype(jnp.float32) > value
    direction = jnp.array(jnp.inf if up else -jnp.inf, dtype)
    return jnp.where(wrong_side, jnp.nextafter(rounded, direction), rounded)


def _asymmetric_encode(
        x: jax.Array, axis: int, bits: int, metadata_dtype: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Min/max quantization of float32 `x` over `axis` (kept with size 1 in scale and zero).

    Returns unpacked uint8 codes in [0, 2**bits) shaped like x, and scale, zero in
    `metadata_dtype` with x_hat = zero + codes * scale.
    """
    levels = 2**bits - 1
    zero = _round_outward(jnp.min(x, axis=axis, keepdims=True), metadata_dtype, up=False)
    zero32 = zero.astype(jnp.float32)
    # hi / levels - zero / levels instead of (hi - zero) / levels keeps wide ranges finite.
    spread = jnp.max(x, axis=axis, keepdims=True) / levels - zero32 / levels
    scale = _round_outward(spread, metadata_dtype, up=True)
    scale32 = scale.astype(jnp.float32)
    divisor = jnp.where(scale32 > 0, scale32, 1.0)
    codes = jnp.clip(jnp.round((x - zero32) / divisor), 0, levels).astype(jnp.uint8)
    return codes, scale, zero


@dataclasses.dataclass(frozen=True)
class IdentityCodec:
    """Stores K or V unchanged in `dtype` ("float32", "bfloat16" or "float16").

    Attributes:
        dtype: the storage dtype; bit-exact for inputs already in it.
    """

    dtype: str = "float32"

    def __post_init__(self):
        resolve_dtype(self.dtype)

    @property
    def name(self) -> str:
        return f"none-{self.dtype}"

    def storage_spec(
            self, num_slots: int, num_kv_heads: int, head_dim: int
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """{"values": dtype [S, K, D]}."""
        shape = (num_slots, num_kv_heads, head_dim)
        return {"values": jax.ShapeDtypeStruct(shape, resolve_dtype(self.dtype))}

    def encode(self, x: jax.Array) -> dict[str, jax.Array]:
        """[..., T, K, D] -> {"values": [..., T, K, D] in dtype}."""
        _check_input(x, 1, self.name)
        return {"values": x.astype(self.dtype)}

    def decode(self, stored: dict[str, jax.Array]) -> jax.Array:
        """{"values": [..., S, K, D]} -> [..., S, K, D] float32."""
        return stored["values"].astype(jnp.float32)

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        return float(num_kv_heads * head_dim * resolve_dtype(self.dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class Int8Codec:
    """Symmetric int8 codes, one scale per token per kv head: x_hat = codes * scale.

    scale = max|x| / 127 over the head dim, so codes lie in [-127, 127].

    Attributes:
        metadata_dtype: dtype of the stored scale, "float32" or "float16".
    """

    metadata_dtype: str = "float32"

    def __post_init__(self):
        _check_metadata_dtype(self.metadata_dtype)

    @property
    def name(self) -> str:
        return "int8" + _metadata_suffix(self.metadata_dtype)

    def storage_spec(
            self, num_slots: int, num_kv_heads: int, head_dim: int
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """{"codes": int8 [S, K, D], "scale": metadata_dtype [S, K]}."""
        return {
                "codes": jax.ShapeDtypeStruct((num_slots, num_kv_heads, head_dim), jnp.int8),
                "scale": jax.ShapeDtypeStruct((num_slots, num_kv_heads),
                                              jnp.dtype(self.metadata_dtype)),
        }

    def encode(self, x: jax.Array) -> dict[str, jax.Array]:
        """[..., T, K, D] -> {"codes": [..., T, K, D], "scale": [..., T, K]}."""
        _check_input(x, 1, self.name)
        x = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)  # [..., T, K, 1]
        scale = _round_outward(amax / 127.0, self.metadata_dtype, up=True)
        scale32 = scale.astype(jnp.float32)
        divisor = jnp.where(scale32 > 0, scale32, 1.0)
        codes = jnp.clip(jnp.round(x / divisor), -127, 127).astype(jnp.int8)  # [..., T, K, D]
        return {"codes": codes, "scale": scale[..., 0]}

    def decode(self, stored: dict[str, jax.Array]) -> jax.Array:
        """{"codes": [..., S, K, D], "scale": [..., S, K]} -> [..., S, K, D] float32."""
        scale = stored["scale"].astype(jnp.float32)[..., None]  # [..., S, K, 1]
        return stored["codes"].astype(jnp.float32) * scale

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        return float(num_kv_heads * (head_dim + jnp.dtype(self.metadata_dtype).itemsize))


@dataclasses.dataclass(frozen=True)
class IntCodec:
    """Asymmetric `bits`-bit codes, packed, with a scale and zero per `group` channels.

    For each token, kv head and run of `group` consecutive head-dim channels:
    scale = (max - min) / (2**bits - 1), zero = min, codes = round((x - zero) / scale) and
    x_hat = zero + codes * scale. Codes are packed along the head dim with `pack_codes`.

    Attributes:
        bits: 8 (one code per byte: `get_codec("int8", group=g)`), 4 (two per byte) or 2
            (four per byte).
        group: channels sharing one scale and zero; must divide D.
        metadata_dtype: dtype of scale and zero, "float32" or "float16".
    """

    bits: int
    group: int = 32
    metadata_dtype: str = "float32"

    def __post_init__(self):
        if self.bits not in _PACKED_BITS:
            raise ValueError(f"bits={self.bits!r}; expected one of {_PACKED_BITS}")
        _check_positive_int("group", self.group)
        _check_metadata_dtype(self.metadata_dtype)

    @property
    def name(self) -> str:
        return f"int{self.bits}-g{self.group}" + _metadata_suffix(self.metadata_dtype)

    def _check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.group or head_dim % _codes_per_byte(self.bits):
            raise ValueError(f"head_dim={head_dim} is not a multiple of group={self.group} and "
                             f"of {_codes_per_byte(self.bits)} ({self.bits}-bit codes per byte)")

    def storage_spec(
            self, num_slots: int, num_kv_heads: int, head_dim: int
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """{"codes": uint8 [S, K, D * bits / 8], "scale", "zero": [S, K, D / group]}."""
        self._check_head_dim(head_dim)
        meta = jax.ShapeDtypeStruct((num_slots, num_kv_heads, head_dim // self.group),
                                    jnp.dtype(self.metadata_dtype))
        codes_shape = (num_slots, num_kv_heads, head_dim * self.bits // 8)
        return {"codes": jax.ShapeDtypeStruct(codes_shape, jnp.uint8), "scale": meta, "zero": meta}

    def encode(self, x: jax.Array) -> dict[str, jax.Array]:
        """[..., T, K, D] -> {"codes": [..., T, K, D*bits/8], "scale", "zero": [..., T, K, D/g]}."""
        _check_input(x, 1, self.name)
        self._check_head_dim(x.shape[-1])
        groups = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, self.group)  # [..., K, D/g, g]
        codes, scale, zero = _asymmetric_encode(groups, -1, self.bits, self.metadata_dtype)
        codes = pack_codes(codes.reshape(x.shape), self.bits)  # [..., T, K, D*bits/8]
        return {"codes": codes, "scale": scale[..., 0], "zero": zero[..., 0]}

    def decode(self, stored: dict[str, jax.Array]) -> jax.Array:
        """The `encode` dict with leading axes [..., S] -> [..., S, K, D] float32."""
        codes = unpack_codes(stored["codes"], self.bits)  # [..., S, K, D]
        head_dim = codes.shape[-1]
        if stored["scale"].shape[-1] * self.group != head_dim:
            raise ValueError(f"scale has {stored['scale'].shape[-1]} groups of {self.group}, "
                             f"codes have head_dim {head_dim}")
        groups = codes.reshape(*codes.shape[:-1], -1, self.group)  # [..., S, K, D/g, g]
        scale = stored["scale"].astype(jnp.float32)[..., None]  # [..., S, K, D/g, 1]
        zero = stored["zero"].astype(jnp.float32)[..., None]
        return (zero + groups.astype(jnp.float32) * scale).reshape(codes.shape)  # [..., S, K, D]

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        self._check_head_dim(head_dim)
        metadata = 2 * (head_dim // self.group) * jnp.dtype(self.metadata_dtype).itemsize
        return float(num_kv_heads * (head_dim * self.bits // 8 + metadata))


class Fp8Format(enum.Enum):
    """The two OCP float8 formats."""

    E4M3 = "e4m3"  # jnp.float8_e4m3fn: 3 mantissa bits, max 448, no inf.
    E5M2 = "e5m2"  # jnp.float8_e5m2: 2 mantissa bits, max 57344.

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(jnp.float8_e4m3fn if self is Fp8Format.E4M3 else jnp.float8_e5m2)

    @property
    def max_value(self) -> float:
        return float(jnp.finfo(self.dtype).max)


class Fp8Scaling(enum.Enum):
    """Where an fp8 codec's scale comes from."""

    # One static scale per kv head, amax / fp8_max over calibration samples (`calibrate`).
    # Encoding with a codec that has not been calibrated raises ValueError.
    CALIBRATED = "calibrated"
    # One scale per token per kv head, amax / fp8_max of that token, stored beside the codes.
    DYNAMIC = "dynamic"


@dataclasses.dataclass(frozen=True)
class Fp8Codec:
    """float8 codes with a scale per kv head: x_hat = codes * scale.

    Two modes (`Fp8Scaling`). DYNAMIC stores a float32 scale per token and kv head beside the
    codes (amax / fp8_max of that token): no calibration, 4 bytes per head per token more.
    CALIBRATED stores codes only and decodes with static scales, per kv head ([K]) or per
    layer and kv head ([L, K], then `encode` and `decode` take the layer). The static scales
    come from calibration data, never from a default: a codec without them refuses to encode
    (a scale of 1.0 by default is a known source of garbage output). kvjax calibrates from a
    calibration set, not from each prompt, so every sequence shares one codec and one
    provenance: `calibrate(samples)` for one tensor here, and in the engine
    `Engine.calibrate_kv(prompts)`, which runs the model over calibration texts
    (`kvjax.kv.calibration.fp8_kv_scales`) and sets scale = margin * amax / fp8_max per layer
    and kv head, separately for K and V, with a margin (default 2: one binade of headroom for
    values beyond the calibration set's, which otherwise saturate; float8's relative precision
    does not depend on the scale, so the margin only costs subnormal range).

    Attributes:
        fmt: the float8 format.
        scaling: calibrated (static per-head scale) or dynamic (per-token per-head scale).
        scale: a calibrated codec's static scales, [K] or [L, K] nested tuples; None until
            calibrated.
    """

    fmt: Fp8Format
    scaling: Fp8Scaling = Fp8Scaling.CALIBRATED
    scale: tuple[float, ...] | tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "fmt", Fp8Format(self.fmt))
        object.__setattr__(self, "scaling", Fp8Scaling(self.scaling))
        if self.scale is None:
            return
        if self.scaling is Fp8Scaling.DYNAMIC:
            raise ValueError(f"scale={self.scale!r} given to a dynamic-scaling fp8 codec")
        scale = np.asarray(self.scale, np.float32)
        if (scale.ndim not in (1, 2) or not scale.size
                or not np.all(np.isfinite(scale) & (scale > 0))):
            raise ValueError(f"scale must be a non-empty [K] or [L, K] sequence of positive "
                             f"finite floats, got {self.scale!r}")
        object.__setattr__(self, "scale", tuple(float(s) for s in scale) if scale.ndim == 1
                           else tuple(tuple(float(s) for s in row) for row in scale))

    @property
    def name(self) -> str:
        prefix = f"fp8_{self.fmt.value}"
        if self.scaling is Fp8Scaling.DYNAMIC:
            return prefix + "-dyn"
        if self.scale is None:
            return prefix + "-uncalibrated"
        digest = hashlib.sha256(np.asarray(self.scale, np.float32).tobytes()).hexdigest()
        return f"{prefix}-s{digest[:12]}"

    def calibrate(self, samples: jax.Array | np.ndarray) -> Fp8Codec:
        """A calibrated copy with per-head scale = amax / fp8_max over `samples`.

        Args:
            samples: [..., K, D] keys or values (calibrate K and V separately); host-side, not
                traced.

        Returns:
            An `Fp8Codec` with scaling CALIBRATED and `scale` of length K.
        """
        samples = np.asarray(samples, np.float32)
        if samples.ndim < 2:
            raise ValueError(f"calibrate expects [..., K, D] samples, got shape {samples.shape}")
        heads = np.moveaxis(samples, -2, 0).reshape(samples.shape[-2], -1)  # [K, T*D]
        amax = np.max(np.abs(heads), axis=-1)  # [K]
        if not np.all(np.isfinite(amax)) or np.any(amax == 0):
            raise ValueError(f"calibration samples give per-head amax {amax.tolist()}; each head "
                             f"needs finite, not all-zero samples")
        return dataclasses.replace(self, scaling=Fp8Scaling.CALIBRATED,
                                   scale=tuple((amax / self.fmt.max_value).tolist()))

    def _static_scale(self, num_kv_heads: int, layer: jax.Array | None) -> jax.Array:
        if self.scale is None:
            raise ValueError(f"{self.name} codec has no scale: call calibrate(samples) first "
                             f"(Engine.calibrate_kv in an engine), or choose scaling='dynamic'")
        scale = jnp.asarray(self.scale, jnp.float32)  # [K] or [L, K]
        if scale.ndim == 2:
            if layer is None:
                raise ValueError(f"{self.name} has per-layer scales: pass layer=")
            scale = scale[layer]
        if scale.shape[0] != num_kv_heads:
            raise ValueError(f"{self.name} was calibrated for {scale.shape[0]} kv heads, "
                             f"got {num_kv_heads}")
        return scale[:, None]  # [K, 1]

    def storage_spec(
            self, num_slots: int, num_kv_heads: int, head_dim: int
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """{"codes": fp8 [S, K, D]} plus, in dynamic mode, {"scale": float32 [S, K]}."""
        spec = {"codes": jax.ShapeDtypeStruct((num_slots, num_kv_heads, head_dim),
                                              self.fmt.dtype)}
        if self.scaling is Fp8Scaling.DYNAMIC:
            spec["scale"] = jax.ShapeDtypeStruct((num_slots, num_kv_heads), jnp.float32)
        return spec

    def encode(self, x: jax.Array, *, layer: jax.Array | None = None) -> dict[str, jax.Array]:
        """[..., T, K, D] -> {"codes": [..., T, K, D]} (+ {"scale": [..., T, K]} if dynamic).

        `layer` picks the row of [L, K] calibrated scales (ignored otherwise).
        """
        _check_input(x, 1, self.name)
        x = x.astype(jnp.float32)
        if self.scaling is Fp8Scaling.DYNAMIC:
            scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / self.fmt.max_value
        else:
            scale = self._static_scale(x.shape[-2], layer)  # [K, 1]
        divisor = jnp.where(scale > 0, scale, 1.0)
        # float8_e4m3fn has no inf: out-of-range values would become NaN, so saturate first.
        scaled = jnp.clip(x / divisor, -self.fmt.max_value, self.fmt.max_value)
        stored = {"codes": scaled.astype(self.fmt.dtype)}  # [..., T, K, D]
        if self.scaling is Fp8Scaling.DYNAMIC:
            stored["scale"] = scale[..., 0]  # [..., T, K]
        return stored

    def decode(self, stored: dict[str, jax.Array], *, layer: jax.Array | None = None
               ) -> jax.Array:
        """The `encode` dict with leading axes [..., S] -> [..., S, K, D] float32."""
        codes = stored["codes"].astype(jnp.float32)
        if self.scaling is Fp8Scaling.DYNAMIC:
            return codes * stored["scale"][..., None]  # [..., S, K, D]
        return codes * self._static_scale(codes.shape[-2], layer)  # [..., S, K, D]

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        dynamic = self.scaling is Fp8Scaling.DYNAMIC
        return float(num_kv_heads * (head_dim + (4 if dynamic else 0)))


@dataclasses.dataclass(frozen=True)
class KiviCodec:
    """KIVI: keys per channel over groups of tokens, values per token, exact recent tokens.

    Values: the `KVCodec` methods (`storage_spec`, `encode`, `decode`) are the value path,
    identical to `IntCodec(bits, group)`: per token and kv head, a scale and zero per `group`
    head-dim channels, codes packed along D.

    Keys: `key_storage_spec`, `encode_key_group`, `decode_keys`. Each run of `group`
    consecutive tokens of a sequence (tokens [g * group, (g + 1) * group)) has one scale and
    zero per (kv head, channel), from the min and max over those tokens. Codes are per slot,
    uint8 [S, K, D * bits / 8]; scale and zero are per group, [S // group, K, D], row g for
    token group g. A paged state keeps page_size a multiple of `group` so no group straddles
    a page and stores page p's metadata rows at [p * P // group, (p + 1) * P // group); the
    same block tables then index codes and metadata.

    Residual window: at sequence length `length`, tokens [0, num_quantized(length)) are read
    quantized and tokens [num_quantized(length), length) exactly, where
    num_quantized(length) = max(length - residual, 0) // group * group. So a token group is
    quantized once all its tokens are older than the `residual` most recent tokens, and the
    exact part holds between min(length, residual) and residual + group - 1 tokens. The KV
    state keeps those tokens (both K and V) in full precision, e.g. a per-sequence buffer of
    `residual + group - 1` tokens in the compute dtype, and whenever num_quantized grows it
    encodes the newly aged group(s): keys with `encode_key_group`, values with `encode`.
    `kivi_roundtrip_reference` gives the K and V a sequence must read back at each length.

    `bytes_per_token` counts quantized tokens only (codes plus metadata amortized over the
    group; it is the same for K and V); the exact window costs its tokens at the compute
    dtype on top.

    Attributes:
        bits: 2 or 4.
        group: tokens per key group, and channels per value group (must divide D).
        residual: R, the number of most recent tokens always kept exact (>= 0).
        metadata_dtype: dtype of scales and zeros, "float32" or "float16".
    """

    bits: int
    group: int = 32
    residual: int = 128
    metadata_dtype: str = "float32"

    def __post_init__(self):
        residual = self.residual
        if not isinstance(residual, int) or isinstance(residual, bool) or residual < 0:
            raise ValueError(f"residual must be a non-negative int, got {self.residual!r}")
        IntCodec(self.bits, self.group, self.metadata_dtype)  # Validates the shared options.

    @property
    def name(self) -> str:
        return (f"kivi{self.bits}-g{self.group}-r{self.residual}"
                + _metadata_suffix(self.metadata_dtype))

    @property
    def _values(self) -> IntCodec:
        return IntCodec(self.bits, self.group, self.metadata_dtype)

    def num_quantized(self, length: int | jax.Array) -> int | jax.Array:
        """How many leading tokens of a sequence of `length` tokens are read quantized."""
        if isinstance(length, int):
            return max(length - self.residual, 0) // self.group * self.group
        return jnp.maximum(length - self.residual, 0) // self.group * self.group

    def storage_spec(
            self, num_slots: int, num_kv_heads: int, head_dim: int
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """Value storage: as `IntCodec.storage_spec`."""
        return self._values.storage_spec(num_slots, num_kv_heads, head_dim)

    def encode(self, x: jax.Array) -> dict[str, jax.Array]:
        """Values [..., T, K, D] -> per-token codes and metadata, as `IntCodec.encode`."""
        return self._values.encode(x)

    def decode(self, stored: dict[str, jax.Array]) -> jax.Array:
        """Value storage with leading axes [..., S] -> [..., S, K, D] float32."""
        return self._values.decode(stored)

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        """Bytes per quantized token of values, and equally of keys (2 * D / group metadata)."""
        return self._values.bytes_per_token(num_kv_heads, head_dim)

    def key_storage_spec(
            self, num_slots: int, num_kv_heads: int, head_dim: int
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """{"codes": uint8 [S, K, D * bits / 8], "scale", "zero": [S // group, K, D]}."""
        if num_slots % self.group:
            raise ValueError(f"num_slots={num_slots} is not a multiple of group={self.group}")
        self._values.storage_spec(num_slots, num_kv_heads, head_dim)
        meta = jax.ShapeDtypeStruct((num_slots // self.group, num_kv_heads, head_dim),
                                    jnp.dtype(self.metadata_dtype))
        codes_shape = (num_slots, num_kv_heads, head_dim * self.bits // 8)
        return {"codes": jax.ShapeDtypeStruct(codes_shape, jnp.uint8), "scale": meta, "zero": meta}

    def encode_key_group(self, k: jax.Array) -> dict[str, jax.Array]:
        """Quantizes whole key groups per channel.

        Args:
            k: [..., T, K, D] keys of consecutive tokens starting at a group boundary; T a
                positive multiple of `group` (T == group for one group aging out).

        Returns:
            {"codes": uint8 [..., T, K, D * bits / 8],
             "scale", "zero": [..., T // group, K, D] (one row per group)}.
        """
        _check_input(k, 8 // self.bits, self.name + " keys")
        num_tokens = k.shape[-3]
        if num_tokens == 0 or num_tokens % self.group:
            raise ValueError(f"encode_key_group needs a positive multiple of group={self.group} "
                             f"tokens, got {num_tokens}")
        groups = k.astype(jnp.float32).reshape(
                *k.shape[:-3], num_tokens // self.group, self.group, *k.shape[-2:])
        # groups: [..., T/g, g, K, D]; min and max run over the g tokens of each channel.
        codes, scale, zero = _asymmetric_encode(groups, -3, self.bits, self.metadata_dtype)
        codes = pack_codes(codes.reshape(k.shape), self.bits)  # [..., T, K, D*bits/8]
        return {"codes": codes, "scale": scale[..., 0, :, :], "zero": zero[..., 0, :, :]}

    def decode_key_tokens(self, codes: jax.Array, scale: jax.Array, zero: jax.Array
                          ) -> jax.Array:
        """Keys of single tokens: codes [..., K, D * bits / 8], each with its group's scale and
        zero [..., K, D] -> [..., K, D] float32 (what `decode_keys` gives those tokens)."""
        values = unpack_codes(codes, self.bits).astype(jnp.float32)  # [..., K, D]
        return zero.astype(jnp.float32) + values * scale.astype(jnp.float32)

    def decode_keys(self, stored: dict[str, jax.Array]) -> jax.Array:
        """Key storage ([..., S, ...] codes, [..., S // group, K, D] metadata) -> [..., S, K, D]."""
        codes = unpack_codes(stored["codes"], self.bits)  # [..., S, K, D]
        num_slots = codes.shape[-3]
        if stored["scale"].shape[-3] * self.group != num_slots:
            raise ValueError(f"{stored['scale'].shape[-3]} key groups of {self.group} do not "
                             f"cover {num_slots} slots")
        groups = codes.reshape(*codes.shape[:-3], -1, self.group, *codes.shape[-2:])
        scale = stored["scale"].astype(jnp.float32)[..., None, :, :]  # [..., S/g, 1, K, D]
        zero = stored["zero"].astype(jnp.float32)[..., None, :, :]
        return (zero + groups.astype(jnp.float32) * scale).reshape(codes.shape)  # [..., S, K, D]


def kivi_roundtrip_reference(
        k_seq: jax.Array, v_seq: jax.Array, length: int | jax.Array, codec: KiviCodec
) -> tuple[jax.Array, jax.Array]:
    """The keys and values one sequence reads back at `length` under a KIVI codec.

    Args:
        k_seq: [S, K, D] the sequence's exact keys (tokens at and after `length` are ignored).
        v_seq: [S, K, D] its exact values.
        length: tokens written so far, 0 <= length <= S (int or int32 scalar).
        codec: the KIVI codec.

    Returns:
        (k, v), each [S, K, D] float32: quantized-then-decoded for tokens before
        codec.num_quantized(length), exact for the rest of the first `length` tokens, zero
        after them.
    """
    if k_seq.shape != v_seq.shape or k_seq.ndim != 3:
        raise ValueError(f"k_seq {k_seq.shape} and v_seq {v_seq.shape} must both be [S, K, D]")
    num_slots = k_seq.shape[0]
    padded = -(-num_slots // codec.group) * codec.group
    # Padding tokens fill only groups past `length`, which are never read quantized.
    k_padded = jnp.pad(k_seq.astype(jnp.float32), ((0, padded - num_slots), (0, 0), (0, 0)))
    k_hat = codec.decode_keys(codec.encode_key_group(k_padded))[:num_slots]  # [S, K, D]
    v_hat = codec.decode(codec.encode(v_seq))  # [S, K, D]
    positions = jnp.arange(num_slots)[:, None, None]  # [S, 1, 1]
    is_quantized = positions < codec.num_quantized(length)
    is_live = positions < length

    def read(exact: jax.Array, dequantized: jax.Array) -> jax.Array:
        return jnp.where(is_live, jnp.where(is_quantized, dequantized, exact), 0.0)

    return read(k_seq.astype(jnp.float32), k_hat), read(v_seq.astype(jnp.float32), v_hat)


class LowRankCalibration(enum.Enum):
    """Where a low-rank codec's bases come from."""

    # The engine calibrates at start from its built-in sample prompts (cached per model).
    EMBEDDED = "embedded"
    # The pool waits for `Engine.calibrate_kv(prompts)`; writing before it raises ValueError.
    MANUAL = "manual"


_LOWRANK_QUANTIZE = ("none", "int8")


@dataclasses.dataclass(frozen=True)
class LowRankCodec:
    """Keys as their coordinates in a calibrated rank-r basis per layer and kv head.

    A key k [D] of kv head h in layer l is stored as k U [r], U = basis[l, h] [D, r] with
    orthonormal columns (the top-r eigenvectors of the keys' second moment over calibration
    prompts, `kvjax.kv.calibration.key_bases`), so its bytes per token scale with r, not D.
    Attention reads that form: a score is (q U) . (k U), the query projected once per step
    instead of every key rebuilt (`kvjax.kv.lowrank`). The keys are the post-RoPE ones the
    cache holds, because RoPE turns each key by its position and a fixed projection taken
    before it would not give the scores without rebuilding every key. `quantize='int8'`
    stores the r coordinates as symmetric int8 with a scale per token and kv head
    (`Int8Codec` over r channels). Values are stored exactly by the state, not by this codec.

    The bases are arrays of the state, not of the codec; `digest` names them (it is part of
    `name`, and so of the KV provenance) and is None until they are calibrated.

    Attributes:
        rank: r, 1 <= r <= D.
        quantize: 'none' (float32 coordinates) or 'int8'.
        calibration: where the bases come from (`LowRankCalibration`).
        digest: a short hash of the calibrated bases, or None before calibration.
    """

    rank: int
    quantize: str = "none"
    calibration: LowRankCalibration = LowRankCalibration.EMBEDDED
    digest: str | None = None

    def __post_init__(self):
        _check_positive_int("rank", self.rank)
        if self.quantize not in _LOWRANK_QUANTIZE:
            raise ValueError(f"quantize={self.quantize!r}; expected one of {_LOWRANK_QUANTIZE}")
        object.__setattr__(self, "calibration", LowRankCalibration(self.calibration))

    @property
    def name(self) -> str:
        quantized = "" if self.quantize == "none" else f"-{self.quantize}"
        return f"lowrank-r{self.rank}{quantized}-b{self.digest or 'uncalibrated'}"

    @property
    def coordinates(self) -> KVCodec:
        """The codec of the r coordinates."""
        return IdentityCodec("float32") if self.quantize == "none" else Int8Codec()

    def check_head_dim(self, head_dim: int) -> None:
        if self.rank > head_dim:
            raise ValueError(f"rank={self.rank} exceeds head_dim={head_dim}")

    def storage_spec(
            self, num_slots: int, num_kv_heads: int, head_dim: int
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """The coordinates' storage: `coordinates.storage_spec` at width r ([S, K, r], ...)."""
        self.check_head_dim(head_dim)
        return self.coordinates.storage_spec(num_slots, num_kv_heads, self.rank)

    def encode(self, x: jax.Array, *, basis: jax.Array) -> dict[str, jax.Array]:
        """Keys [..., T, K, D] and basis [D, r, K] -> the coordinates' storage, [..., T, ...]."""
        _check_input(x, 1, self.name)
        projected = jnp.einsum("...kd,drk->...kr", x.astype(jnp.float32), basis)  # [..., T, K, r]
        return self.coordinates.encode(projected)

    def decode_coordinates(self, stored: dict[str, jax.Array]) -> jax.Array:
        """The stored coordinates [..., S, ...] -> [..., S, K, r] float32: what attention reads."""
        return self.coordinates.decode(stored)

    def decode(self, stored: dict[str, jax.Array], *, basis: jax.Array) -> jax.Array:
        """The keys the coordinates stand for, [..., S, K, D] float32 (k U U^T; for tests and
        for measuring the projection's error, not for attention)."""
        return jnp.einsum("...kr,drk->...kd", self.decode_coordinates(stored), basis)

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        """Bytes of one token's keys in one layer: r coordinates (and a scale) per kv head."""
        self.check_head_dim(head_dim)
        return self.coordinates.bytes_per_token(num_kv_heads, self.rank)


def _none(*, dtype: str = "float32") -> KVCodec:
    return IdentityCodec(dtype)


def _int8(*, metadata_dtype: str = "float32", group: int | None = None) -> KVCodec:
    if group is None:
        return Int8Codec(metadata_dtype)
    return IntCodec(8, group, metadata_dtype)


def _int_factory(bits: int) -> Callable[..., KVCodec]:
    def build(*, group: int = 32, metadata_dtype: str = "float32") -> KVCodec:
        return IntCodec(bits, group, metadata_dtype)
    return build


def _fp8_factory(fmt: Fp8Format) -> Callable[..., KVCodec]:
    def build(*, scaling: str | Fp8Scaling = Fp8Scaling.CALIBRATED,
              scale: Sequence[float] | None = None) -> KVCodec:
        return Fp8Codec(fmt, Fp8Scaling(scaling), None if scale is None else tuple(scale))
    return build


def _kivi_factory(bits: int) -> Callable[..., KVCodec]:
    def build(*, group: int = 32, residual: int = 128,
              metadata_dtype: str = "float32") -> KVCodec:
        return KiviCodec(bits, group, residual, metadata_dtype)
    return build


def _lowrank(*, rank: int | None = None, quantize: str = "none",
             calibration: str | LowRankCalibration = LowRankCalibration.EMBEDDED) -> KVCodec:
    if rank is None:
        raise ValueError("codec 'lowrank' needs the option rank (an int, 1 <= rank <= head_dim)")
    try:
        calibration = LowRankCalibration(calibration)
    except ValueError:
        raise ValueError(f"calibration={calibration!r}; expected one of "
                         f"{[c.value for c in LowRankCalibration]}") from None
    return LowRankCodec(rank, quantize, calibration)


CODECS: dict[str, Callable[..., KVCodec]] = {
        "none": _none,
        "int8": _int8,
        "int4": _int_factory(4),
        "int2": _int_factory(2),
        "fp8_e4m3": _fp8_factory(Fp8Format.E4M3),
        "fp8_e5m2": _fp8_factory(Fp8Format.E5M2),
        "kivi4": _kivi_factory(4),
        "kivi2": _kivi_factory(2),
        "lowrank": _lowrank,
}


def get_codec(name: str, **options: Any) -> KVCodec:
    """Builds the registered codec `name` with keyword `options` (see the module table).

    Options: none: dtype. int8: metadata_dtype, group (None: symmetric, one scale per token
    and kv head; an int: asymmetric, a scale and zero per `group` channels, as int4).
    int4/int2: group, metadata_dtype.
    fp8_e4m3/fp8_e5m2: scaling ("calibrated" or "dynamic"), scale (per-head floats).
    kivi4/kivi2: group, residual, metadata_dtype.
    lowrank: rank, quantize ('none' or 'int8'), calibration ('embedded' or 'manual').
    """
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {sorted(CODECS)}")
    factory = CODECS[name]
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"codec {name!r} has no option(s) {unknown}; accepted: {sorted(accepted)}")
    return factory(**options)

