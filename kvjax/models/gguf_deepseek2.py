"""deepseek2 GGUF files (llama.cpp's DeepSeek-V2 layout) read as the Hugging Face checkpoint they
were converted from, so the MLA and MoE params come from the one mapping `kvjax.models.hf` has.

llama.cpp's converter keeps DeepSeek-V2's tensors as they are, renamed (attn_q or attn_q_a +
attn_q_a_norm + attn_q_b, attn_kv_a_mqa, attn_kv_a_norm, attn_output; dense ffn_* on the leading
`leading_dense_block_count` layers, then the router ffn_gate_inp, the stacked experts ffn_*_exps
[E, out, in] and the shared experts ffn_*_shexp), with two exceptions undone here: newer files
split kv_b_proj per head into attn_k_b [N, d_c, d_nope] (transposed) and attn_v_b [N, d_v, d_c]
(older ones keep attn_kv_b whole), and the experts are stacked. Its RoPE turns adjacent pairs of
the rope part, as the Hugging Face model does (the rows are not permuted), so the columns go to
the rotate-half order as for a Hugging Face directory. Newer files state the attention head dims
as `attention.key_length_mla` / `value_length_mla` (their `key_length` / `value_length` are the
latent's), older ones as `key_length` / `value_length`.

Read as DeepSeek-V2 computes it: softmax routing, greedy or group-limited (`expert_group_count`
> 1, `expert_group_used_count` groups) top-k, weights renormalized if `expert_weights_norm`,
scaled by `expert_weights_scale`; default RoPE or YaRN (`rope.scaling.factor`,
`original_context_length`, beta_fast / beta_slow (32 / 1 unless stated) and mscale = mscale_all_dim
= 10 * `yarn_log_multiplier`: the cos / sin factor 1 and the softmax scale times
(0.1 * mscale * ln(factor) + 1)^2, as DeepSeek-V2(-Lite) computes it). Refused: other RoPE
scaling, YaRN without the log multiplier, sigmoid gating and the choice bias exp_probs_b
(DeepSeek-V3 / Kimi files), and any tensor DeepSeek-V2 does not have.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ARCH = "deepseek2"
_PREFIX = ARCH + "."
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX

# GGUF name inside block N -> the Hugging Face name inside `model.layers.N.`.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
# Stacked experts [E, out, in] -> the Hugging Face name of expert e's matrix.
_EXPERT_NAMES = {"ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
                 "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
                 "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _required(metadata: dict[str, Any], key: str) -> Any:
    if _PREFIX + key not in metadata:
        raise ValueError(f"GGUF metadata is missing {_PREFIX}{key} (required by {ARCH})")
    return metadata[_PREFIX + key]


def hf_config(metadata: dict[str, Any], *, tie_word_embeddings: bool) -> dict[str, Any]:
    """The DeepSeek-V2 `config.json` (parsed) a deepseek2 GGUF's metadata describes.

    Raises:
      ValueError: a missing key, or RoPE scaling or gating kvjax does not read from GGUF.
    """
    get = metadata.get
    gating = get(_PREFIX + "expert_gating_func", _SOFTMAX_GATING)
    if gating != _SOFTMAX_GATING:
        raise ValueError(f"unsupported GGUF key {_PREFIX}expert_gating_func={gating!r}: kvjax "
                         f"reads {ARCH} with DeepSeek-V2's softmax gating only")
    rope_dim = _required(metadata, "rope.dimension_count")
    mla = _PREFIX + "attention.key_length_mla" in metadata
    qk_head_dim = _required(metadata, "attention.key_length_mla" if mla
                            else "attention.key_length")
    v_head_dim = _required(metadata, "attention.value_length_mla" if mla
                           else "attention.value_length")
    groups = get(_PREFIX + "expert_group_count") or 1
    scale = get(_PREFIX + "expert_weights_scale") or 1.0  # llama.cpp: 0 means unscaled
    return {
        "model_type": "deepseek_v2",
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "hidden_size": _required(metadata, "embedding_length"),
        "intermediate_size": _required(metadata, "feed_forward_length"),
        "num_hidden_layers": _required(metadata, "block_count"),
        "num_attention_heads": _required(metadata, "attention.head_count"),
        "rms_norm_eps": float(_required(metadata, "attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": _required(metadata, "context_length"),
        "rope_theta": float(get(_PREFIX + "rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(metadata),
        "q_lora_rank": get(_PREFIX + "attention.q_lora_rank") or None,
        "kv_lora_rank": _required(metadata, "attention.kv_lora_rank"),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "v_head_dim": v_head_dim,
        "n_routed_experts": get(_PREFIX + "expert_count") or None,
        "num_experts_per_tok": get(_PREFIX + "expert_used_count"),
        "moe_intermediate_size": get(_PREFIX + "expert_feed_forward_length"),
        "n_shared_experts": get(_PREFIX + "expert_shared_count") or 0,
        "first_k_dense_replace": get(_PREFIX + "leading_dense_block_count") or 0,
        "routed_scaling_factor": float(scale),
        "norm_topk_prob": bool(get(_PREFIX + "expert_weights_norm", False)),
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
        "n_group": groups,
        "topk_group": get(_PREFIX + "expert_group_used_count") or 1,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
    }


def _rope_scaling(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The Hugging Face `rope_scaling` of a deepseek2 GGUF: None, or YaRN with DeepSeek's mscale
    (the file keeps 0.1 * mscale_all_dim as `rope.scaling.yarn_log_multiplier` and no mscale of
    its own: DeepSeek's configs set the two equal, as llama.cpp's graph assumes)."""
    scaling = metadata.get(_PREFIX + "rope.scaling.type", "none")
    if scaling == "none":
        return None
    log_multiplier = metadata.get(_PREFIX + "rope.scaling.yarn_log_multiplier")
    if scaling != "yarn" or not log_multiplier:
        raise ValueError(f"unsupported GGUF {_PREFIX}rope.scaling.type {scaling!r} (with "
                         f"yarn_log_multiplier={log_multiplier!r}): kvjax reads {ARCH} with "
                         "default RoPE or DeepSeek's YaRN")
    mscale = float(log_multiplier) / 0.1
    return {"rope_type": "yarn", "factor": float(_required(metadata, "rope.scaling.factor")),
            "original_max_position_embeddings": int(
                _required(metadata, "rope.scaling.original_context_length")),
            "mscale": mscale, "mscale_all_dim": mscale,
            "beta_fast": float(metadata.get(_PREFIX + "rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(metadata.get(_PREFIX + "rope.scaling.yarn_beta_slow", 1.0))}


def hf_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The Hugging Face tensors of a deepseek2 GGUF's (dequantized, numpy's [out, in] shapes).
    A name DeepSeek-V2 does not have is kept as it is, for the loader to refuse by name."""
    out: dict[str, np.ndarray] = {}
    split_kv_b: dict[int, dict[str, np.ndarray]] = {}
    for name, w in tensors.items():
        block, _, local = name.partition(".")[2].partition(".")
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = w
        elif not name.startswith("blk.") or not block.isdigit():
            out[name] = w
        elif local in _LAYER_NAMES:
            out[f"model.layers.{block}.{_LAYER_NAMES[local]}"] = w
        elif local in _EXPERT_NAMES:
            for e, expert in enumerate(w):
                out[f"model.layers.{block}.{_EXPERT_NAMES[local].format(e=e)}"] = expert
        elif local in ("attn_k_b.weight", "attn_v_b.weight"):
            split_kv_b.setdefault(int(block), {})[local] = w
        else:
            out[name] = w
    for block, parts in split_kv_b.items():
        if len(parts) != 2:
            raise ValueError(f"GGUF block {block} has {sorted(parts)} without its other half "
                             "(attn_k_b and attn_v_b split kv_b_proj together)")
        k_b = parts["attn_k_b.weight"]  # [N, d_c, d_nope]
        v_b = parts["attn_v_b.weight"]  # [N, d_v, d_c]
        if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
            raise ValueError(f"GGUF block {block}: attn_k_b {k_b.shape} and attn_v_b "
                             f"{v_b.shape} do not split one kv_b_proj")
        kv_b = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)  # [N, d_nope + d_v, d_c]
        out[f"model.layers.{block}.self_attn.kv_b_proj.weight"] = kv_b.reshape(
            -1, kv_b.shape[-1])
    return out
