"""Frozen configuration dataclasses shared across kvjax.

Shape vocabulary used throughout the code base (declared once, here):

    B  batch (sequences)          T  query tokens in a step     S  kv tokens
    N  query heads                K  kv heads                   G  N // K (group size)
    D  head dim                   P  page size                  L  layers
    H  hidden size                F  MLP hidden size            V  vocabulary
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp

from kvjax.kv.spec import LayerGroup, TokenFormat, TokenKeep
from kvjax.models.rope import RoPE


class KVLayout(enum.Enum):
    """How KV storage is organised on the device."""

    CONTIGUOUS = "contiguous"  # [L, max_seqs, max_len, K, D]: the naive preallocating baseline.
    PAGED = "paged"  # [L, num_pages, P, K, D] plus block tables.


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(name: str | jnp.dtype) -> jnp.dtype:
    """Maps 'float32' / 'bfloat16' / 'float16' (or a dtype) to a jnp dtype."""
    if not isinstance(name, str):
        return jnp.dtype(name)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return jnp.dtype(_DTYPES[name])


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5/3, Phi-3, SmolLM2).

    Attributes:
        vocab_size: V.
        hidden_size: H.
        intermediate_size: F, the SwiGLU hidden size.
        num_layers: L.
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads (GQA when K < N, MQA when K == 1).
        head_dim: D.
        rope: the rotary position embedding (base, scaling).
        rms_norm_eps: epsilon of RMSNorm.
        max_position_embeddings: the context length the model was trained for.
        tie_word_embeddings: the output projection reuses the token embedding.
        qkv_bias: Q, K and V projections carry a bias (Qwen2).
        qk_norm: queries and keys pass a per-head RMSNorm before RoPE (Qwen3).
        layer_windows: per layer, the sliding window in tokens a query attends (0: every
          earlier token); empty when every layer is global. Layers of one window form one KV
          layer group (`kv_layer_groups`).
        bos_token_id / eos_token_ids: special tokens (eos may be several ids).
        name: a human-readable name, part of the KV provenance fingerprint.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RoPE = RoPE()
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    layer_windows: tuple[int, ...] = ()
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    name: str = "llama"

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.rope.inv_freq(self.head_dim)  # raises ValueError when the RoPE does not fit D
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or any(
                isinstance(w, bool) or not isinstance(w, int) or w < 0
                for w in self.layer_windows)):
            raise ValueError(f"ModelConfig.layer_windows must hold one int >= 0 per layer "
                             f"({self.num_layers}), got {self.layer_windows!r}")

    @property
    def group_size(self) -> int:
        """G = N // K, query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` in tokens, 0 for global attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def kv_layer_groups(self) -> tuple[LayerGroup, ...]:
        """The model's layers grouped by KV needs (`kvjax.kv.spec`): one group per distinct
        window (global layers first), each storing K and V heads."""
        fmt = TokenFormat.kv_heads(self.num_kv_heads, self.head_dim)
        windows = sorted({self.layer_window(i) for i in range(self.num_layers)})
        return tuple(
            LayerGroup(tuple(i for i in range(self.num_layers) if self.layer_window(i) == w),
                       fmt, TokenKeep.SLIDING_WINDOW if w else TokenKeep.ALL, w)
            for w in windows)

    def kv_bytes_per_token(self, dtype) -> int:
        """Bytes one token takes over all layers stored exactly at `dtype` (K and V)."""
        values = sum(len(g.layers) * g.format.values_per_token for g in self.kv_layer_groups())
        return values * jnp.dtype(dtype).itemsize
