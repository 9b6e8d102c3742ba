"""Rotary position embeddings as one object: the frequencies, the rotation and its fingerprint.

`RoPE` holds every parameter that decides how a position turns a query or key (the rotate-half
convention of Hugging Face), read from a `config.json`'s `rope_theta` / `rope_scaling` /
`rope_parameters` (`RoPE.from_hf`). The model applies it (`apply`); chunk re-rotation and
rotated attention sinks turn cached keys by a number of positions (`rotate`); the KV provenance
fingerprint includes it (`fingerprint`), since a key rotated under one RoPE is no key of another.

Frequencies per `RopeType` are those of transformers' `modeling_rope_utils` (the test oracle).
Two types choose their frequencies by sequence length: DYNAMIC (NTK, its base grows with the
length past `original_max_position_embeddings`) and LONGROPE (short factors up to that length,
long ones beyond). kvjax takes the length of a token to be its own position + 1, so a key
depends on its position alone (what a prefix cache and chunked prefill need): this equals
transformers' cached generation token by token, and its one-pass prompt as long as the prompt
fits `original_max_position_embeddings`. For these two types a key's angle is not its position
times fixed frequencies, so turning it by a shift does not give the key at the new position:
`is_shift_invariant` is False and `kvjax.engine.compat` refuses re-rotation with them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class RopeType(enum.Enum):
    """How the rotary frequencies are scaled (Hugging Face's `rope_type` names)."""

    DEFAULT = "default"
    LINEAR = "linear"  # positions interpolated by `factor`
    DYNAMIC = "dynamic"  # NTK: the base grows with the sequence length
    LLAMA3 = "llama3"  # low frequencies divided by `factor`, a smooth band between
    YARN = "yarn"  # NTK-by-parts ramp between interpolation and extrapolation, scaled cos/sin
    LONGROPE = "longrope"  # per-frequency factors, short or long by the sequence length
    FREQ_FACTORS = "freq_factors"  # fixed per-frequency divisors (a GGUF's rope_freqs tensor)


_SHIFT_INVARIANT = (RopeType.DEFAULT, RopeType.LINEAR, RopeType.LLAMA3, RopeType.YARN,
                    RopeType.FREQ_FACTORS)


@dataclasses.dataclass(frozen=True, repr=False)
class RoPE:
    """Rotary position embedding parameters (hashable: a static argument of jitted steps).

    Attributes:
      rope_type: the scaling.
      theta: the base frequency.
      factor: the context-extension factor (LINEAR, DYNAMIC, LLAMA3, YARN, LONGROPE).
      original_max_position_embeddings: the pre-training context length the scaling starts
        from (DYNAMIC: Hugging Face's `max_position_embeddings`).
      low_freq_factor, high_freq_factor: LLAMA3's band edges.
      beta_fast, beta_slow, truncate: YARN's ramp.
      attention_factor: what cos and sin are multiplied by (YARN, LONGROPE; 1 otherwise).
      short_factor, long_factor: LONGROPE's per-frequency factors, D/2 each.
      freq_factors: FREQ_FACTORS' divisors of the D/2 base frequencies (llama.cpp writes
        Llama 3.x's frequency bands into a GGUF this way, without the parameters behind them).
    """

    rope_type: RopeType = RopeType.DEFAULT
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self):
        if self.theta <= 0:
            raise ValueError(f"RoPE theta must be positive, got {self.theta!r}")
        if self.rope_type is not RopeType.DEFAULT and self.factor <= 0:
            raise ValueError(f"RoPE {self.rope_type.value} factor must be positive, got "
                             f"{self.factor!r}")
        needs_length = self.rope_type not in (RopeType.DEFAULT, RopeType.LINEAR,
                                              RopeType.FREQ_FACTORS)
        if needs_length and self.original_max_position_embeddings <= 0:
            raise ValueError(f"RoPE {self.rope_type.value} needs a positive "
                             f"original_max_position_embeddings, got "
                             f"{self.original_max_position_embeddings!r}")
        if self.rope_type is RopeType.LONGROPE and (
                not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("RoPE longrope needs short_factor and long_factor of one length, "
                             f"got {len(self.short_factor)} and {len(self.long_factor)}")
        if self.rope_type is RopeType.FREQ_FACTORS and not (
                self.freq_factors and all(f > 0 for f in self.freq_factors)):
            raise ValueError(f"RoPE freq_factors needs positive factors, got "
                             f"{self.freq_factors!r}")

    def __repr__(self) -> str:
        """Only the fields set apart from their defaults (configs print whole in docs)."""
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"RoPE({', '.join(changed)})"

    @property
    def is_shift_invariant(self) -> bool:
        """Whether a key's angle is its position times fixed frequencies, so that turning a
        key by s positions gives the key at its position + s."""
        return self.rope_type in _SHIFT_INVARIANT

    def context_length(self, max_position_embeddings: int) -> int:
        """The context a model of config.json's `max_position_embeddings` serves under this
        scaling: LINEAR and DYNAMIC stretch it by `factor`, YARN stretches the pre-training
        length; LLAMA3 and LONGROPE configs already state the extended length."""
        if self.rope_type in (RopeType.LINEAR, RopeType.DYNAMIC):
            return max(max_position_embeddings, int(max_position_embeddings * self.factor))
        if self.rope_type is RopeType.YARN:
            stretched = int(self.original_max_position_embeddings * self.factor)
            return max(max_position_embeddings, stretched)
        return max_position_embeddings

    @property
    def fingerprint(self) -> str:
        """Every parameter, as one string (part of the KV provenance fingerprint)."""
        fields = dataclasses.asdict(self)
        fields["rope_type"] = self.rope_type.value
        return ",".join(f"{k}={v!r}" for k, v in fields.items())

    # ------------------------------------------------------------------------- frequencies

    def inv_freq(self, dim: int, seq_len: int | None = None) -> np.ndarray:
        """[dim / 2] float32 inverse frequencies for a sequence of `seq_len` tokens (only
        DYNAMIC and LONGROPE depend on it; None: the pre-training length)."""
        if dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {dim}")
        exponents = np.arange(0, dim, 2, dtype=np.float64) / dim  # [D/2]
        base = 1.0 / self.theta ** exponents
        kind = self.rope_type
        if kind is RopeType.LINEAR:
            return (base / self.factor).astype(np.float32)
        if kind is RopeType.DYNAMIC:
            m = self.original_max_position_embeddings
            length = max(seq_len or m, m)
            theta = self.theta * ((self.factor * length / m) - (self.factor - 1)) ** (
                dim / (dim - 2))
            return (1.0 / theta ** exponents).astype(np.float32)
        if kind is RopeType.LLAMA3:
            return self._llama3(base).astype(np.float32)
        if kind is RopeType.YARN:
            return self._yarn(base, dim).astype(np.float32)
        if kind is RopeType.LONGROPE:
            if len(self.short_factor) != dim // 2:
                raise ValueError(f"RoPE longrope factors have {len(self.short_factor)} entries, "
                                 f"head dim {dim} needs {dim // 2}")
            long = seq_len is not None and seq_len > self.original_max_position_embeddings
            factors = np.asarray(self.long_factor if long else self.short_factor, np.float64)
            return (base / factors).astype(np.float32)
        if kind is RopeType.FREQ_FACTORS:
            if len(self.freq_factors) != dim // 2:
                raise ValueError(f"RoPE freq_factors has {len(self.freq_factors)} entries, head "
                                 f"dim {dim} needs {dim // 2}")
            return (base / np.asarray(self.freq_factors, np.float64)).astype(np.float32)
        return base.astype(np.float32)

    def _llama3(self, base: np.ndarray) -> np.ndarray:
        old_len = self.original_max_position_embeddings
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = np.where(wavelen > low_wavelen, base / self.factor, base)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(is_medium, smoothed, scaled)

    def _yarn(self, base: np.ndarray, dim: int) -> np.ndarray:
        old_len = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a zero-width ramp would divide by zero
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp  # [D/2]: 1 keeps a frequency, 0 interpolates it
        return base / self.factor * (1 - extrapolation) + base * extrapolation

    def angles(self, positions: jax.Array, dim: int) -> jax.Array:
        """[T, dim / 2] float32 rotation angles of positions [T] (int32)."""
        pos = positions.astype(jnp.float32)[:, None]  # [T, 1]
        m = self.original_max_position_embeddings
        if self.rope_type is RopeType.LONGROPE:
            short = jnp.asarray(self.inv_freq(dim))
            long = jnp.asarray(self.inv_freq(dim, m + 1))
            return pos * jnp.where(pos + 1 > m, long[None], short[None])
        if self.rope_type is RopeType.DYNAMIC:
            length = jnp.maximum(pos + 1, m)  # [T, 1]
            theta = self.theta * ((self.factor * length / m) - (self.factor - 1)) ** (
                dim / (dim - 2))
            exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim  # [D/2]
            return pos / theta ** exponents[None]
        return pos * jnp.asarray(self.inv_freq(dim))[None]

    # ------------------------------------------------------------------------- rotations

    def apply(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [T, heads, D] embedded at positions [T] (cos and sin scaled by
        `attention_factor`), in x's dtype."""
        return turn(x, *self.tables(positions, x.shape[-1]))

    def tables(self, positions: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
        """cos and sin [T, dim / 2] (scaled by `attention_factor`) that `apply` turns by."""
        return _tables(self.angles(positions, dim), self.attention_factor)

    def rotate(self, x: jax.Array, shifts: jax.Array) -> jax.Array:
        """Keys x [T, heads, D] (already embedded) turned forward by shifts [T] positions, no
        scaling: the key at position p becomes the key at p + shift when `is_shift_invariant`."""
        angles = shifts.astype(jnp.float32)[:, None] * jnp.asarray(self.inv_freq(x.shape[-1]))
        return _turn(x, angles, 1.0)

    # ------------------------------------------------------------------------- Hugging Face

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> RoPE:
        """The RoPE of a parsed Hugging Face `config.json`.

        Reads `rope_theta`, the legacy `rope_scaling` dict (`type` or `rope_type`) and
        transformers 5's `rope_parameters`; as in transformers, `rope_scaling` wins over
        `rope_parameters` and Phi-3's top-level `original_max_position_embeddings` over the
        dict's.

        Raises:
          ValueError: an unknown `rope_type`, a partial rotary factor, per-layer-type RoPE, or
            a missing parameter.
        """
        params = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"unsupported per-layer-type RoPE parameters {sorted(params)}")
        name = params.get("rope_type", params.get("type", "default"))
        try:
            rope_type = RopeType(name)
        except ValueError:
            raise ValueError(f"unsupported rope_type {name!r}; supported: "
                             f"{[t.value for t in RopeType]}") from None
        partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"unsupported partial_rotary_factor {partial!r}")
        theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
        max_positions = hf_config.get("max_position_embeddings", 2048)
        if rope_type is RopeType.DEFAULT:
            return cls(theta=theta)
        if rope_type is RopeType.DYNAMIC:
            original = max_positions  # transformers scales from max_position_embeddings here
        else:
            original = hf_config.get("original_max_position_embeddings",
                                     params.get("original_max_position_embeddings",
                                                max_positions))

        def required(key: str) -> Any:
            if params.get(key) is None:
                raise ValueError(f"rope_type {name!r} needs {key!r} in the RoPE parameters")
            return params[key]

        common = dict(rope_type=rope_type, theta=theta, original_max_position_embeddings=original)
        if rope_type in (RopeType.LINEAR, RopeType.DYNAMIC):
            return cls(factor=float(required("factor")), **common)
        if rope_type is RopeType.LLAMA3:
            return cls(factor=float(required("factor")),
                       low_freq_factor=float(required("low_freq_factor")),
                       high_freq_factor=float(required("high_freq_factor")), **common)
        if rope_type is RopeType.YARN:
            factor = float(required("factor"))
            attention = params.get("attention_factor")
            if attention is None:
                mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
                attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                             if mscale and mscale_all_dim else yarn_mscale(factor))
            return cls(factor=factor, beta_fast=float(params.get("beta_fast") or 32),
                       beta_slow=float(params.get("beta_slow") or 1),
                       truncate=bool(params.get("truncate", True)),
                       attention_factor=float(attention), **common)
        factor = params.get("factor")
        factor = float(max_positions / original if factor is None else factor)
        attention = params.get("attention_factor")
        if attention is None:
            attention = (1.0 if factor <= 1.0
                         else math.sqrt(1 + math.log(factor) / math.log(original)))
        return cls(factor=factor, attention_factor=float(attention),
                   short_factor=tuple(float(f) for f in required("short_factor")),
                   long_factor=tuple(float(f) for f in required("long_factor")), **common)


def apply_selected(ropes: tuple[RoPE, ...], choice: jax.Array, x: jax.Array,
                   positions: jax.Array) -> jax.Array:
    """x [T, heads, D] embedded at positions [T] by ropes[choice], `choice` a traced int32
    scalar (a layer's RoPE inside the layer scan: the frequencies [R, D/2] and attention
    factors [R] are stacked and one row is selected, so the scan stays one program).

    Raises:
      ValueError: a RoPE whose frequencies depend on the position (no fixed row to stack).
    """
    return turn(x, *selected_tables(ropes, choice, positions, x.shape[-1]))


def selected_tables(ropes: tuple[RoPE, ...], choice: jax.Array, positions: jax.Array,
                    dim: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, dim / 2] of ropes[choice] at positions [T] (`apply_selected`).

    Raises:
      ValueError: a RoPE whose frequencies depend on the position.
    """
    for rope in ropes:
        if not rope.is_shift_invariant:
            raise ValueError(f"{rope!r} chooses frequencies by position; only fixed-frequency "
                             f"RoPEs can be selected per layer")
    inv_freq = jnp.asarray(np.stack([rope.inv_freq(dim) for rope in ropes]))  # [R, D/2]
    factors = jnp.asarray([rope.attention_factor for rope in ropes], jnp.float32)  # [R]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[choice][None]  # [T, D/2]
    return _tables(angles, factors[choice])


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _tables(angles: jax.Array, scale: float | jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of angles [T, D/2], times scale."""
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def _turn(x: jax.Array, angles: jax.Array, scale: float) -> jax.Array:
    """x [T, heads, D] turned by angles [T, D/2] (rotate-half pairs), cos/sin times scale."""
    return turn(x, *_tables(angles, scale))


def turn(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, D] turned by the rotate-half pairs of cos, sin [T, D/2], in x's dtype."""
    d = x.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : d // 2], x32[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # [T, heads, D]
    return out.astype(x.dtype)
