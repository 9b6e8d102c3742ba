"""Model loading: the embedded model, GGUF and HF checkpoints, dispatch, and bad inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from hf_utils import hf_logits, load_hf_model, make_tiny_hf_checkpoint
from safetensors.numpy import load_file, save_file

from kvjax.models import llama
from kvjax.models.gguf import config_from_metadata, load_gguf
from kvjax.models.hf import load_hf
from kvjax.models.loading import EMBEDDED_MODEL, embedded_model_path, load_model
from kvjax.models.rope import RoPE, RopeType

TINY_LOGITS_RTOL = 1e-5
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows: [heads, 2, D/2] -> [heads, D/2, 2]."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, w.shape[1])
            .swapaxes(1, 2).reshape(w.shape))


def _tiny_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """Byte-level tokens: the 256 byte letters, the special tokens, then merged letter pairs."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    letters = list(bytes_to_unicode().values())
    pairs = [(a, b) for a in "etaoinsr" for b in "hnrstlde"]
    merges = [f"{a} {b}" for a, b in pairs[: vocab_size - len(letters) - len(SPECIAL_TOKENS)]]
    return letters + SPECIAL_TOKENS + [m.replace(" ", "") for m in merges], merges


SPM_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def _tiny_spm_vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary as llama.cpp's converter writes Gemma's: control and unknown
    tokens, the 256 <0xXX> byte tokens, user-defined runs of real spaces, then pieces scored by
    rank (-index)."""
    letters = "etaoinsrhld"
    words = ["\u2581t", "\u2581r", "he", "th", "re", "st", "en", "ea", "\u2581re", "\u2581the",
             "\u2581then", "\u2581tea", "\u2581rest"]
    pieces = ["\u2581", *letters, *words]
    pieces += [a + b for a in letters for b in letters if a + b not in pieces]
    spaces = ["  ", "   ", "    "]
    tokens = [*SPM_SPECIAL_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), *spaces, *pieces]
    tokens = tokens[:vocab_size]
    types = [3, 3, 3, 2, *[6] * 256, 4, 4, 4, *[1] * (len(tokens) - 263)]
    scores = [0.0] * 260 + [-1000.0] * 3 + [-float(i) for i in range(len(tokens) - 263)]
    return tokens, scores, types


# config.json model_type -> llama.cpp architecture.
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
              "gemma3_text": "gemma3", "phi3": "phi3", "qwen2_moe": "qwen2moe",
              "qwen3_moe": "qwen3moe"}
_HF_TO_GGUF_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
# Gemma's four norms: its post_attention_layernorm is on the attention output.
_HF_TO_GGUF_GEMMA_NORMS = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _rope_theta(config: dict) -> float:
    """The RoPE base of the global layers (Gemma 3 keeps one per layer type)."""
    params = config["rope_parameters"]
    return params.get("full_attention", params)["rope_theta"]


def write_tiny_gguf(path: Path, hf_dir: Path, *, arch: str | None = None, drop: str | None = None,
                    replace: dict[str, np.ndarray] | None = None, pre: str = "smollm",
                    metadata: dict[str, object] | None = None, spm: bool = False) -> Path:
    """Converts a tiny HF checkpoint to GGUF the way llama.cpp lays it out (F32 tensors): llama's
    Q/K rows permuted for its pairwise RoPE (Qwen's and Gemma's rotate halves, unpermuted),
    Gemma's RMSNorm weights stored as (1 + w), no output.weight when the embedding is tied;
    Phi-3's original context length, and for LongRoPE its factor tensors and attention factor.
    `metadata` adds or replaces `<arch>.<key>` values; `spm` writes a SentencePiece tokenizer
    without a prefix space (Gemma's) instead of byte-level BPE."""
    config = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(hf_dir / "model.safetensors")
    model_type = config["model_type"]
    arch = arch or _GGUF_ARCH[model_type]
    is_gemma = model_type.startswith("gemma")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = {**_HF_TO_GGUF_LAYER, **(_HF_TO_GGUF_GEMMA_NORMS if is_gemma else {})}
    shift = 1.0 if is_gemma else 0.0
    tensors = {"token_embd.weight": hf["model.embed_tokens.weight"],
               "output_norm.weight": hf["model.norm.weight"] + shift}
    if not config.get("tie_word_embeddings"):
        tensors["output.weight"] = hf["lm_head.weight"]
    for i in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in names.items():
            if f"model.layers.{i}.{hf_name}" not in hf:
                continue
            w = hf[f"model.layers.{i}.{hf_name}"]
            if model_type in ("llama", "mixtral") and gguf_name == "attn_q.weight":
                w = _llama_cpp_permute(w, heads)
            elif model_type in ("llama", "mixtral") and gguf_name == "attn_k.weight":
                w = _llama_cpp_permute(w, kv_heads)
            elif gguf_name.endswith("norm.weight"):
                w = w + shift
            tensors[f"blk.{i}.{gguf_name}"] = w
    rope = config["rope_parameters"].get("full_attention", config["rope_parameters"])
    if rope.get("rope_type") == "longrope":  # Phi-3's factors [D/2], outside the blocks
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"])
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"])
    tensors.update(replace or {})
    tensors.pop(drop, None)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(_rope_theta(config))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if model_type == "phi3":
        original = config.get("original_max_position_embeddings",
                              rope.get("original_max_position_embeddings",
                                       config["max_position_embeddings"]))
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":  # no scaling type: the factor tensors say it
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if is_gemma:
        writer.add_sliding_window(config["sliding_window"])
    for key, hf_key in (("attn_logit_softcapping", "attn_logit_softcapping"),
                        ("final_logit_softcapping", "final_logit_softcapping")):
        if config.get(hf_key) is not None:
            writer.add_float32(f"{arch}.{key}", config[hf_key])
    for key, value in (metadata or {}).items():
        writer.add_key_value(f"{arch}.{key}", value, _gguf_value_type(value))
    _finish_gguf(writer, config, tensors, pre=pre, spm=spm)
    return path


def _finish_gguf(writer: gguf.GGUFWriter, config: dict, tensors: dict[str, np.ndarray], *,
                 pre: str = "smollm", spm: bool = False, q8_0: bool = False) -> None:
    """Adds the tiny tokenizer (`write_tiny_gguf`) and the tensors (F32; with `q8_0`, the
    matrices whose rows are whole Q8_0 blocks in Q8_0), and writes the file."""
    tokens, merges = _tiny_vocab(config["vocab_size"])
    if spm:
        tokens, scores, types = _tiny_spm_vocab(config["vocab_size"])
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(False)
        writer.add_bos_token_id(tokens.index("<bos>"))
        writer.add_eos_token_id(tokens.index("<eos>"))
        writer.add_unk_token_id(tokens.index("<unk>"))
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(tokens.index("<|im_start|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(0)  # transformers' Phi-3 default (32000) lies outside the vocabulary
    for name, w in tensors.items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if q8_0 and w.ndim > 1 and w.shape[-1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_value_type(value: object) -> gguf.GGUFValueType:
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    return make_tiny_hf_checkpoint(tmp_path, "llama", seed=11, rope_theta=1000.0)


def _logits(model, tokens: list[int]) -> np.ndarray:
    return np.asarray(llama.forward_dense(model.params, model.config, jnp.asarray(tokens)))


def _rel_max_diff(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


# --- the embedded model --------------------------------------------------------------------

def test_embedded_model_path_is_the_packaged_gguf():
    path = embedded_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_embedded_config_is_smollm2_135m(embedded_model):
    # The published config.json of HuggingFaceTB/SmolLM2-135M-Instruct.
    c = embedded_model.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        49152, 576, 1536, 30)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.rope == RoPE(theta=100000.0)
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and "lm_head" not in embedded_model.params
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert embedded_model.tokenizer.token_to_id("<|im_end|>") == 2
    assert embedded_model.dtype == jnp.float32
    assert embedded_model.weights_version.startswith("sha256:")


# --- GGUF ------------------------------------------------------------------------------------

def test_tiny_gguf_logits_match_hf_source_checkpoint(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama)
    model = load_model(path)
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, 20).tolist()
    assert _rel_max_diff(_logits(model, tokens), hf_logits(tiny_llama, tokens)) <= TINY_LOGITS_RTOL
    assert model.config.num_kv_heads == 2 and not model.config.tie_word_embeddings
    assert model.source == str(path)
    tokenizer = model.tokenizer
    assert tokenizer.encode("<|im_start|>the", add_bos=True) == [
        tokenizer.bos_token_id, tokenizer.bos_token_id, tokenizer.token_to_id("th"),
        tokenizer.token_to_id("e")]


def test_gguf_bfloat16_params_are_the_rounded_float32_params(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama)
    full, half = load_gguf(path), load_gguf(path, dtype="bfloat16")
    assert half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(half.params["layers"]["wq"]),
                                  np.asarray(full.params["layers"]["wq"].astype(jnp.bfloat16)))


def test_gguf_unsupported_architecture(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_gguf(path)


def test_gguf_missing_tensor(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, drop="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"missing tensor.*blk\.1\.ffn_up\.weight"):
        load_gguf(path)


def test_gguf_wrong_shape(tmp_path, tiny_llama):
    bad = {"blk.0.attn_k.weight": np.zeros((16, 64), np.float32)}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, replace=bad)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_k\.weight has shape \(16, 64\)"):
        load_gguf(path)


def test_gguf_unknown_tensor(tmp_path, tiny_llama):
    extra = {"blk.0.attn_output.bias": np.zeros((64,), np.float32)}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, replace=extra)
    with pytest.raises(ValueError, match=r"does not support.*blk\.0\.attn_output\.bias"):
        load_gguf(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("definitely not a GGUF file, just some text long enough to parse")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(path)


# --- HF checkpoints ------------------------------------------------------------------------

def _edit_config(directory: Path, **changes) -> None:
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def _edit_tensors(directory: Path, *, drop: str | None = None,
                  replace: dict[str, np.ndarray] | None = None) -> None:
    tensors = load_file(directory / "model.safetensors")
    tensors.pop(drop, None)
    tensors.update(replace or {})
    save_file(tensors, directory / "model.safetensors")


def test_hf_unsupported_model_type(tiny_llama):
    _edit_config(tiny_llama, model_type="gpt2")
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*'llama', 'mistral', 'qwen2'"):
        load_hf(tiny_llama)


def test_hf_missing_tensor(tiny_llama):
    _edit_tensors(tiny_llama, drop="model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.down_proj"):
        load_model(tiny_llama)


def test_hf_wrong_shape(tiny_llama):
    _edit_tensors(tiny_llama, replace={"model.layers.0.self_attn.v_proj.weight": np.zeros((8, 64))})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.v_proj\.weight has shape"):
        load_hf(tiny_llama)


def test_hf_unknown_tensor(tiny_llama):
    _edit_tensors(tiny_llama, replace={"model.layers.0.self_attn.o_proj.bias": np.zeros((64,))})
    with pytest.raises(ValueError, match=r"does not support.*o_proj\.bias"):
        load_hf(tiny_llama)


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
     "rope_type 'llama3' needs 'low_freq_factor'"),
    (dict(rope_scaling={"type": "ntk-by-parts", "factor": 2.0}), "rope_type 'ntk-by-parts'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}, partial_rotary_factor=0.5),
     "partial_rotary_factor"),
    (dict(num_local_experts=8), "mixture-of-experts"),
    (dict(model_type="qwen2", num_experts=4), "mixture-of-experts"),
    (dict(model_type="qwen3", layer_types=["sliding_attention", "full_attention"]),
     "sliding-window"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(model_type="qwen2", use_sliding_window=True, max_window_layers=0), "sliding-window"),
])
def test_hf_unsupported_features(tiny_llama, changes, message):
    _edit_config(tiny_llama, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf(tiny_llama)


def test_sliding_windows_become_layer_windows(tmp_path):
    """Mistral windows every layer; Qwen2/Qwen3 the layers from max_window_layers on; neither
    caps the context at the window."""
    mistral = load_hf(make_tiny_hf_checkpoint(tmp_path / "m", "mistral", sliding_window=64))
    assert mistral.config.layer_windows == (64, 64)
    assert mistral.config.max_position_embeddings > 64
    qwen = load_hf(make_tiny_hf_checkpoint(tmp_path / "q", "qwen2", use_sliding_window=True,
                                           sliding_window=16, max_window_layers=1))
    assert qwen.config.layer_windows == (0, 16)
    assert [g.num_keep_tokens for g in qwen.config.kv_layer_groups()] == [0, 16]


def test_hf_without_weights(tiny_llama):
    (tiny_llama / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf(tiny_llama)


def test_weights_version_follows_the_weights(tmp_path):
    first = make_tiny_hf_checkpoint(tmp_path / "a", "llama", seed=0)
    same = make_tiny_hf_checkpoint(tmp_path / "b", "llama", seed=0)
    other = make_tiny_hf_checkpoint(tmp_path / "c", "llama", seed=1)
    versions = [load_hf(d).weights_version for d in (first, same, other)]
    assert versions[0] == versions[1] != versions[2]


def test_load_model_reads_from_disk_every_time(tmp_path):
    directory = make_tiny_hf_checkpoint(tmp_path, "llama", seed=0)
    before = load_model(directory)
    _edit_tensors(directory, replace={"model.norm.weight": np.full((64,), 3.0, np.float32)})
    after = load_model(directory)
    np.testing.assert_array_equal(np.asarray(after.params["final_norm"]), 3.0)
    assert not np.array_equal(np.asarray(before.params["final_norm"]), 3.0)
    assert before.weights_version != after.weights_version


# --- load_model dispatch -------------------------------------------------------------------

def test_load_model_unknown_name():
    with pytest.raises(ValueError, match=f"unknown model 'gpt-5'.*{EMBEDDED_MODEL}"):
        load_model("gpt-5")


@pytest.mark.parametrize("name", ["missing.gguf", "no/such/dir"])
def test_load_model_missing_path(tmp_path, name):
    with pytest.raises(FileNotFoundError, match="no model file or directory"):
        load_model(tmp_path / name)


def test_load_model_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


def test_load_model_unknown_dtype(tiny_llama):
    with pytest.raises(ValueError, match="'int8'"):
        load_model(tiny_llama, dtype="int8")


def test_llama3_gguf_rope_freqs_give_the_hf_llama3_logits(tmp_path):
    """A Llama 3.x GGUF carries its RoPE frequency bands as the `rope_freqs` tensor (divisors
    of the base frequencies), not as parameters: loaded, the logits equal transformers' on the
    source checkpoint with rope_type llama3; the Llama 3 pre-tokenizer ('llama-bpe') splits
    text as transformers' conversion of the same GGUF does."""
    import torch  # noqa: F401  (transformers' model below)
    import transformers

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    hf_dir = make_tiny_hf_checkpoint(tmp_path, "llama", seed=5, rope_parameters=rope,
                                     max_position_embeddings=128)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    head_dim = hf_model.config.hidden_size // hf_model.config.num_attention_heads
    base = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    factors = (base / hf_model.model.rotary_emb.inv_freq.double().numpy()).astype(np.float32)
    assert factors.max() > 1.5  # the bands do divide some frequencies
    path = write_tiny_gguf(tmp_path / "llama3.gguf", hf_dir, pre="llama-bpe",
                           replace={"rope_freqs.weight": factors})
    model = load_gguf(path)
    assert model.config.rope.rope_type is RopeType.FREQ_FACTORS
    tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, 60).tolist()
    assert _rel_max_diff(_logits(model, tokens), hf_logits(hf_model, tokens)) <= 1e-4
    plain = write_tiny_gguf(tmp_path / "plain.gguf", hf_dir)  # no rope_freqs: other logits
    assert _rel_max_diff(_logits(load_gguf(plain), tokens), hf_logits(hf_model, tokens)) > 1e-3
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="llama3.gguf")
    gpt2 = load_gguf(write_tiny_gguf(tmp_path / "gpt2.gguf", hf_dir, pre="gpt-2")).tokenizer
    for text in ("the other'S 12345 tea!!\n\n  then", "it'll   rest\tend 7 88 999 1000"):
        splits = model.tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)
        assert splits == reference.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert splits != gpt2.backend.pre_tokenizer.pre_tokenize_str(text)
        assert model.tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)


def _transformers_gguf_logits(path: Path, tokens: list[int], **config_overrides) -> np.ndarray:
    """Logits of transformers' own GGUF loader (which knows llama.cpp's layout) on `path`."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **config_overrides).eval()
    return hf_logits(model, tokens)


@pytest.mark.parametrize("model_type, overrides", [
    ("qwen2", dict(tie_word_embeddings=True)),
    ("qwen3", dict(head_dim=128)),  # != hidden / heads: read from attention.key_length
])
def test_qwen_gguf_logits_match_hf_and_transformers_gguf(tmp_path, model_type, overrides):
    """Qwen2 (Q/K/V biases) and Qwen3 (per-head Q/K norms) GGUF files, laid out as llama.cpp's
    converter writes them (NEOX rotation: Q/K rows unpermuted): the logits equal transformers'
    on the source checkpoint and transformers' own loading of the same GGUF file; the 'qwen2'
    pre-tokenizer splits and encodes text as transformers' GGUF tokenizer does."""
    import transformers

    hf_dir = make_tiny_hf_checkpoint(tmp_path, model_type, seed=3, **overrides)
    path = write_tiny_gguf(tmp_path / f"{model_type}.gguf", hf_dir, pre="qwen2")
    model = load_gguf(path)
    assert model.config.qkv_bias == (model_type == "qwen2")
    assert model.config.qk_norm == (model_type == "qwen3")
    tokens = np.random.default_rng(4).integers(0, model.config.vocab_size, 24).tolist()
    got = _logits(model, tokens)
    assert _rel_max_diff(got, hf_logits(hf_dir, tokens)) <= TINY_LOGITS_RTOL
    assert _rel_max_diff(got, _transformers_gguf_logits(path, tokens)) <= TINY_LOGITS_RTOL
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("the other'S 12345 tea!!\n\n  then", "it'll   rest\tend 7 88 999 1000"):
        splits = model.tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)
        assert splits == reference.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert model.tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)
    splits = model.tokenizer.backend.pre_tokenizer.pre_tokenize_str("rest 12345")
    assert [piece for piece, _ in splits[-5:]] == list("12345")  # llama-bpe: '123', '45'


# Gemma soft caps small enough to bite on a tiny random model; windows shorter than the test;
# Gemma 3's global layers with linear RoPE scaling (as its 4B to 27B models), local ones without.
_GEMMA_OVERRIDES = {
    "gemma2": dict(sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   tie_word_embeddings=True),
    "gemma3_text": dict(
        num_hidden_layers=6, sliding_window=8, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
# What transformers' GGUF loader does not read from the file, told to it by the test.
_UNREAD_BY_TRANSFORMERS = ("attn_logit_softcapping", "final_logit_softcapping", "rope_parameters")


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_gguf_logits_match_hf_and_transformers_gguf(tmp_path, model_type):
    """Gemma 2 / Gemma 3 GGUF files (norms stored as 1 + w, no Q/K permutation, tied
    embedding): the soft caps and the window come from the metadata, the windowed layers and
    Gemma 3's local RoPE base follow llama.cpp's fixed patterns, its linear RoPE scaling applies
    to the global layers only; the logits equal transformers' on the source checkpoint and
    transformers' own loading of the same GGUF file (told the soft caps and the RoPE, which its
    GGUF loader does not read)."""
    overrides = _GEMMA_OVERRIDES[model_type]
    hf_dir = make_tiny_hf_checkpoint(tmp_path, model_type, seed=6, **overrides)
    path = write_tiny_gguf(tmp_path / f"{model_type}.gguf", hf_dir, spm=True)
    model = load_gguf(path)
    c = model.config
    assert c.tie_word_embeddings and c.norm_unit_offset and c.sandwich_norms
    if model_type == "gemma2":
        assert (c.attn_logit_softcap, c.final_logit_softcap) == (5.0, 3.0)
        assert c.layer_windows == (8, 0)
    else:
        assert c.layer_windows == (8, 8, 8, 8, 8, 0)
        assert c.local_rope == RoPE(theta=10000.0)
        assert c.rope == RoPE(RopeType.LINEAR, theta=1e6, factor=4.0)
    tokens = np.random.default_rng(7).integers(0, c.vocab_size, 24).tolist()
    got = _logits(model, tokens)
    assert _rel_max_diff(got, hf_logits(hf_dir, tokens)) <= TINY_LOGITS_RTOL
    told = {k: v for k, v in overrides.items() if k in _UNREAD_BY_TRANSFORMERS}
    assert _rel_max_diff(got, _transformers_gguf_logits(path, tokens, **told)) <= TINY_LOGITS_RTOL


def test_sentencepiece_gguf_tokenizer_matches_transformers_gguf_tokenizer(tmp_path):
    """Gemma's GGUF tokenizer (`tokenizer.ggml.model` 'llama': SentencePiece pieces merged by
    score, spaces as U+2581 with no prefix space, <0xXX> byte fallback, control tokens whole):
    ids and decoded text as transformers' tokenizer built from the same file."""
    import transformers

    hf_dir = make_tiny_hf_checkpoint(tmp_path, "gemma2", seed=0)
    path = write_tiny_gguf(tmp_path / "spm.gguf", hf_dir, spm=True)
    tokenizer = load_gguf(path).tokenizer
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = ("the rest then tea", " then  the\nrest é!", "<bos>tea<eos> rest", "thththe  ",
             "tea   the    rest")
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    ids = tokenizer.encode("the rest é")  # 'he' scores above 'th'; 'é' is not a piece
    assert [tokenizer.backend.id_to_token(i) for i in ids] == [
        "t", "he", "\u2581rest", "\u2581", "<0xC3>", "<0xA9>"]
    assert tokenizer.encode("<bos>", add_bos=True) == [2, 2]
    assert tokenizer.token_to_id("   ") in tokenizer.encode("tea   rest")  # stored as spaces


@pytest.mark.parametrize("model_type, metadata, message", [
    ("llama", {"rope.scaling.type": "yarn"}, "llama.rope.scaling.type 'yarn'"),
    ("qwen2", {"expert_count": 8}, "qwen2.expert_count"),
    ("gemma2", {"attention.sliding_window_pattern": 3}, "gemma2.attention.sliding_window_pattern"),
])
def test_gguf_refuses_metadata_it_cannot_apply(tmp_path, model_type, metadata, message):
    hf_dir = make_tiny_hf_checkpoint(tmp_path, model_type, seed=0)
    path = write_tiny_gguf(tmp_path / "bad.gguf", hf_dir, metadata=metadata)
    with pytest.raises(ValueError, match=message):
        load_gguf(path)


def test_phi3_gguf_logits_match_hf_and_transformers_gguf(tmp_path):
    """A Phi-3 GGUF keeps the fused attn_qkv and gate-up ffn_up matrices (NEOX rotation: rows
    unpermuted): split on loading, the logits equal transformers' on the source checkpoint and
    transformers' own loading of the same file."""
    hf_dir = make_tiny_hf_checkpoint(tmp_path, "phi3", seed=8)
    path = write_tiny_gguf(tmp_path / "phi3.gguf", hf_dir)
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= {
        t.name for t in gguf.GGUFReader(path).tensors}
    model = load_gguf(path)
    tokens = np.random.default_rng(9).integers(0, model.config.vocab_size, 24).tolist()
    got = _logits(model, tokens)
    assert _rel_max_diff(got, hf_logits(hf_dir, tokens)) <= TINY_LOGITS_RTOL
    assert _rel_max_diff(got, _transformers_gguf_logits(path, tokens)) <= TINY_LOGITS_RTOL


_PHI3_ORIGINAL_LEN = 16  # where the LongRoPE case switches from short to long factors
_PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
                  "short_factor": [1.0 + 0.05 * i for i in range(8)],
                  "long_factor": [1.0 + 0.8 * i for i in range(8)]}


def _hf_cached_logits(hf_model, tokens: list[int], prompt_len: int) -> np.ndarray:
    """Logits at positions prompt_len - 1 .. T - 1 of transformers fed the prompt in one pass,
    then one token at a time over its own KV cache (how it generates: each step's LongRoPE
    factors chosen by the length so far)."""
    import torch

    rows, past = [], None
    with torch.no_grad():
        for chunk in [tokens[:prompt_len], *([t] for t in tokens[prompt_len:])]:
            out = hf_model(input_ids=torch.tensor([chunk]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            rows.append(out.logits[0, -1].numpy())
    return np.stack(rows)  # [T - prompt_len + 1, V]: from position prompt_len - 1 on


def test_phi3_longrope_gguf_logits_match_hf_below_and_above_the_original_length(tmp_path):
    """A Phi-3-128k-style GGUF (rope_factors_short / rope_factors_long, the original context
    length and attention factor in metadata) loads as LongRoPE with transformers' semantics: below
    the original length the logits equal transformers' one pass on the source checkpoint; past it
    (short factors up to the original length, long ones beyond) they equal transformers' cached
    generation, step by step."""
    hf_dir = make_tiny_hf_checkpoint(tmp_path, "phi3", seed=8, rope_parameters=_PHI3_LONGROPE,
                                     original_max_position_embeddings=_PHI3_ORIGINAL_LEN)
    path = write_tiny_gguf(tmp_path / "longrope.gguf", hf_dir)
    model = load_gguf(path)
    rope, hf_rope = model.config.rope, load_hf(hf_dir).config.rope
    assert (rope.rope_type, rope.original_max_position_embeddings, rope.factor) == (
        RopeType.LONGROPE, _PHI3_ORIGINAL_LEN, hf_rope.factor)
    np.testing.assert_allclose(rope.attention_factor, hf_rope.attention_factor, rtol=1e-6)
    hf_model = load_hf_model(hf_dir)
    tokens = np.random.default_rng(9).integers(0, model.config.vocab_size, 28).tolist()
    got = _logits(model, tokens)
    below = _PHI3_ORIGINAL_LEN - 4
    assert _rel_max_diff(got[:below], hf_logits(hf_model, tokens[:below])) <= TINY_LOGITS_RTOL
    cached = _hf_cached_logits(hf_model, tokens, below)
    assert _rel_max_diff(got[below - 1:], cached) <= TINY_LOGITS_RTOL
    # The long factors matter: transformers' one pass over all 28 (long factors throughout)
    # differs from kvjax's short-then-long positions.
    assert _rel_max_diff(got, hf_logits(hf_model, tokens)) > 1e-3


def test_gguf_longrope_factors_need_each_other_and_phi3(tmp_path):
    hf_dir = make_tiny_hf_checkpoint(tmp_path, "phi3", seed=8, rope_parameters=_PHI3_LONGROPE,
                                     original_max_position_embeddings=_PHI3_ORIGINAL_LEN)
    half = write_tiny_gguf(tmp_path / "half.gguf", hf_dir, drop="rope_factors_short.weight")
    with pytest.raises(ValueError, match=r"rope_factors_short\.weight"):
        load_gguf(half)
    short = {"rope_factors_short.weight": np.ones((4,), np.float32),
             "rope_factors_long.weight": np.ones((4,), np.float32)}
    with pytest.raises(ValueError, match="head dim 16 needs"):
        load_gguf(write_tiny_gguf(tmp_path / "short.gguf", hf_dir, replace=short))
    llama_dir = make_tiny_hf_checkpoint(tmp_path, "llama", seed=0)
    factors = {name: np.ones((8,), np.float32) for name in short}
    with pytest.raises(ValueError, match="phi3 only"):
        load_gguf(write_tiny_gguf(tmp_path / "llama.gguf", llama_dir, replace=factors))


def test_mixtral_gguf_logits_match_hf(tmp_path):
    """Mixtral as llama.cpp writes it (arch llama with expert_count; the router ffn_gate_inp,
    experts stacked in ffn_gate_exps / ffn_up_exps / ffn_down_exps): the logits equal
    transformers' on the source checkpoint."""
    hf_dir = make_tiny_hf_checkpoint(tmp_path, "mixtral", seed=8, num_local_experts=4,
                                     num_experts_per_tok=2, intermediate_size=48)
    hf = load_file(hf_dir / "model.safetensors")
    experts = {}
    for i in range(2):
        moe = f"model.layers.{i}.block_sparse_moe"
        experts[f"blk.{i}.ffn_gate_inp.weight"] = hf[f"{moe}.gate.weight"]  # [E, H]
        for gguf_name, hf_name in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            experts[f"blk.{i}.ffn_{gguf_name}_exps.weight"] = np.stack(
                [hf[f"{moe}.experts.{e}.{hf_name}.weight"] for e in range(4)])
    path = write_tiny_gguf(tmp_path / "mixtral.gguf", hf_dir, arch="llama", replace=experts,
                           metadata={"expert_count": 4, "expert_used_count": 2})
    model = load_gguf(path)
    assert model.config.moe.num_experts == 4 and model.config.moe.expert_size == 48
    tokens = np.random.default_rng(9).integers(0, model.config.vocab_size, 24).tolist()
    assert _rel_max_diff(_logits(model, tokens), hf_logits(hf_dir, tokens)) <= TINY_LOGITS_RTOL


def _qwen_moe_gguf(tmp_path: Path, hf_dir: Path, **metadata) -> Path:
    """A qwen2moe / qwen3moe GGUF of `hf_dir` as llama.cpp's converter lays it out: the router
    ffn_gate_inp, the experts stacked [E, out, in], Qwen2-MoE's shared expert ffn_*_shexp and
    its gate ffn_gate_inp_shexp as a vector [H], the expert sizes as metadata."""
    config = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(hf_dir / "model.safetensors")
    num_experts = config.get("num_experts") or config["num_local_experts"]  # Qwen3-MoE: the latter
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        mlp = f"model.layers.{i}.mlp"
        tensors[f"blk.{i}.ffn_gate_inp.weight"] = hf[f"{mlp}.gate.weight"]  # [E, H]
        for name in ("gate", "up", "down"):
            tensors[f"blk.{i}.ffn_{name}_exps.weight"] = np.stack(
                [hf[f"{mlp}.experts.{e}.{name}_proj.weight"] for e in range(num_experts)])
            if f"{mlp}.shared_expert.{name}_proj.weight" in hf:
                tensors[f"blk.{i}.ffn_{name}_shexp.weight"] = hf[
                    f"{mlp}.shared_expert.{name}_proj.weight"]
        if f"{mlp}.shared_expert_gate.weight" in hf:
            tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"] = hf[
                f"{mlp}.shared_expert_gate.weight"][0]
    sizes = {"expert_count": num_experts, "expert_used_count": config["num_experts_per_tok"],
             "expert_feed_forward_length": config["moe_intermediate_size"]}
    if config.get("shared_expert_intermediate_size"):
        sizes["expert_shared_feed_forward_length"] = config["shared_expert_intermediate_size"]
    return write_tiny_gguf(tmp_path / f"{config['model_type']}.gguf", hf_dir, pre="qwen2",
                           replace=tensors, metadata={**sizes, **metadata})


# model_type -> (HF overrides, transformers' GGUF config overrides: its qwen2moe / qwen3moe
# mapping reads neither expert size, and llama.cpp renormalizes Qwen3-MoE's top-k weights).
_QWEN_MOE = {
    "qwen2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=False),
                  dict(moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "qwen3_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, head_dim=16),
                  dict(moe_intermediate_size=32, norm_topk_prob=True)),
}


@pytest.mark.parametrize("model_type", sorted(_QWEN_MOE))
def test_qwen_moe_gguf_logits_match_hf_and_transformers_gguf(tmp_path, model_type):
    """qwen2moe (a gated shared expert, top-k weights as they are) and qwen3moe (Q/K norms,
    renormalized top-k weights) GGUF files: over 64 tokens (the experts run grouped) the logits
    equal transformers' on the source checkpoint and transformers' own loading of the file."""
    hf_overrides, gguf_overrides = _QWEN_MOE[model_type]
    hf_dir = make_tiny_hf_checkpoint(tmp_path, model_type, seed=5, **hf_overrides)
    path = _qwen_moe_gguf(tmp_path, hf_dir)
    model = load_gguf(path)
    m = model.config.moe
    assert (m.num_experts, m.num_experts_per_tok, m.expert_size) == (4, 2, 32)
    assert (m.shared_size, m.shared_gate, m.norm_topk_prob) == (
        (48, True, False) if model_type == "qwen2_moe" else (0, False, True))
    tokens = np.random.default_rng(4).integers(0, model.config.vocab_size, 64).tolist()
    got = _logits(model, tokens)
    assert _rel_max_diff(got, hf_logits(hf_dir, tokens)) <= TINY_LOGITS_RTOL
    assert _rel_max_diff(got, _transformers_gguf_logits(path, tokens, **gguf_overrides)
                         ) <= TINY_LOGITS_RTOL


def test_qwen_moe_gguf_refuses_routing_it_does_not_read(tmp_path):
    hf_dir = make_tiny_hf_checkpoint(tmp_path, "qwen3_moe", seed=5, **_QWEN_MOE["qwen3_moe"][0])
    with pytest.raises(ValueError, match="qwen3moe.expert_gating_func=2"):
        load_gguf(_qwen_moe_gguf(tmp_path, hf_dir, expert_gating_func=2))


def _metadata(arch: str, **keys) -> dict:
    """GGUF metadata of a Gemma-27B-shaped or small model: `keys` are `<arch>.<key>` values."""
    base = {"embedding_length": 64, "attention.head_count": 4, "attention.key_length": 32,
            "block_count": 6, "feed_forward_length": 128, "context_length": 256,
            "attention.layer_norm_rms_epsilon": 1e-6}
    return {"general.architecture": arch, "tokenizer.ggml.tokens": ["a", "b"],
            **{f"{arch}.{k}": v for k, v in {**base, **keys}.items()}}


def test_gguf_applies_what_llama_cpp_fixes_in_code():
    """What llama.cpp's loader sets by architecture rather than reading from the file: Gemma 2's
    soft caps default to 50 / 30 and its window is required; Gemma 3 without a window has only
    global layers; the 27B block counts scale queries by hidden / heads instead of the head dim;
    Phi-3's window is disabled."""
    gemma2 = config_from_metadata(_metadata("gemma2", **{"attention.sliding_window": 4}),
                                  tie_word_embeddings=True)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.layer_windows == (4, 0, 4, 0, 4, 0) and gemma2.query_pre_attn_scalar == 32
    with pytest.raises(ValueError, match="gemma2.attention.sliding_window"):
        config_from_metadata(_metadata("gemma2"), tie_word_embeddings=True)
    big = config_from_metadata(_metadata("gemma2", block_count=46, **{
        "attention.sliding_window": 4}), tie_word_embeddings=True)
    assert big.query_pre_attn_scalar == 64 / 4
    gemma3 = config_from_metadata(_metadata("gemma3"), tie_word_embeddings=True)
    assert gemma3.layer_windows == () and gemma3.local_rope is None
    assert (gemma3.attn_logit_softcap, gemma3.final_logit_softcap) == (None, None)
    big3 = config_from_metadata(_metadata("gemma3", block_count=62), tie_word_embeddings=True)
    assert big3.query_pre_attn_scalar == 64 / 4
    phi3 = config_from_metadata(_metadata("phi3", **{"attention.sliding_window": 8}),
                                tie_word_embeddings=False)
    assert phi3.layer_windows == ()


_DEEPSEEK_V2 = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                    num_key_value_heads=4, q_lora_rank=24, first_k_dense_replace=1,
                    n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                    n_shared_experts=2, topk_method="group_limited_greedy", n_group=4,
                    topk_group=2, routed_scaling_factor=1.5)
# DeepSeek-V2's HF names (inside model.layers.N.) -> llama.cpp's deepseek2 names (blk.N.).
_HF_TO_GGUF_DEEPSEEK2 = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def write_deepseek2_gguf(path: Path, hf_dir: Path, *, split_kv_b: bool = True,
                         metadata: dict[str, object] | None = None,
                         extra: dict[str, np.ndarray] | None = None, q8_0: bool = False
                         ) -> Path:
    """A tiny DeepSeek-V2 checkpoint as llama.cpp's converter writes deepseek2 (F32): tensors
    renamed, rows unpermuted (its RoPE turns adjacent pairs, as DeepSeek's), experts stacked
    [E, out, in], kv_b_proj split per head into attn_k_b [N, d_c, d_nope] (transposed) and
    attn_v_b [N, d_v, d_c] (`split_kv_b`, newer files) or kept as attn_kv_b (older ones); the
    key / value lengths of the latent, with the heads' own as key_length_mla / value_length_mla;
    head_count_kv 1 (MLA as MQA). `metadata` adds deepseek2.<key> values, `extra` tensors."""
    config = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(hf_dir / "model.safetensors")
    heads, nope, v_dim = (config[k] for k in ("num_attention_heads", "qk_nope_head_dim",
                                               "v_head_dim"))
    tensors = {"token_embd.weight": hf["model.embed_tokens.weight"],
               "output_norm.weight": hf["model.norm.weight"], "output.weight": hf["lm_head.weight"]}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        for hf_name, gguf_name in _HF_TO_GGUF_DEEPSEEK2.items():
            if layer + hf_name in hf:
                tensors[f"blk.{i}.{gguf_name}"] = hf[layer + hf_name]
        if layer + "mlp.experts.0.gate_proj.weight" in hf:
            for part in ("gate", "up", "down"):
                tensors[f"blk.{i}.ffn_{part}_exps.weight"] = np.stack([
                    hf[f"{layer}mlp.experts.{e}.{part}_proj.weight"]
                    for e in range(config["n_routed_experts"])])
        kv_b = hf[layer + "self_attn.kv_b_proj.weight"]  # [N * (d_nope + d_v), d_c]
        if split_kv_b:
            per_head = kv_b.reshape(heads, nope + v_dim, -1)
            tensors[f"blk.{i}.attn_k_b.weight"] = per_head[:, :nope].swapaxes(1, 2)
            tensors[f"blk.{i}.attn_v_b.weight"] = per_head[:, nope:]
        else:
            tensors[f"blk.{i}.attn_kv_b.weight"] = kv_b
    tensors.update(extra or {})
    writer = gguf.GGUFWriter(path, "deepseek2")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(config["kv_lora_rank"])
    writer.add_key_length(config["kv_lora_rank"] + config["qk_rope_head_dim"])
    writer.add_value_length(config["kv_lora_rank"])
    writer.add_key_length_mla(nope + config["qk_rope_head_dim"])
    writer.add_value_length_mla(v_dim)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if config.get("n_group"):
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
    writer.add_rope_dimension_count(config["qk_rope_head_dim"])
    rope = config["rope_parameters"]
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    for key, value in (metadata or {}).items():
        writer.add_key_value(f"deepseek2.{key}", value, _gguf_value_type(value))
    _finish_gguf(writer, config, tensors, q8_0=q8_0)
    return path


@pytest.mark.parametrize("split_kv_b", [True, False])
def test_deepseek2_gguf_logits_match_hf(tmp_path, split_kv_b):
    """DeepSeek-V2 (MLA with a low-rank query, a dense first layer, then grouped routing over 8
    experts with two shared ones, scaled) converted to deepseek2 as llama.cpp writes it, kv_b_proj
    split per head (newer files) or whole: the logits equal transformers' on the source
    checkpoint; with its matrices in Q8_0 they stay close (quantization error only)."""
    hf_dir = make_tiny_hf_checkpoint(tmp_path, "deepseek_v2", seed=4, **_DEEPSEEK_V2)
    path = write_deepseek2_gguf(tmp_path / "deepseek2.gguf", hf_dir, split_kv_b=split_kv_b)
    model = load_gguf(path)
    assert model.config.mla is not None and model.config.moe.dense_layers == (0,)
    tokens = np.random.default_rng(5).integers(0, model.config.vocab_size, 24).tolist()
    reference = hf_logits(hf_dir, tokens)
    assert _rel_max_diff(_logits(model, tokens), reference) <= 2e-5
    if split_kv_b:
        q8 = load_gguf(write_deepseek2_gguf(tmp_path / "q8.gguf", hf_dir, q8_0=True))
        assert 1e-4 < _rel_max_diff(_logits(q8, tokens), reference) < 5e-2


def test_deepseek2_gguf_with_yarn_logits_match_hf(tmp_path):
    """DeepSeek-V2-Lite's RoPE: YaRN with mscale = mscale_all_dim (the softmax scale grows with
    the factor), stored as the scaling keys and yarn_log_multiplier; 80 tokens run past the
    original length of 64."""
    yarn = dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707,
                beta_fast=32, beta_slow=1)
    overrides = {**_DEEPSEEK_V2, "q_lora_rank": None, "rope_parameters": yarn}
    hf_dir = make_tiny_hf_checkpoint(tmp_path, "deepseek_v2", seed=6, **overrides)
    model = load_gguf(write_deepseek2_gguf(tmp_path / "yarn.gguf", hf_dir))
    assert model.config.rope == load_hf(hf_dir).config.rope
    tokens = np.random.default_rng(7).integers(0, model.config.vocab_size, 80).tolist()
    assert _rel_max_diff(_logits(model, tokens), hf_logits(hf_dir, tokens)) <= 2e-5


def test_deepseek2_gguf_refuses_what_it_does_not_read(tmp_path):
    hf_dir = make_tiny_hf_checkpoint(tmp_path, "deepseek_v2", seed=4, **_DEEPSEEK_V2)
    sigmoid = write_deepseek2_gguf(tmp_path / "v3.gguf", hf_dir,
                                   metadata={"expert_gating_func": 2})
    with pytest.raises(ValueError, match="expert_gating_func=2"):
        load_gguf(sigmoid)
    yarn = write_deepseek2_gguf(tmp_path / "yarn.gguf", hf_dir,
                                metadata={"rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match="yarn_log_multiplier=None"):
        load_gguf(yarn)
    bias = {"blk.1.exp_probs_b.bias": np.zeros((8,), np.float32)}  # DeepSeek-V3's choice bias
    with pytest.raises(ValueError, match=r"blk\.1\.exp_probs_b\.bias"):
        load_gguf(write_deepseek2_gguf(tmp_path / "bias.gguf", hf_dir, extra=bias))
    half = {"blk.0.attn_k_b.weight": np.zeros((4, 32, 16), np.float32)}
    with pytest.raises(ValueError, match="without its other half"):
        load_gguf(write_deepseek2_gguf(tmp_path / "half.gguf", hf_dir, split_kv_b=False,
                                       extra=half))
