"""Each supported architecture from a tiny random Hugging Face checkpoint, against transformers.

For every architecture transformers writes a tiny random-weights checkpoint (`save_pretrained`);
kvjax loads it and (1) its cache-free forward pass gives transformers' logits, (2) the engine,
with the prefix cache and chunked prefill on and the batch changing size (three requests, at
most two at a time, the third sharing the first one's prompt pages), decodes transformers'
greedy tokens. The scaled-RoPE cases generate past the pre-training length their scaling starts
from, so LongRoPE's switch from short to long factors happens inside the test.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_utils import (
    engine_greedy,
    hf_greedy,
    hf_logits,
    load_hf_model,
    make_tiny_hf_checkpoint,
    shared_prefix_prompts,
)

import kvjax
from kvjax.models import llama
from kvjax.models.hf import load_hf
from kvjax.models.rope import RopeType

# Max |kvjax - HF| over the logits, relative to the largest |HF logit|, in float32 (measured
# 3e-7 to 5e-7 on these 2-layer checkpoints).
LOGITS_RTOL = 1e-5
NEW_TOKENS = 32
ORIGINAL_LEN = 32  # where the scaled RoPE cases' scaling starts
HEAD_DIM = 16
ENGINE = dict(page_size=4, max_num_seqs=2, max_prefill_chunk=8, min_chunk_bucket=8,
              max_num_batched_tokens=16, max_model_len=128, enable_prefix_cache=True)

_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL_LEN}
_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_LEN}
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
             "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
             "long_factor": [1.0 + 0.8 * i for i in range(HEAD_DIM // 2)]}
_DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}

# name -> (model_type, config overrides, the RoPE type kvjax must read).
CASES = {
    # Llama 3.2: llama3 frequency bands, tied embedding.
    "llama-3.2": ("llama", dict(tie_word_embeddings=True, rope_parameters=_LLAMA3),
                  RopeType.LLAMA3),
    # Qwen2.5: Q/K/V biases; YaRN as its long-context configs set it (legacy rope_scaling).
    "qwen2.5-yarn": ("qwen2", dict(rope_theta=1000000.0, rope_scaling=_YARN), RopeType.YARN),
    # Qwen3: per-head Q/K RMSNorm, no biases, N*D != H (head_dim set apart from the width).
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0),
              RopeType.DEFAULT),
    # Phi-3: fused qkv_proj / gate_up_proj, LongRoPE (Phi-3-mini-128k's form).
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=ORIGINAL_LEN,
                                   rope_parameters=_LONGROPE), RopeType.LONGROPE),
    # Llama with dynamic NTK scaling past max_position_embeddings (the length it starts from).
    "llama-dynamic": ("llama", dict(max_position_embeddings=ORIGINAL_LEN,
                                    rope_parameters=_DYNAMIC), RopeType.DYNAMIC),
    # Qwen3 with a sliding-window layer beside a global one: two KV layer groups, the window's
    # pages given back as the sequence moves past them (prompts and outputs span many windows).
    "qwen3-sliding": ("qwen3", dict(head_dim=32, use_sliding_window=True, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"]),
                      RopeType.DEFAULT),
    # Mistral: one window on every layer (one layer group keeping its last 8 tokens).
    "mistral-window": ("mistral", dict(sliding_window=8), RopeType.DEFAULT),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_architecture_logits_and_engine_greedy_match_transformers(tmp_path, name):
    model_type, overrides, rope_type = CASES[name]
    directory = make_tiny_hf_checkpoint(tmp_path, model_type, seed=21, **overrides)
    model = load_hf(directory)
    assert model.config.rope.rope_type is rope_type
    assert model.config.head_dim == overrides.get("head_dim", HEAD_DIM)
    hf_model = load_hf_model(directory)

    rng = np.random.default_rng(0)
    tokens = rng.integers(3, model.config.vocab_size, 24).tolist()
    ref = hf_logits(hf_model, tokens)  # [T, V]
    got = np.asarray(llama.forward_dense(model.params, model.config, jnp.asarray(tokens)))
    assert float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))) <= LOGITS_RTOL

    prompts = shared_prefix_prompts(rng, model.config.vocab_size)
    # Prompts stay within ORIGINAL_LEN, so transformers' one-pass prompt and kvjax's per-token
    # RoPE lengths agree; generation runs past it.
    assert max(map(len, prompts)) + NEW_TOKENS > ORIGINAL_LEN >= max(map(len, prompts))
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    engine, tokens = engine_greedy(model, ENGINE, prompts, NEW_TOKENS)  # at most two running
    assert tokens == expected
    assert engine.prefix_cache_stats()["prefix_hit_tokens"] >= 12


def test_sharded_phi3_loads_the_same_params(tmp_path):
    """A sharded checkpoint (index json) of fused matrices splits into the same params."""
    whole = load_hf(make_tiny_hf_checkpoint(tmp_path / "whole", "phi3", seed=5))
    sharded_dir = make_tiny_hf_checkpoint(tmp_path / "sharded", "phi3", seed=5,
                                          max_shard_size="60KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = load_hf(sharded_dir)
    for name, w in whole.params["layers"].items():
        np.testing.assert_array_equal(np.asarray(sharded.params["layers"][name]), np.asarray(w))


def test_phi3_legacy_su_scaling_is_longrope(tmp_path):
    """Older Phi-3 configs name LongRoPE 'su'; transformers reads it as longrope, so does kvjax:
    the same logits (short factors and attention factor, within the pre-training length)."""
    directory = make_tiny_hf_checkpoint(tmp_path, "phi3", seed=8,
                                        original_max_position_embeddings=ORIGINAL_LEN,
                                        rope_parameters=_LONGROPE)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("rope_parameters")
    config["rope_scaling"] = {**{k: v for k, v in _LONGROPE.items() if k != "rope_type"},
                              "type": "su"}
    config_path.write_text(json.dumps(config))
    model = load_hf(directory)
    assert model.config.rope.rope_type is RopeType.LONGROPE
    tokens = list(range(3, 3 + ORIGINAL_LEN))
    ref = hf_logits(directory, tokens)
    got = np.asarray(llama.forward_dense(model.params, model.config, jnp.asarray(tokens)))
    assert float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))) <= LOGITS_RTOL


def test_a_fused_matrix_of_the_wrong_size_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = make_tiny_hf_checkpoint(tmp_path, "phi3", seed=6)
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"qkv_proj.weight has 112 rows, expected 128"):
        load_hf(directory)


@pytest.mark.parametrize("model_type, overrides, message", [
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("qwen3", dict(layer_types=["sliding_attention", "sliding"]), "unsupported layer_types"),
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                   "short_factor": [1.0], "long_factor": [1.0]}),
     "longrope factors have 1 entries, head dim 16 needs 8"),
])
def test_unsupported_architecture_configs_are_refused(tmp_path, model_type, overrides, message):
    directory = make_tiny_hf_checkpoint(tmp_path, model_type, seed=7)
    config_path = directory / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **overrides}))
    with pytest.raises(ValueError, match=message):
        load_hf(directory)


def test_alternating_window_512_at_4k_matches_transformers(tmp_path):
    """Window-512 layers alternating with global ones, a 4k-token context: the engine (two
    layer groups, the window's old pages given back while the prompt is prefilled in chunks)
    decodes transformers' greedy tokens, holding about half the KV of every layer global."""
    window, layer_types = 512, ["sliding_attention", "full_attention"] * 2
    directory = make_tiny_hf_checkpoint(
        tmp_path, "qwen3", seed=4, num_hidden_layers=4, layer_types=layer_types,
        use_sliding_window=True, sliding_window=window, max_position_embeddings=8192)
    model = load_hf(directory)
    assert model.config.layer_windows == (window, 0, window, 0)
    prompt = np.random.default_rng(1).integers(3, model.config.vocab_size, 4080).tolist()
    expected = hf_greedy(load_hf_model(directory), prompt, 16)
    engine = kvjax.Engine(model, kvjax.EngineConfig(
        page_size=16, max_model_len=4096 + 16, max_num_seqs=1, max_prefill_chunk=512,
        max_num_batched_tokens=512))
    greedy = kvjax.SamplingParams(max_new_tokens=16, ignore_eos=True)
    engine.add_request("r", prompt, greedy)
    held, done = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            done = out.outputs[0].token_ids
        if engine.allocator.has_sequence("r#0"):
            held = engine.allocator.num_held_pages("r#0")
    assert done == expected
    spec = engine.kv_spec
    assert 0.98 <= held * spec.page_bytes / spec.bytes_held(4096) <= 1.05
    assert held * spec.page_bytes < 0.6 * 4096 * spec.bytes_per_token
