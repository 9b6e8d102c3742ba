"""Loads Hugging Face checkpoints (config.json + *.safetensors) of Llama-family decoders.

Architectures (`model_type`): llama (Llama 2, Llama 3.x with `rope_type` llama3, SmolLM2),
mistral, qwen2 (Qwen2, Qwen2.5: Q/K/V biases), qwen3 (per-head Q/K RMSNorm, no biases), phi3
(fused `qkv_proj` and `gate_up_proj`, split on loading; LongRoPE), gemma2 and gemma3_text
(GeGLU, (1 + w) RMSNorms before and after attention and MLP, scaled embeddings, the query
scale `query_pre_attn_scalar`, Gemma 2's attention and final logit soft caps, Gemma 3's Q/K
norms and its local layers' own RoPE base), deepseek_v2 and deepseek_v3 (multi-head latent
attention, `kvjax.models.mla`), and the mixtures of experts mixtral, qwen2_moe (a shared expert
behind a sigmoid gate, Q/K/V biases), qwen3_moe (Q/K norms) and DeepSeek's MoE layers
(`kvjax.models.moe`; `moe_config_from_hf` reads the routing). The RoPE of every one is read by
`kvjax.models.rope.RoPE.from_hf`.

Hugging Face stores linear weights as [out, in]; kvjax computes `x @ W`, so every matrix is
transposed to [in, out], and per-layer tensors are stacked on a leading L axis (see
`kvjax.models.llama`). Both use the rotate-half RoPE convention, so Q and K need no permutation,
except DeepSeek's, whose RoPE turns interleaved pairs: their RoPE columns are permuted on
loading (`kvjax.models.mla.rope_permutation`).

What is rejected rather than silently computed wrong: experts on other architectures,
DeepSeek routing methods other than greedy, group-limited greedy and V3's sigmoid, RoPE types
`RoPE.from_hf` does not know, partial rotary embeddings, activations other than SiLU, biases
beyond Qwen2's Q/K/V biases. Sliding windows become `ModelConfig.layer_windows`
(`layer_windows_from_hf`): Mistral's and Phi-3's one window on every layer, Qwen2/Qwen3's on the
layers from `max_window_layers` on, Gemma's alternating (Gemma 2) or one global layer in six
(Gemma 3), or whatever `layer_types` names; each window is one KV layer group whose pages go
back to the pool as they fall out of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from kvjax.config import MlaConfig, MlpActivation, ModelConfig, MoeConfig, MoeScoring, resolve_dtype
from kvjax.models import llama, mla, moe
from kvjax.models.model import Model
from kvjax.models.rope import RoPE, RopeType, yarn_mscale
from kvjax.models.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text",
                         "deepseek_v2", "deepseek_v3", "mixtral", "qwen2_moe", "qwen3_moe")
_MLA_TYPES = ("deepseek_v2", "deepseek_v3")
_GEMMA_TYPES = ("gemma2", "gemma3_text")
_QWEN_MOE_TYPES = ("qwen2_moe", "qwen3_moe")
# config.json keys that make a model of another architecture a mixture of experts (Phi-3.5).
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
# Architectures whose one `sliding_window` applies to every layer.
_EVERY_LAYER_WINDOW_TYPES = ("mistral", "phi3", "mixtral")

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
}

# kvjax layer param -> Hugging Face name inside `model.layers.N.` (public: checkpoint writers
# such as kvjax.testing.save_hf_checkpoint use the same names).
LAYER_WEIGHTS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
# Gemma's four norms per layer: HF's post_attention_layernorm is on the attention output.
_GEMMA_LAYER_NORMS = {
    "attn_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
# MLA's attention params (`kvjax.models.mla`) -> Hugging Face names inside `model.layers.N.`.
_MLA_WEIGHTS = {
    "wq": "self_attn.q_proj.weight",
    "wq_a": "self_attn.q_a_proj.weight",
    "q_a_norm": "self_attn.q_a_layernorm.weight",
    "wq_b": "self_attn.q_b_proj.weight",
    "wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "wkv_b": "self_attn.kv_b_proj.weight",
    "wo": "self_attn.o_proj.weight",
}
# A MoE layer's params (`kvjax.models.moe`) -> Hugging Face names inside `model.layers.N.`,
# per architecture; "{e}" stands for the expert's index.
_MOE_WEIGHTS = {
    "mixtral": {
        "router": "block_sparse_moe.gate.weight",
        "w_gate_exps": "block_sparse_moe.experts.{e}.w1.weight",
        "w_up_exps": "block_sparse_moe.experts.{e}.w3.weight",
        "w_down_exps": "block_sparse_moe.experts.{e}.w2.weight",
    },
    "qwen": {
        "router": "mlp.gate.weight",
        "w_gate_exps": "mlp.experts.{e}.gate_proj.weight",
        "w_up_exps": "mlp.experts.{e}.up_proj.weight",
        "w_down_exps": "mlp.experts.{e}.down_proj.weight",
        "w_gate_shared": "mlp.shared_expert.gate_proj.weight",
        "w_up_shared": "mlp.shared_expert.up_proj.weight",
        "w_down_shared": "mlp.shared_expert.down_proj.weight",
        "shared_gate": "mlp.shared_expert_gate.weight",
    },
    "deepseek": {
        "router": "mlp.gate.weight",
        "router_bias": "mlp.gate.e_score_correction_bias",
        "w_gate_exps": "mlp.experts.{e}.gate_proj.weight",
        "w_up_exps": "mlp.experts.{e}.up_proj.weight",
        "w_down_exps": "mlp.experts.{e}.down_proj.weight",
        "w_gate_shared": "mlp.shared_experts.gate_proj.weight",
        "w_up_shared": "mlp.shared_experts.up_proj.weight",
        "w_down_shared": "mlp.shared_experts.down_proj.weight",
    },
}
_MOE_FAMILY = {"mixtral": "mixtral", "qwen2_moe": "qwen", "qwen3_moe": "qwen",
               "deepseek_v2": "deepseek", "deepseek_v3": "deepseek"}
_LAYER_BIASES = {
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
}
_LAYER_QK_NORMS = {
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
# Phi-3's fused matrices: name -> the names of the parts they stack along `out`, in order.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _required(hf_config: dict[str, Any], key: str) -> Any:
    if key not in hf_config:
        raise ValueError(f"config.json is missing {key!r}")
    return hf_config[key]


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _phi3_rope_names(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 configs written before LongRoPE had its name call it 'su' or 'yarn' (transformers
    reads both as 'longrope' for Phi-3)."""
    out = dict(hf_config)
    for key in ("rope_scaling", "rope_parameters"):
        params = out.get(key)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) in (
                "su", "yarn"):
            out[key] = {**params, "rope_type": "longrope"}
    return out


def _gemma3_ropes(hf_config: dict[str, Any]) -> tuple[RoPE, RoPE]:
    """(global layers' RoPE, local layers' RoPE) of a Gemma 3 config: transformers 5's
    per-layer-type `rope_parameters`, or the older `rope_theta` / `rope_scaling` (global) and
    `rope_local_base_freq` (local)."""
    params = hf_config.get("rope_parameters") or {}
    bare = {k: v for k, v in hf_config.items() if k not in ("rope_parameters", "rope_scaling")}
    if isinstance(params.get("full_attention"), dict):
        return (RoPE.from_hf({**bare, "rope_parameters": params["full_attention"]}),
                RoPE.from_hf({**bare, "rope_parameters": params.get("sliding_attention")}))
    global_rope = RoPE.from_hf({**hf_config, "rope_theta": hf_config.get("rope_theta", 1e6)})
    return global_rope, RoPE(theta=float(hf_config.get("rope_local_base_freq", 10000.0)))


def _gemma_fields(hf_config: dict[str, Any], rope: RoPE, windows: tuple[int, ...]
                  ) -> dict[str, Any]:
    """The `ModelConfig` fields that make a Gemma 2 / Gemma 3 decoder."""
    model_type = hf_config["model_type"]
    if hf_config.get("use_bidirectional_attention"):
        raise ValueError(f"unsupported use_bidirectional_attention=true for model_type "
                         f"{model_type!r}; kvjax decodes causally")
    fields: dict[str, Any] = dict(
        norm_unit_offset=True, scale_embeddings=True, sandwich_norms=True,
        activation=MlpActivation.GELU_TANH, qk_norm=model_type == "gemma3_text",
        query_pre_attn_scalar=hf_config.get("query_pre_attn_scalar"),
        attn_logit_softcap=hf_config.get("attn_logit_softcapping"),
        final_logit_softcap=hf_config.get("final_logit_softcapping"),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", True)))
    if model_type == "gemma3_text":
        fields["rope"], local = _gemma3_ropes(hf_config)
        # Gemma 3's local layers are its sliding-window layers.
        local_layers = tuple(i for i, w in enumerate(windows) if w)
        if local != fields["rope"] and local_layers:
            fields.update(local_rope=local, local_rope_layers=local_layers)
    else:
        fields["rope"] = rope
    return fields


def config_from_hf(hf_config: dict[str, Any], *, eos_token_ids: tuple[int, ...] | None = None,
                   name: str = "hf") -> ModelConfig:
    """The `ModelConfig` of a Hugging Face `config.json` (already parsed).

    Args:
      hf_config: the parsed config.json.
      eos_token_ids: overrides config.json's `eos_token_id` (generation_config.json's list).
      name: the model name recorded in the config.
    """
    model_type = hf_config.get("model_type")
    if model_type in _MLA_TYPES:
        return _mla_config_from_hf(hf_config, eos_token_ids=eos_token_ids, name=name)
    for key in _MOE_KEYS:
        if hf_config.get(key) and model_type not in ("mixtral", *_QWEN_MOE_TYPES):
            raise ValueError(f"unsupported mixture-of-experts config ({key}={hf_config[key]!r}, "
                             f"model_type {model_type!r}); kvjax runs dense MLPs only")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; "
                         f"supported: {list(SUPPORTED_MODEL_TYPES)}")
    is_gemma = model_type in _GEMMA_TYPES
    act_key = "hidden_activation" if is_gemma else "hidden_act"
    act = hf_config.get(act_key) or hf_config.get("hidden_act") or "silu"
    supported_acts = ("gelu_pytorch_tanh",) if is_gemma else ("silu", "swish")
    if act not in supported_acts:
        raise ValueError(f"unsupported {act_key} {act!r} for model_type {model_type!r}; "
                         f"supported: {list(supported_acts)}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag):
            raise ValueError(f"unsupported {flag}=true for model_type {model_type!r}")
    # Gemma 3 reads its two RoPEs in _gemma_fields.
    rope = None if model_type == "gemma3_text" else RoPE.from_hf(
        _phi3_rope_names(hf_config) if model_type == "phi3" else hf_config)
    max_positions = hf_config.get("max_position_embeddings", 2048)
    if rope is not None:
        max_positions = rope.context_length(max_positions)
    windows = layer_windows_from_hf(hf_config)
    extra = (_gemma_fields(hf_config, rope, windows) if is_gemma
             else dict(rope=rope, qk_norm=model_type in ("qwen3", "qwen3_moe"),
                       tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False))))
    hidden = _required(hf_config, "hidden_size")
    num_heads = _required(hf_config, "num_attention_heads")
    return ModelConfig(
        vocab_size=_required(hf_config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_required(hf_config, "intermediate_size"),
        num_layers=_required(hf_config, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
        head_dim=hf_config.get("head_dim") or hidden // num_heads,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe"
                                           and bool(hf_config.get("qkv_bias", True))),
        moe=moe_config_from_hf(hf_config),
        **extra,
        layer_windows=windows,
        bos_token_id=hf_config.get("bos_token_id"),
        eos_token_ids=(eos_token_ids if eos_token_ids is not None
                       else _token_ids(hf_config.get("eos_token_id"))),
        name=name,
    )


def _mla_config_from_hf(hf_config: dict[str, Any], *, eos_token_ids: tuple[int, ...] | None,
                        name: str) -> ModelConfig:
    """The `ModelConfig` of a DeepSeek-V2/V3 config.json: MLA attention; dense MLPs, or a
    mixture of experts from layer `first_k_dense_replace` on (`moe_config_from_hf`)."""
    model_type = hf_config["model_type"]
    num_layers = _required(hf_config, "num_hidden_layers")
    act = hf_config.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r} for model_type {model_type!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag):
            raise ValueError(f"unsupported {flag}=true for model_type {model_type!r}")
    rope = RoPE.from_hf(hf_config)
    dims = {key: _required(hf_config, key) for key in (
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    # As DeepSeek's reference: YaRN's mscale_all_dim scales the logits of every dimension.
    params = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
    if rope.rope_type is not RopeType.DEFAULT and params.get("mscale_all_dim"):
        scale *= yarn_mscale(float(params["factor"]), params["mscale_all_dim"]) ** 2
    config = MlaConfig(**dims, q_lora_rank=hf_config.get("q_lora_rank") or 0,
                       softmax_scale=scale)
    return ModelConfig(
        vocab_size=_required(hf_config, "vocab_size"),
        hidden_size=_required(hf_config, "hidden_size"),
        intermediate_size=_required(hf_config, "intermediate_size"),
        num_layers=num_layers,
        num_heads=_required(hf_config, "num_attention_heads"),
        num_kv_heads=1,
        head_dim=config.cache_dim,
        rope=rope,
        mla=config,
        moe=moe_config_from_hf(hf_config),
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=rope.context_length(
            hf_config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        bos_token_id=hf_config.get("bos_token_id"),
        eos_token_ids=(eos_token_ids if eos_token_ids is not None
                       else _token_ids(hf_config.get("eos_token_id"))),
        name=name,
    )


def _moe_dense_layers(hf_config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers of a MoE config that run a dense MLP: DeepSeek's below
    `first_k_dense_replace` and off the `moe_layer_freq` stride, Qwen's `mlp_only_layers` and
    those off the `decoder_sparse_step` stride."""
    if hf_config["model_type"] in _MLA_TYPES:
        first = hf_config.get("first_k_dense_replace") or 0
        freq = hf_config.get("moe_layer_freq") or 1
        return tuple(i for i in range(num_layers) if i < first or i % freq)
    if hf_config["model_type"] in _QWEN_MOE_TYPES:
        only = set(hf_config.get("mlp_only_layers") or ())
        step = hf_config.get("decoder_sparse_step") or 1
        return tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return ()


def moe_config_from_hf(hf_config: dict[str, Any]) -> MoeConfig | None:
    """The `MoeConfig` of a Mixtral, Qwen2/Qwen3-MoE or DeepSeek-V2/V3 config.json, or None when
    every layer is dense (routing as transformers computes it; see `MoeConfig`).

    Raises:
      ValueError: a routing method or scoring function kvjax does not compute.
    """
    model_type = hf_config.get("model_type")
    num_layers = _required(hf_config, "num_hidden_layers")
    if model_type == "mixtral":
        num_experts, expert_size = hf_config.get("num_local_experts"), hf_config.get(
            "intermediate_size")
        fields: dict[str, Any] = {}
    elif model_type in _QWEN_MOE_TYPES:
        # Qwen's own configs say num_experts; transformers 5 writes num_local_experts.
        num_experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
        expert_size = hf_config.get("moe_intermediate_size")
        shared = hf_config.get("shared_expert_intermediate_size") or 0
        fields = dict(norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
                      shared_size=shared if model_type == "qwen2_moe" else 0,
                      shared_gate=bool(shared) and model_type == "qwen2_moe")
    elif model_type in _MLA_TYPES:
        num_experts, expert_size = hf_config.get("n_routed_experts"), hf_config.get(
            "moe_intermediate_size")
        fields = _deepseek_routing(hf_config)
        fields.update(shared_size=(hf_config.get("n_shared_experts") or 0) * (expert_size or 0),
                      routed_scaling=float(hf_config.get("routed_scaling_factor", 1.0)))
    else:
        return None
    if not num_experts:
        return None
    dense = _moe_dense_layers(hf_config, num_layers)
    if len(dense) == num_layers:
        return None
    return MoeConfig(num_experts=num_experts,
                     num_experts_per_tok=_required(hf_config, "num_experts_per_tok"),
                     expert_size=expert_size, dense_layers=dense, **fields)


def _deepseek_routing(hf_config: dict[str, Any]) -> dict[str, Any]:
    """`MoeConfig` routing fields of a DeepSeek config: V2 softmax, greedy or group-limited
    greedy (`topk_method`); V3 sigmoid with the choice bias and group-limited top-k."""
    if hf_config["model_type"] == "deepseek_v3":
        scoring = hf_config.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"unsupported scoring_func {scoring!r} for model_type "
                             f"'deepseek_v3'; supported: ['sigmoid']")
        return dict(scoring=MoeScoring.SIGMOID, score_bias=True,
                    norm_topk_prob=bool(hf_config.get("norm_topk_prob", True)),
                    num_groups=hf_config.get("n_group") or 1,
                    topk_groups=hf_config.get("topk_group") or 1)
    method = hf_config.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"unsupported topk_method {method!r} for model_type 'deepseek_v2'; "
                         f"supported: ['greedy', 'group_limited_greedy']")
    grouped = method == "group_limited_greedy"
    return dict(norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
                num_groups=(hf_config.get("n_group") or 1) if grouped else 1,
                topk_groups=(hf_config.get("topk_group") or 1) if grouped else 1)


def _rope_interleaved(hf_config: dict[str, Any]) -> bool:
    """Whether a DeepSeek checkpoint's RoPE turns interleaved pairs (V2 always; V3 unless
    `rope_interleave` is false)."""
    model_type = hf_config.get("model_type")
    return model_type == "deepseek_v2" or (model_type == "deepseek_v3" and bool(
        hf_config.get("rope_interleave", True)))


def layer_windows_from_hf(hf_config: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window (0: global) as transformers applies them; () when every
    layer is global.

    `layer_types` ('sliding_attention' / 'full_attention'), when present, names the windowed
    layers; otherwise Gemma's older forms (Gemma 3's `sliding_window_pattern`: every
    pattern-th layer, counted from 1, is global; Gemma 2: every second), Mistral and Phi-3
    window every layer, and Qwen2/Qwen3 with `use_sliding_window` the layers from
    `max_window_layers` on.
    """
    num_layers = _required(hf_config, "num_hidden_layers")
    window = hf_config.get("sliding_window") or 0
    model_type = hf_config.get("model_type")
    layer_types = hf_config.get("layer_types")
    if not layer_types and model_type in _GEMMA_TYPES:
        pattern = (hf_config.get("sliding_window_pattern", 6) if model_type == "gemma3_text"
                   else 2)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(num_layers)]
    if layer_types:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries, "
                             f"num_hidden_layers is {num_layers}")
        if not set(layer_types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"unsupported layer_types {layer_types!r}")
        sliding = [t == "sliding_attention" for t in layer_types]
    elif model_type in _EVERY_LAYER_WINDOW_TYPES:  # a window of None: none
        sliding = [bool(window)] * num_layers
    elif hf_config.get("use_sliding_window"):
        first = hf_config.get("max_window_layers", num_layers)
        sliding = [i >= first for i in range(num_layers)]
    else:
        sliding = [False] * num_layers
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding-window layers need a positive sliding_window, got "
                         f"{hf_config.get('sliding_window')!r}")
    windows = tuple(window if s else 0 for s in sliding)
    return windows if any(windows) else ()


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Tensors of one .safetensors file as read-only numpy arrays mapped from disk (no copy).

    BF16 tensors come back as `jnp.bfloat16` (ml_dtypes) arrays, which plain numpy cannot name.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header)")
        header_len = struct.unpack("<Q", prefix)[0]
        if header_len > size - 8:
            raise ValueError(f"{path} is not a safetensors file (header length {header_len})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} has a malformed safetensors header: {e}") from e
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} in {path} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        if end > data.size or end - start != dtype.itemsize * int(np.prod(info["shape"])):
            raise ValueError(f"tensor {name} in {path} has inconsistent data offsets")
        tensors[name] = data[start:end].view(dtype).reshape(info["shape"])
    return tensors


def _checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"shards named in {index} are missing: {absent}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (found {others}: only safetensors are supported)" if others else ""
        raise FileNotFoundError(f"no *.safetensors weights in {directory}{hint}")
    return files


def _read_checkpoint(files: list[Path]) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        shard = read_safetensors(file)
        repeated = sorted(shard.keys() & tensors.keys())
        if repeated:
            raise ValueError(f"tensor(s) {repeated[:8]} appear in more than one shard")
        tensors.update(shard)
    return tensors


def _expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face per-layer tensor shapes ([out, in] for matrices)."""
    c = config
    nd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "attn_norm": (c.hidden_size,),
        **{name: shape[::-1] for name, shape in llama._attention_shapes(c).items()},
        "mlp_norm": (c.hidden_size,),
    }
    if c.moe is None or c.moe.dense_layers:
        shapes.update(w_gate=(c.intermediate_size, c.hidden_size),
                      w_up=(c.intermediate_size, c.hidden_size),
                      w_down=(c.hidden_size, c.intermediate_size))
    if c.qkv_bias:
        shapes.update(bq=(nd,), bk=(kd,), bv=(kd,))
    if c.qk_norm:
        shapes.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
    if c.sandwich_norms:
        shapes.update(post_attn_norm=(c.hidden_size,), post_mlp_norm=(c.hidden_size,))
    return shapes


def _unfuse(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """`tensors` with Phi-3's fused matrices split into the separate ones (views, no copy).

    Raises:
      ValueError: a fused matrix's rows are not the sum of its parts' rows.
    """
    if config.mla is not None or config.moe is not None:
        return tensors
    shapes = _expected_hf_shapes(config)
    rows = {name: shapes[key][0] for key, name in LAYER_WEIGHTS.items()}
    out = dict(tensors)
    for i in range(config.num_layers):
        for fused, parts in _FUSED.items():
            name = f"model.layers.{i}.{fused}"
            if name not in out:
                continue
            w = out.pop(name)
            sizes = [rows[p] for p in parts]
            if w.shape[0] != sum(sizes):
                raise ValueError(f"tensor {name} has {w.shape[0]} rows, expected {sum(sizes)} "
                                 f"({' + '.join(map(str, sizes))} for {', '.join(parts)})")
            for part, piece in zip(parts, np.split(w, np.cumsum(sizes)[:-1]), strict=True):
                out[f"model.layers.{i}.{part}"] = piece
    return out


def params_from_hf(tensors: dict[str, np.ndarray], config: ModelConfig,
                   dtype: str = "float32", *, rope_interleaved: bool = False,
                   model_type: str | None = None) -> llama.Params:
    """Maps Hugging Face tensor names to the kvjax params pytree (transposed, stacked, cast).

    rope_interleaved: the checkpoint's RoPE turns interleaved pairs (DeepSeek's MLA): its
    RoPE columns are permuted to the rotate-half order.
    model_type: config.json's, which names a mixture of experts' tensors (needed with
    `config.moe`). The dense layers of a MoE model get zero expert params and its MoE layers
    zero dense-MLP params (`kvjax.models.moe`).

    Raises:
      ValueError: a tensor is missing, has the wrong shape, or is not part of the architecture.
    """
    target = resolve_dtype(dtype)
    tensors = _unfuse(tensors, config)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name} (expected shape {shape})")
        w = tensors[name]
        if tuple(w.shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(w.shape)}, expected {shape}")
        used.add(name)
        return w.T  # [in, out]: kvjax computes x @ W (a no-op on vectors)

    dense_layers = set(range(config.num_layers) if config.moe is None
                       else config.moe.dense_layers)

    def stacked(suffix: str, shape: tuple[int, ...]) -> jnp.ndarray:
        absent = suffix in LAYER_WEIGHTS.values() and suffix.startswith("mlp.")
        per_layer = [take(f"model.layers.{i}.{suffix}", shape)
                     if i in dense_layers or not absent else np.zeros(shape[::-1], target)
                     for i in range(config.num_layers)]
        return jnp.asarray(np.stack(per_layer).astype(target))  # [L, ...]

    names = {**LAYER_WEIGHTS, **(_MLA_WEIGHTS if config.mla is not None else {}),
             **(_LAYER_BIASES if config.qkv_bias else {}),
             **(_LAYER_QK_NORMS if config.qk_norm else {}),
             **(_GEMMA_LAYER_NORMS if config.sandwich_norms else {})}
    layers = {key: stacked(names[key], shape)
              for key, shape in _expected_hf_shapes(config).items()}
    if config.moe is not None:
        if model_type not in _MOE_FAMILY:
            raise ValueError(f"model_type {model_type!r} names no mixture-of-experts tensors; "
                             f"known: {sorted(_MOE_FAMILY)}")
        layers.update(_moe_params(take, config, _MOE_WEIGHTS[_MOE_FAMILY[model_type]], target))
    if rope_interleaved and config.mla is not None:
        layers.update(_rope_columns_to_halves(layers, config))
    v, h = config.vocab_size, config.hidden_size
    params: dict[str, Any] = {
        "embed": jnp.asarray(take("model.embed_tokens.weight", (v, h)).T.astype(target)),
        "final_norm": jnp.asarray(take("model.norm.weight", (h,)).astype(target)),
        "layers": layers,
    }
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints still carry a copy
    else:
        params["lm_head"] = jnp.asarray(take("lm_head.weight", (v, h)).astype(target))
    unexpected = sorted(n for n in tensors.keys() - used if not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"checkpoint has tensor(s) kvjax does not support: {unexpected[:8]}")
    llama.check_params(params, config)
    return params


def _moe_params(take: Any, config: ModelConfig, names: dict[str, str], target: np.dtype
                ) -> dict[str, jnp.ndarray]:
    """The MoE params [L, ...] (`kvjax.models.moe`) read by `take(name, hf_shape)` (which
    returns the tensor transposed); zeros on the dense layers."""
    dense = set(config.moe.dense_layers)
    out = {}
    for key, shape in moe.param_shapes(config).items():
        per_layer = []
        for i in range(config.num_layers):
            name = f"model.layers.{i}.{names[key]}"
            if i in dense:
                per_layer.append(np.zeros(shape, target))
            elif "{e}" in name:  # [E, in, out] from E tensors [out, in]
                per_layer.append(np.stack([take(name.format(e=e), shape[1:][::-1])
                                           for e in range(shape[0])]))
            else:
                per_layer.append(take(name, shape[::-1]))
        out[key] = jnp.asarray(np.stack(per_layer).astype(target))
    return out


def _rope_columns_to_halves(layers: dict[str, jnp.ndarray], config: ModelConfig
                            ) -> dict[str, jnp.ndarray]:
    """MLA's query and key matrices with their RoPE output columns in rotate-half order."""
    m = config.mla
    perm = mla.rope_permutation(m.qk_rope_head_dim)
    wq_name = "wq_b" if m.q_lora_rank else "wq"
    wq = layers[wq_name]  # [L, In, N * (d_nope + d_r)]
    heads = wq.reshape(*wq.shape[:2], config.num_heads, m.qk_head_dim)
    order = np.concatenate([np.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + perm])
    wkv_a = layers["wkv_a"]  # [L, H, d_c + d_r]
    key_order = np.concatenate([np.arange(m.kv_lora_rank), m.kv_lora_rank + perm])
    return {wq_name: heads[..., order].reshape(wq.shape), "wkv_a": wkv_a[..., key_order]}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def load_hf(directory: str | os.PathLike, dtype: str = "float32") -> Model:
    """Loads a Hugging Face checkpoint directory of a `SUPPORTED_MODEL_TYPES` architecture.

    Reads config.json, generation_config.json (its `eos_token_id` list, when present), the
    safetensors weights (one file, or shards through model.safetensors.index.json or a glob) and
    tokenizer.json with tokenizer_config.json when present.

    Args:
      directory: the checkpoint directory (as written by `save_pretrained`).
      dtype: 'float32', 'bfloat16' or 'float16' for every param.

    Returns:
      A `Model` with `weights_version` 'sha256:<digest of the weight files>' and the tokenizer
      (None when the directory has no tokenizer.json).

    Raises:
      FileNotFoundError: no directory, config.json or weights.
      ValueError: unsupported model_type or feature, or missing / misshapen / unknown tensors.
    """
    resolve_dtype(dtype)
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {directory}")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    generation_path = directory / "generation_config.json"
    eos = None
    if generation_path.is_file():
        eos = _token_ids(_read_json(generation_path).get("eos_token_id")) or None
    hf_config = _read_json(config_path)
    config = config_from_hf(hf_config, eos_token_ids=eos, name=directory.name)
    files = _checkpoint_files(directory)
    params = params_from_hf(_read_checkpoint(files), config, dtype,
                            rope_interleaved=_rope_interleaved(hf_config),
                            model_type=hf_config.get("model_type"))
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        tokenizer_config = directory / "tokenizer_config.json"
        tokenizer = Tokenizer.from_file(
            directory / "tokenizer.json", tokenizer_config if tokenizer_config.is_file() else None)
    return Model(config=config, params=params, tokenizer=tokenizer,
                 weights_version=f"sha256:{digest.hexdigest()}", source=str(directory))
