"""Loads GGUF files (llama.cpp's format) into a kvjax `Model`.

Architectures (`general.architecture`): llama, qwen2 (Q/K/V biases), qwen3 (per-head Q/K
RMSNorms), gemma2 and gemma3 (GeGLU, pre and post norms, scaled embeddings, Gemma 2's soft caps,
alternating sliding-window layers, Gemma 3's Q/K norms and its local layers' own RoPE base),
phi3 (fused attn_qkv and gate-up ffn_up, split on loading; LongRoPE from its factor tensors, see
below); llama with
`expert_count` is Mixtral (a router `ffn_gate_inp` and stacked experts `ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`; softmax over the top-k logits, as llama.cpp routes it);
qwen2moe (Qwen2's attention; on every layer the experts, `expert_feed_forward_length` each, with
the top-k softmax weights not renormalized, and a shared expert `ffn_*_shexp` of
`expert_shared_feed_forward_length` behind a sigmoid gate `ffn_gate_inp_shexp`) and qwen3moe
(Qwen3's attention; experts only, the top-k weights renormalized), routed as llama.cpp's graphs
for these architectures route them; deepseek2 (DeepSeek-V2's MLA, dense and MoE layers) is read
as the Hugging Face checkpoint it was converted from (`kvjax.models.gguf_deepseek2`).

Every tensor is dequantized to float32 on the host (any type `gguf.dequantize` knows: F32, F16,
Q8_0, Q4_0, Q4_1, K-quants, ...), mapped into the params pytree of `kvjax.models.llama`, then cast
to the requested dtype. The model therefore computes with the dequantized weights exactly; the
quantized storage itself is not kept.

llama.cpp's converter permutes the rows of attn_q and attn_k of llama within each head so that its
RoPE can rotate adjacent pairs (x0, x1), (x2, x3), ...; kvjax rotates halves (x_i, x_{i+D/2})
like Hugging Face, so the loader undoes that permutation. Qwen, Gemma and Phi-3 use llama.cpp's
NEOX rotation, which rotates halves: their rows are stored unpermuted. llama.cpp stores Gemma's
RMSNorm weights with the 1 of (1 + w) added; the loader subtracts it, so the params equal those
loaded from the Hugging Face checkpoint.

What llama.cpp fixes in code rather than metadata is applied as it does: Gemma 2 windows every
other layer (from the first), Gemma 3 five layers in six, whose RoPE base is 10000 unless
`rope.freq_base_swa` says otherwise; Gemma's queries are scaled by 1/sqrt(key_length), except
the 27B models' (46 layers for Gemma 2, 62 for Gemma 3) by 1/sqrt(hidden / heads); Gemma 2's soft
caps default to 50 (attention) and 30 (final), Gemma 3 has no attention cap; Phi-3's
`attention.sliding_window` is ignored (llama.cpp disables Phi-3's window).

Phi-3's LongRoPE (Phi-3-128k) is stored as the tensors rope_factors_short / rope_factors_long
([D/2] each) beside `rope.scaling.original_context_length` and `rope.scaling.attn_factor`. kvjax
reads them as the Hugging Face model the file was converted from: a token's frequencies are
divided by the short factors while its position + 1 is within the original context length, by the
long ones beyond (`RopeType.LONGROPE`), and cos / sin are scaled by the attention factor the file
states (else sqrt(1 + ln(s) / ln(original)), s = context_length / original, as transformers
computes it). llama.cpp instead picks one factor set for the whole run by its configured context
size, so its logits differ from kvjax's wherever the two choices differ.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from kvjax.config import MlpActivation, ModelConfig, MoeConfig, resolve_dtype
from kvjax.models import gguf_deepseek2, hf, llama
from kvjax.models.model import Model
from kvjax.models.rope import RoPE, RopeType
from kvjax.models.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2moe",
                           "qwen3moe", gguf_deepseek2.ARCH)
# Architectures whose every layer is a mixture of experts, with or without the shared expert.
_QWEN_MOE_ARCHS = ("qwen2moe", "qwen3moe")
_GEMMA_ARCHS = ("gemma2", "gemma3")
# llama.cpp's one global layer every `pattern` layers (the last of each run), per architecture.
_GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
# llama.cpp's block counts of the 27B Gemmas, whose query scale is 1/sqrt(hidden / heads).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_LOCAL_ROPE_BASE = 10000.0

# kvjax layer param -> GGUF tensor name inside block N (blk.N.<name>), per optional feature.
_LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
_BIAS_TENSORS = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}
_QK_NORM_TENSORS = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
_SANDWICH_TENSORS = {"post_attn_norm": "post_attention_norm.weight",
                     "post_mlp_norm": "post_ffw_norm.weight"}
# The MoE tensors: kvjax param -> GGUF name inside block N (experts stacked [E, out, in]).
_MOE_TENSORS = {"router": "ffn_gate_inp.weight", "w_gate_exps": "ffn_gate_exps.weight",
                "w_up_exps": "ffn_up_exps.weight", "w_down_exps": "ffn_down_exps.weight"}
# Qwen2-MoE's shared expert and its gate (a vector [H] in the file, the param [H, 1]).
_SHARED_EXPERT_TENSORS = {"w_gate_shared": "ffn_gate_shexp.weight",
                          "w_up_shared": "ffn_up_shexp.weight",
                          "w_down_shared": "ffn_down_shexp.weight",
                          "shared_gate": "ffn_gate_inp_shexp.weight"}
# Routing keys llama.cpp reads where present -> the values that route as kvjax reads these
# architectures (softmax gating: llama.cpp's enum value 1; no weight scale; one expert group;
# no leading dense layers); a file with another value is refused.
_MOE_ROUTING_KEYS = {"expert_gating_func": (1,), "expert_weights_scale": (0.0, 1.0),
                     "expert_group_count": (0, 1), "leading_dense_block_count": (0,)}
# Phi-3's fused matrices: GGUF name -> the kvjax params stacked along its rows, in order.
_FUSED_TENSORS = {"attn_qkv.weight": ("wq", "wk", "wv"), "ffn_up.weight": ("w_gate", "w_up")}
# LongRoPE's per-frequency factors [D/2] (Phi-3): RoPE parameters, not layer params.
_LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """GGUF metadata as plain Python values: key -> str | int | float | bool | list."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _open(path: Path) -> gguf.GGUFReader:
    if not path.exists():
        raise FileNotFoundError(f"no GGUF file at {path}")
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata is missing {key}")
    return metadata[key]


def _rope(metadata: dict[str, Any], prefix: str, rope_freqs: np.ndarray | None,
          longrope_factors: tuple[np.ndarray, np.ndarray] | None) -> RoPE:
    scaling = metadata.get(prefix + "rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"unsupported GGUF {prefix}rope.scaling.type {scaling!r}")
    theta = float(metadata.get(prefix + "rope.freq_base", 10000.0))
    if longrope_factors is not None:
        if scaling != "none" or rope_freqs is not None:
            raise ValueError("a GGUF with LongRoPE factors and rope_freqs or rope scaling type "
                             f"{scaling!r}: kvjax applies one RoPE scaling")
        return _longrope(metadata, prefix, theta, *longrope_factors)
    if rope_freqs is not None:
        if scaling != "none":
            raise ValueError("a GGUF with rope_freqs and rope scaling type "
                             f"{scaling!r}: kvjax applies one or the other")
        return RoPE(RopeType.FREQ_FACTORS, theta=theta,
                    freq_factors=tuple(float(f) for f in rope_freqs))
    if scaling == "linear":
        return RoPE(RopeType.LINEAR, theta=theta,
                    factor=float(_required(metadata, prefix + "rope.scaling.factor")))
    return RoPE(theta=theta)


def _longrope(metadata: dict[str, Any], prefix: str, theta: float, short: np.ndarray,
              long: np.ndarray) -> RoPE:
    """Phi-3's LongRoPE with transformers' semantics (see the module docstring)."""
    original = int(_required(metadata, prefix + "rope.scaling.original_context_length"))
    context = int(_required(metadata, prefix + "context_length"))
    if original <= 0:
        raise ValueError(f"GGUF {prefix}rope.scaling.original_context_length must be positive, "
                         f"got {original}")
    factor = context / original
    attention = metadata.get(prefix + "rope.scaling.attn_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RoPE(RopeType.LONGROPE, theta=theta, factor=factor,
                original_max_position_embeddings=original, attention_factor=float(attention),
                short_factor=tuple(float(f) for f in short),
                long_factor=tuple(float(f) for f in long))


def _gemma_fields(metadata: dict[str, Any], arch: str, *, num_layers: int, hidden: int,
                  num_heads: int, head_dim: int, rope: RoPE) -> dict[str, Any]:
    """The `ModelConfig` fields of a gemma2 / gemma3 GGUF (see the module docstring)."""
    prefix = f"{arch}."
    if prefix + "attention.sliding_window_pattern" in metadata:
        raise ValueError(f"unsupported GGUF key {prefix}attention.sliding_window_pattern: "
                         f"kvjax applies llama.cpp's fixed {arch} pattern only")
    # gemma2 requires its window; gemma3 without one (or 0) has no windowed layers.
    window = int(_required(metadata, prefix + "attention.sliding_window") if arch == "gemma2"
                 else metadata.get(prefix + "attention.sliding_window") or 0)
    pattern = _GEMMA_WINDOW_PATTERN[arch]
    windows = tuple(window if (i + 1) % pattern else 0 for i in range(num_layers))
    scalar = (hidden // num_heads if num_layers == _GEMMA_27B_LAYERS[arch] else head_dim)
    # llama.cpp's soft caps: Gemma 2 50 and 30 unless stated; Gemma 3 only a final cap, if any.
    attn_cap = (float(metadata.get(prefix + "attn_logit_softcapping", 50.0)) or None
                if arch == "gemma2" else None)
    final_cap = float(metadata.get(prefix + "final_logit_softcapping",
                                   30.0 if arch == "gemma2" else 0.0)) or None
    fields: dict[str, Any] = dict(
        rope=rope, norm_unit_offset=True, scale_embeddings=True, sandwich_norms=True,
        activation=MlpActivation.GELU_TANH, qk_norm=arch == "gemma3",
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcap=attn_cap, final_logit_softcap=final_cap,
        layer_windows=windows if any(windows) else ())
    if arch == "gemma3":
        local = RoPE(theta=float(metadata.get(prefix + "rope.freq_base_swa",
                                              _GEMMA_LOCAL_ROPE_BASE)))
        local_layers = tuple(i for i, w in enumerate(windows) if w)
        if local != rope and local_layers:
            fields.update(local_rope=local, local_rope_layers=local_layers)
    return fields


def config_from_metadata(metadata: dict[str, Any], *, tie_word_embeddings: bool,
                         name: str = "gguf", rope_freqs: np.ndarray | None = None,
                         longrope_factors: tuple[np.ndarray, np.ndarray] | None = None
                         ) -> ModelConfig:
    """The `ModelConfig` of a GGUF, from its `<arch>.*` and tokenizer keys.

    The vocabulary size is the length of `tokenizer.ggml.tokens`. Whether the embedding is tied
    is not metadata: a file without an `output.weight` tensor ties it. `rope_freqs` (the
    `rope_freqs.weight` tensor llama.cpp writes for Llama 3.x) divides the RoPE frequencies;
    `rope.scaling.type` "linear" stretches positions by `rope.scaling.factor` (Gemma 3: on its
    global layers only); `longrope_factors` (the short and long factor tensors [D/2] of a Phi-3
    file) make it LongRoPE (see the module docstring).
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; "
                         f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in metadata]
    if arch == gguf_deepseek2.ARCH:
        return hf.config_from_hf(
            gguf_deepseek2.hf_config(metadata, tie_word_embeddings=tie_word_embeddings),
            eos_token_ids=tuple(dict.fromkeys(eos)), name=name)
    prefix = f"{arch}."
    moe = _moe_config(metadata, arch)
    for key in ("rope.dimension_sections",):
        if metadata.get(prefix + key):
            raise ValueError(f"unsupported GGUF key {prefix}{key}={metadata[prefix + key]!r}")
    if longrope_factors is not None and arch != "phi3":
        raise ValueError(f"unsupported GGUF tensors {list(_LONGROPE_TENSORS)} for {arch}: "
                         "LongRoPE factors are read for phi3 only")
    rope = _rope(metadata, prefix, rope_freqs, longrope_factors)
    hidden = _required(metadata, prefix + "embedding_length")
    num_heads = _required(metadata, prefix + "attention.head_count")
    num_layers = _required(metadata, prefix + "block_count")
    head_dim = metadata.get(prefix + "attention.key_length", hidden // num_heads)
    value_dim = metadata.get(prefix + "attention.value_length", head_dim)
    rotary_dim = metadata.get(prefix + "rope.dimension_count", head_dim)
    if value_dim != head_dim or rotary_dim != head_dim:
        raise ValueError(f"unsupported GGUF head layout: key_length={head_dim}, "
                         f"value_length={value_dim}, rope.dimension_count={rotary_dim} "
                         "(kvjax needs them equal)")
    if longrope_factors is not None and any(f.shape != (head_dim // 2,) for f in longrope_factors):
        raise ValueError(f"GGUF LongRoPE factor tensors have shapes "
                         f"{[f.shape for f in longrope_factors]}, head dim {head_dim} needs "
                         f"({head_dim // 2},)")
    if arch in _GEMMA_ARCHS:
        extra = _gemma_fields(metadata, arch, num_layers=num_layers, hidden=hidden,
                              num_heads=num_heads, head_dim=head_dim, rope=rope)
    else:
        extra = dict(rope=rope, qkv_bias=arch in ("qwen2", "qwen2moe"),
                     qk_norm=arch in ("qwen3", "qwen3moe"))
    return ModelConfig(
        vocab_size=len(_required(metadata, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=_required(metadata, prefix + "feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=metadata.get(prefix + "attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(_required(metadata, prefix + "attention.layer_norm_rms_epsilon")),
        max_position_embeddings=_required(metadata, prefix + "context_length"),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        tie_word_embeddings=tie_word_embeddings,
        moe=moe,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        name=name,
        **extra,
    )


def _moe_config(metadata: dict[str, Any], arch: str) -> MoeConfig | None:
    """The experts of a Mixtral (llama with `expert_count`), qwen2moe or qwen3moe GGUF, else
    None. llama.cpp's expert size defaults to feed_forward_length / expert_used_count, the
    shared expert's to feed_forward_length; the top-k weights are renormalized for qwen3moe
    and not for qwen2moe (as llama.cpp's graphs fix it) unless `expert_weights_norm` says."""
    prefix = f"{arch}."
    count = metadata.get(prefix + "expert_count")
    if arch in _QWEN_MOE_ARCHS and not count:
        raise ValueError(f"GGUF metadata is missing {prefix}expert_count (required by {arch})")
    if not count:
        return None
    if arch not in ("llama", *_QWEN_MOE_ARCHS):
        raise ValueError(f"unsupported GGUF key {prefix}expert_count={count!r}: experts are "
                         f"read for llama (Mixtral), qwen2moe and qwen3moe only")
    for key, values in _MOE_ROUTING_KEYS.items():
        if metadata.get(prefix + key, values[0]) not in values:
            raise ValueError(f"unsupported GGUF key {prefix}{key}={metadata[prefix + key]!r}: "
                             f"kvjax reads {arch} with {key} in {values}")
    used = _required(metadata, prefix + "expert_used_count")
    ffn = _required(metadata, prefix + "feed_forward_length")
    if arch == "llama":
        return MoeConfig(num_experts=count, num_experts_per_tok=used, expert_size=ffn)
    is_qwen2 = arch == "qwen2moe"
    return MoeConfig(
        num_experts=count, num_experts_per_tok=used,
        expert_size=metadata.get(prefix + "expert_feed_forward_length") or ffn // used,
        shared_size=(metadata.get(prefix + "expert_shared_feed_forward_length") or ffn
                     if is_qwen2 else 0),
        shared_gate=is_qwen2,
        norm_topk_prob=bool(metadata.get(prefix + "expert_weights_norm", not is_qwen2)))


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation. w: [heads*D, H] (GGUF rows) -> same shape."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    # llama.cpp stores head row (pair i, member j) at i*2 + j; rotate-half wants j*D/2 + i.
    w = w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)  # [heads, 2, D/2, H]
    return w.reshape(rows, *w.shape[3:])


def _layer_tensors(config: ModelConfig, arch: str
                   ) -> dict[str, tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]]:
    """GGUF name inside block N -> (the kvjax layer params it holds, stacked along its rows;
    their shapes as numpy sees them: [out, in])."""
    c = config
    nd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "attn_norm": (c.hidden_size,),
        "wq": (nd, c.hidden_size),
        "wk": (kd, c.hidden_size),
        "wv": (kd, c.hidden_size),
        "wo": (c.hidden_size, nd),
        "mlp_norm": (c.hidden_size,),
    }
    names = dict(_LAYER_TENSORS)
    if c.moe is None:
        shapes.update(w_gate=(c.intermediate_size, c.hidden_size),
                      w_up=(c.intermediate_size, c.hidden_size),
                      w_down=(c.hidden_size, c.intermediate_size))
    else:
        e, fe = c.moe.num_experts, c.moe.expert_size
        shapes.update(router=(e, c.hidden_size), w_gate_exps=(e, fe, c.hidden_size),
                      w_up_exps=(e, fe, c.hidden_size), w_down_exps=(e, c.hidden_size, fe))
        names.update(_MOE_TENSORS)
        fs = c.moe.shared_size
        if fs:
            shapes.update(w_gate_shared=(fs, c.hidden_size), w_up_shared=(fs, c.hidden_size),
                          w_down_shared=(c.hidden_size, fs))
            names.update({k: _SHARED_EXPERT_TENSORS[k] for k in
                          ("w_gate_shared", "w_up_shared", "w_down_shared")})
        if c.moe.shared_gate:
            shapes["shared_gate"] = (c.hidden_size,)
            names["shared_gate"] = _SHARED_EXPERT_TENSORS["shared_gate"]
    if c.qkv_bias:
        shapes.update(bq=(nd,), bk=(kd,), bv=(kd,))
        names.update(_BIAS_TENSORS)
    if c.qk_norm:
        shapes.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
        names.update(_QK_NORM_TENSORS)
    if c.sandwich_norms:
        shapes.update(post_attn_norm=(c.hidden_size,), post_mlp_norm=(c.hidden_size,))
        names.update(_SANDWICH_TENSORS)
    fused = _FUSED_TENSORS if arch == "phi3" else {}
    in_fused = {key for keys in fused.values() for key in keys}
    layout = {names[key]: ((key,), (shape,)) for key, shape in shapes.items()
              if key not in in_fused}
    layout.update({name: (keys, tuple(shapes[k] for k in keys)) for name, keys in fused.items()})
    return layout


def _shape(tensor: Any) -> tuple[int, ...]:
    """A tensor's shape as numpy sees it once dequantized (its raw data's shape counts the
    bytes of quantized blocks)."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def _dequantize(tensor: Any, expected: tuple[int, ...]) -> np.ndarray:
    try:
        w = gguf.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {tensor.name} has unsupported type "
                         f"{tensor.tensor_type.name}") from e
    w = np.array(w, dtype=np.float32)  # a copy: F32 tensors are views of the mapped file
    if w.shape != expected:
        raise ValueError(f"GGUF tensor {tensor.name} has shape {w.shape}, expected {expected}")
    return w


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _load_deepseek2(path: Path, metadata: dict[str, Any], tensors: dict[str, Any],
                    dtype: str) -> Model:
    """A deepseek2 file through the Hugging Face mapping (`kvjax.models.gguf_deepseek2`)."""
    config = config_from_metadata(metadata, tie_word_embeddings="output.weight" not in tensors,
                                  name=path.stem)
    arrays = {name: _dequantize(t, _shape(t))
              for name, t in tensors.items()}
    params = hf.params_from_hf(gguf_deepseek2.hf_tensors(arrays), config, dtype,
                               rope_interleaved=True, model_type="deepseek_v2")
    return Model(config=config, params=params, tokenizer=Tokenizer.from_gguf_metadata(metadata),
                 weights_version=f"sha256:{_file_digest(path)}", source=str(path))


def load_gguf(path: str | os.PathLike, dtype: str = "float32") -> Model:
    """Loads a GGUF file of a `SUPPORTED_ARCHITECTURES` architecture.

    Args:
      path: the .gguf file.
      dtype: 'float32', 'bfloat16' or 'float16': the dtype of every param after dequantization.

    Returns:
      A `Model` whose params follow `kvjax.models.llama`, with the GGUF's tokenizer and
      `weights_version` 'sha256:<digest of the file>'.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: not a GGUF file, an unsupported architecture, metadata key, rope scaling or
        tensor type, or tensors missing, unexpected or of the wrong shape (the message names it).
    """
    target = resolve_dtype(dtype)
    path = Path(path)
    reader = _open(path)
    metadata = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if metadata.get("general.architecture") == gguf_deepseek2.ARCH:
        return _load_deepseek2(path, metadata, tensors, dtype)
    rope_freqs = tensors.get("rope_freqs.weight")
    if rope_freqs is not None:
        rope_freqs = _dequantize(rope_freqs, _shape(rope_freqs))
    longrope = [name for name in _LONGROPE_TENSORS if name in tensors]
    if longrope and len(longrope) != len(_LONGROPE_TENSORS):
        raise ValueError(f"GGUF file {path} has {longrope} without "
                         f"{sorted(set(_LONGROPE_TENSORS) - set(longrope))}")
    longrope_factors = tuple(
        _dequantize(tensors[name], _shape(tensors[name]))
        for name in longrope) or None
    config = config_from_metadata(
        metadata, tie_word_embeddings="output.weight" not in tensors, name=path.stem,
        rope_freqs=rope_freqs, longrope_factors=longrope_factors)
    arch = metadata["general.architecture"]
    per_layer = _layer_tensors(config, arch)
    wanted = {"token_embd.weight", "output_norm.weight", *longrope}
    if rope_freqs is not None:
        wanted.add("rope_freqs.weight")
    if not config.tie_word_embeddings:
        wanted.add("output.weight")
    wanted |= {f"blk.{i}.{n}" for i in range(config.num_layers) for n in per_layer}
    missing = sorted(wanted - tensors.keys())
    if missing:
        raise ValueError(f"GGUF file {path} is missing tensor(s) {missing[:8]}")
    unexpected = sorted(tensors.keys() - wanted)
    if unexpected:
        raise ValueError(f"GGUF file {path} has tensor(s) kvjax does not support: {unexpected[:8]}")
    permute_qk = arch == "llama"

    def params_of(name: str) -> dict[str, jnp.ndarray]:
        """The params GGUF tensor blk.N.<name> holds, stacked over N ([L, in, out] for
        matrices: kvjax computes x @ W); one tensor name at a time bounds the host memory."""
        keys, shapes = per_layer[name]
        rows = [shape[0] for shape in shapes]
        parts: dict[str, list[np.ndarray]] = {key: [] for key in keys}
        for i in range(config.num_layers):
            w = _dequantize(tensors[f"blk.{i}.{name}"], (sum(rows), *shapes[0][1:]))
            for key, part in zip(keys, np.split(w, np.cumsum(rows)[:-1]), strict=True):
                if permute_qk and key in ("wq", "bq"):
                    part = _unpermute_rows(part, config.num_heads)
                elif permute_qk and key in ("wk", "bk"):
                    part = _unpermute_rows(part, config.num_kv_heads)
                elif config.norm_unit_offset and key.endswith("norm"):
                    part = part - 1.0  # llama.cpp stores Gemma's (1 + w)
                elif key == "shared_gate":
                    part = part[None]  # [H] -> one output row [1, H]
                parts[key].append(part if part.ndim == 1 else np.swapaxes(part, -1, -2))
        return {key: jnp.asarray(np.stack(p), target) for key, p in parts.items()}

    h, v = config.hidden_size, config.vocab_size
    layers = {key: w for name in per_layer for key, w in params_of(name).items()}
    final_norm = _dequantize(tensors["output_norm.weight"], (h,))
    params: dict[str, Any] = {
        "embed": jnp.asarray(_dequantize(tensors["token_embd.weight"], (v, h)), target),
        "final_norm": jnp.asarray(final_norm - 1.0 if config.norm_unit_offset else final_norm,
                                  target),
        "layers": layers,
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(_dequantize(tensors["output.weight"], (v, h)).T, target)
    llama.check_params(params, config)
    return Model(config=config, params=params, tokenizer=Tokenizer.from_gguf_metadata(metadata),
                 weights_version=f"sha256:{_file_digest(path)}", source=str(path))
