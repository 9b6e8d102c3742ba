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


class MlpActivation(enum.Enum):
    """The gate activation of the gated MLP, down(act(gate(x)) * up(x))."""

    SILU = "silu"  # SwiGLU (Llama, Mistral, Qwen, Phi-3).
    GELU_TANH = "gelu_tanh"  # GeGLU with tanh-approximated GELU (Gemma's gelu_pytorch_tanh).


class MoeScoring(enum.Enum):
    """How a mixture-of-experts router turns its logits into expert scores."""

    SOFTMAX = "softmax"  # softmax over every expert (Mixtral, Qwen2/Qwen3-MoE, DeepSeek-V2).
    SIGMOID = "sigmoid"  # per-expert sigmoid, chosen with a bias (DeepSeek-V3).


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token runs through `num_experts_per_tok` of `num_experts`
    SwiGLU experts picked by a linear router, plus optional always-on shared experts.

    Routing (Fe = expert_size): scores = softmax(logits) or sigmoid(logits); with groups, only
    the experts of the `topk_groups` best of `num_groups` groups compete (a group's score is its
    best expert's with softmax, the sum of its two best with sigmoid, whose choice adds the
    per-expert correction bias); the top-k scores become the weights, renormalized to sum 1
    when `norm_topk_prob`, times `routed_scaling`. Mixtral is softmax with renormalization
    (a softmax over the top-k logits).

    Attributes:
      num_experts: E, routed experts per layer.
      num_experts_per_tok: k, experts each token runs through.
      expert_size: Fe, each routed expert's SwiGLU hidden size.
      shared_size: the always-on shared expert's hidden size (DeepSeek's n_shared_experts
        times Fe; Qwen2-MoE's shared_expert_intermediate_size), or 0: none.
      shared_gate: the shared expert's output is scaled by sigmoid(x @ w) (Qwen2-MoE).
      scoring: softmax or sigmoid scores.
      norm_topk_prob: the k weights are renormalized to sum 1.
      routed_scaling: the routed experts' weights are multiplied by this (DeepSeek).
      num_groups / topk_groups: group-limited routing (DeepSeek); 1 / 1: none.
      score_bias: the sigmoid choice adds a learned per-expert bias (DeepSeek-V3's
        e_score_correction_bias, param `router_bias`).
      dense_layers: the layers that run a dense MLP of `ModelConfig.intermediate_size` instead
        (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers), ascending.
    """

    num_experts: int
    num_experts_per_tok: int
    expert_size: int
    shared_size: int = 0
    shared_gate: bool = False
    scoring: MoeScoring = MoeScoring.SOFTMAX
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    score_bias: bool = False
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for field in ("num_experts", "num_experts_per_tok", "expert_size", "num_groups",
                      "topk_groups"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoeConfig.{field} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MoeConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(f"MoeConfig: {self.num_experts} experts do not split into "
                             f"num_groups={self.num_groups} with topk_groups={self.topk_groups}")
        per_group = self.num_experts // self.num_groups
        if self.topk_groups * per_group < self.num_experts_per_tok:
            raise ValueError(f"MoeConfig: topk_groups={self.topk_groups} groups of {per_group} "
                             f"experts hold fewer than num_experts_per_tok="
                             f"{self.num_experts_per_tok}")
        if self.scoring is MoeScoring.SIGMOID and self.num_groups > 1 and per_group < 2:
            raise ValueError("MoeConfig: sigmoid group scores sum a group's two best experts; "
                             f"groups of {per_group} expert are too small")
        if isinstance(self.shared_size, bool) or not isinstance(self.shared_size, int) \
                or self.shared_size < 0:
            raise ValueError(f"MoeConfig.shared_size must be an int >= 0, got "
                             f"{self.shared_size!r}")
        if self.shared_gate and not self.shared_size:
            raise ValueError("MoeConfig.shared_gate needs a shared expert (shared_size > 0)")
        if self.score_bias and self.scoring is not MoeScoring.SIGMOID:
            raise ValueError("MoeConfig.score_bias applies to sigmoid scoring only")
        if not self.routed_scaling > 0:
            raise ValueError(f"MoeConfig.routed_scaling must be positive, got "
                             f"{self.routed_scaling!r}")
        if list(self.dense_layers) != sorted(set(self.dense_layers)) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0
                for i in self.dense_layers):
            raise ValueError(f"MoeConfig.dense_layers must be ascending distinct layer indices, "
                             f"got {self.dense_layers!r}")


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one latent.

    Per layer and token the cache holds the latent c = RMSNorm(x @ W_DKV) [d_c] and one RoPE
    key part k_r [d_r] shared by every head. Head n's key is [c @ W_UK_n, k_r] and its value
    c @ W_UV_n; attention runs in the absorbed form: each query's non-RoPE part is mapped
    into the latent (q_n @ W_UK_n^T) and the attention output back out of it (@ W_UV_n), so
    attention reads only the latent pages.

    Attributes:
      kv_lora_rank: d_c, the latent width.
      qk_nope_head_dim: the per-head query/key width without RoPE.
      qk_rope_head_dim: d_r, the per-head query/key width with RoPE (the shared key part).
      v_head_dim: the per-head value width.
      q_lora_rank: the rank of the query's low-rank projection (with its own RMSNorm), or
        0: a full-rank query projection.
      softmax_scale: what attention logits are multiplied by, or None: qk_head_dim**-0.5
        (DeepSeek's YaRN configs multiply that by mscale squared).
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    softmax_scale: float | None = None

    def __post_init__(self):
        for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MlaConfig.{field} must be a positive int, got {value!r}")
        if isinstance(self.q_lora_rank, bool) or not isinstance(self.q_lora_rank, int) \
                or self.q_lora_rank < 0:
            raise ValueError(f"MlaConfig.q_lora_rank must be an int >= 0, got "
                             f"{self.q_lora_rank!r}")
        if self.softmax_scale is not None and not self.softmax_scale > 0:
            raise ValueError(f"MlaConfig.softmax_scale must be None or positive, got "
                             f"{self.softmax_scale!r}")

    @property
    def attn_scale(self) -> float:
        """What attention logits are multiplied by."""
        return self.softmax_scale or self.qk_head_dim ** -0.5

    @property
    def qk_head_dim(self) -> int:
        """A head's query/key width, qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """d_c + d_r: what one token stores per layer (the latent, then the RoPE key part)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5/3, Phi-3, SmolLM2,
    Gemma 2/3).

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
        qk_norm: queries and keys pass a per-head RMSNorm before RoPE (Qwen3, Gemma 3).
        activation: the MLP's gate activation (SwiGLU or GeGLU).
        norm_unit_offset: every RMSNorm scales by (1 + w) instead of w (Gemma).
        scale_embeddings: token embeddings are multiplied by sqrt(H), rounded to the params'
          dtype (Gemma).
        sandwich_norms: the attention and MLP outputs pass their own RMSNorm before the
          residual add (Gemma 2/3: params `post_attn_norm`, `post_mlp_norm`).
        query_pre_attn_scalar: attention logits are scaled by its inverse square root instead
          of D's (Gemma); None: D.
        attn_logit_softcap: attention logits become cap * tanh(logits / cap) (Gemma 2); None:
          no cap.
        final_logit_softcap: the same on the output logits (Gemma 2); None: no cap.
        local_rope: the RoPE of the layers in `local_rope_layers` (Gemma 3's sliding-window
          layers: another base); None: every layer uses `rope`.
        local_rope_layers: the layers that use `local_rope`, ascending.
        mla: multi-head latent attention (DeepSeek-V2/V3), or None. With it the cache holds
          one latent "head" per token: num_kv_heads is 1 and head_dim is `mla.cache_dim`
          (what attention reads), and the RoPE turns `mla.qk_rope_head_dim` columns.
        moe: the mixture-of-experts MLP (Mixtral, Qwen2/Qwen3-MoE, DeepSeek-V2/V3), or None:
          every layer's MLP is dense. Experts change the weights, not the KV cache.
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
    activation: MlpActivation = MlpActivation.SILU
    norm_unit_offset: bool = False
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    local_rope: RoPE | None = None
    local_rope_layers: tuple[int, ...] = ()
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
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
        self.rope.inv_freq(self.rope_dim)  # raises ValueError when the RoPE does not fit D
        self._check_mla()
        if self.moe is not None and (self.moe.dense_layers and self.moe.dense_layers[-1]
                                     >= self.num_layers or self.activation
                                     is not MlpActivation.SILU):
            raise ValueError(f"ModelConfig.moe needs SiLU experts and dense_layers below "
                             f"num_layers={self.num_layers}, got {self.moe} with "
                             f"{self.activation}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or any(
                isinstance(w, bool) or not isinstance(w, int) or w < 0
                for w in self.layer_windows)):
            raise ValueError(f"ModelConfig.layer_windows must hold one int >= 0 per layer "
                             f"({self.num_layers}), got {self.layer_windows!r}")
        for field in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"ModelConfig.{field} must be None or a positive number, got "
                                 f"{value!r}")
        self._check_local_rope()

    def _check_mla(self) -> None:
        mla = self.mla
        if mla is None:
            return
        if self.num_kv_heads != 1 or self.head_dim != mla.cache_dim:
            raise ValueError(f"a model with MLA caches one latent head of width kv_lora_rank + "
                             f"qk_rope_head_dim = {mla.cache_dim}: num_kv_heads must be 1 and "
                             f"head_dim {mla.cache_dim}, got {self.num_kv_heads} and "
                             f"{self.head_dim}")
        for field in ("qkv_bias", "qk_norm", "layer_windows", "local_rope",
                      "query_pre_attn_scalar", "attn_logit_softcap"):
            if getattr(self, field):
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r} is not part of "
                                 f"an MLA model")

    @property
    def rope_dim(self) -> int:
        """The width RoPE turns per head: head_dim, or MLA's qk_rope_head_dim."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    def _check_local_rope(self) -> None:
        layers = self.local_rope_layers
        if (self.local_rope is None) != (not layers):
            raise ValueError(f"ModelConfig.local_rope ({self.local_rope!r}) and local_rope_layers "
                             f"({layers!r}) must be set together")
        if not layers:
            return
        if list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= self.num_layers:
            raise ValueError(f"ModelConfig.local_rope_layers must be ascending distinct layers "
                             f"< {self.num_layers}, got {layers!r}")
        self.local_rope.inv_freq(self.rope_dim)
        for name, rope in (("rope", self.rope), ("local_rope", self.local_rope)):
            # Each layer picks its frequencies from a stacked table inside the layer scan,
            # which holds fixed frequencies only.
            if not rope.is_shift_invariant:
                raise ValueError(f"ModelConfig.{name} {rope!r} chooses frequencies by position; "
                                 f"a model with a local_rope takes fixed-frequency RoPEs only")

    @property
    def attn_scale(self) -> float:
        """The factor attention logits are scaled by: query_pre_attn_scalar**-0.5, or
        D**-0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def group_size(self) -> int:
        """G = N // K, query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` in tokens, 0 for global attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def kv_layer_groups(self) -> tuple[LayerGroup, ...]:
        """The model's layers grouped by KV needs (`kvjax.kv.spec`): one group per distinct
        window (global layers first), each storing K and V heads, or an MLA latent."""
        fmt = (TokenFormat.kv_heads(self.num_kv_heads, self.head_dim) if self.mla is None else
               TokenFormat.mla_latent(self.mla.kv_lora_rank, self.mla.qk_rope_head_dim))
        windows = sorted({self.layer_window(i) for i in range(self.num_layers)})
        return tuple(
            LayerGroup(tuple(i for i in range(self.num_layers) if self.layer_window(i) == w),
                       fmt, TokenKeep.SLIDING_WINDOW if w else TokenKeep.ALL, w)
            for w in windows)

    def kv_bytes_per_token(self, dtype) -> int:
        """Bytes one token takes over all layers stored exactly at `dtype` (K and V, or an MLA
        latent)."""
        values = sum(len(g.layers) * g.format.values_per_token for g in self.kv_layer_groups())
        return values * jnp.dtype(dtype).itemsize
