"""Gemma 2 and Gemma 3 (text) from tiny random Hugging Face checkpoints, against transformers.

The tiny configs switch every Gemma difference on where a mix-up would show: random norm
weights under the (1 + w) convention, a `query_pre_attn_scalar` apart from the head dim, soft
caps low enough to bend the logits (Gemma 2), and for Gemma 3 Q/K norms and local layers whose
RoPE base differs from the global layers' linearly scaled one. The context is capped at the
sliding window (KV pools serve one global layer group), so every test stays inside it.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_utils import hf_greedy, hf_logits, load_hf_model, make_tiny_hf_checkpoint

import kvjax
from kvjax.config import ModelConfig
from kvjax.engine.step import AttentionImpl
from kvjax.kv import native
from kvjax.models import llama
from kvjax.models.hf import config_from_hf, layer_windows_from_hf, load_hf
from kvjax.models.rope import RoPE, RopeType

LOGITS_RTOL = 1e-5  # as for the other architectures (measured 4e-7 to 7e-7)
NEW_TOKENS = 32
WINDOW = 16  # prompts and outputs cross several windows
ENGINE = dict(page_size=4, max_num_seqs=2, max_prefill_chunk=8, min_chunk_bucket=8,
              max_num_batched_tokens=16, max_model_len=128, enable_prefix_cache=True)

_GEMMA3_ROPES = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
CASES = {
    # Gemma 2: sliding / global layers alternating, both soft caps, query scale 24**-0.5.
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                              attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    # Gemma 3: Q/K norms, local layers at base 100, global ones at 1e6 with linear scaling.
    "gemma3": ("gemma3_text", dict(head_dim=64, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                   num_hidden_layers=3, rope_parameters=_GEMMA3_ROPES,
                                   layer_types=["sliding_attention", "full_attention",
                                                "sliding_attention"])),
}


def _engine_tokens(model, prompts, **overrides):
    engine = kvjax.Engine(model, kvjax.EngineConfig(**{**ENGINE, **overrides}))
    outs = engine.generate(prompts, kvjax.SamplingParams(max_new_tokens=NEW_TOKENS,
                                                          ignore_eos=True))
    return engine, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", sorted(CASES))
def test_gemma_logits_and_engine_greedy_match_transformers(tmp_path, name):
    model_type, overrides = CASES[name]
    directory = make_tiny_hf_checkpoint(tmp_path, model_type, seed=3, **overrides)
    model = load_hf(directory)
    c = model.config
    assert c.layer_windows == ((WINDOW, 0) if name == "gemma2" else (WINDOW, 0, WINDOW))
    hf_model = load_hf_model(directory)

    rng = np.random.default_rng(0)
    tokens = rng.integers(3, c.vocab_size, 24).tolist()
    ref = hf_logits(hf_model, tokens)  # [T, V]
    got = np.asarray(llama.forward_dense(model.params, c, jnp.asarray(tokens)))
    assert float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))) <= LOGITS_RTOL
    if c.final_logit_softcap is not None:
        assert np.max(np.abs(ref)) <= c.final_logit_softcap

    shared = rng.integers(3, c.vocab_size, 12).tolist()
    prompts = [shared + [7, 8, 9], rng.integers(3, c.vocab_size, 21).tolist(), shared + [40]]
    assert max(map(len, prompts)) + NEW_TOKENS > 3 * WINDOW
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    engine, got_tokens = _engine_tokens(model, prompts)
    assert got_tokens == expected
    assert engine.prefix_cache_stats()["prefix_hit_tokens"] >= 12
    if native.unavailable_reason() is None:
        assert engine.attention_name == "native"
    if c.attn_logit_softcap is not None:  # the soft cap on the jnp path too
        engine, got_tokens = _engine_tokens(model, prompts,
                                            attention_impl=AttentionImpl.REFERENCE)
        assert engine.attention_name == "reference" and got_tokens == expected


def test_gemma3_older_config_form_reads_the_same_model(tmp_path):
    """Gemma 3 configs on the Hub before transformers 5 give the local base as
    `rope_local_base_freq`, the global RoPE as `rope_theta` / `rope_scaling` and the layer
    pattern as `sliding_window_pattern`; transformers and kvjax read them alike."""
    directory = make_tiny_hf_checkpoint(tmp_path, "gemma3_text", seed=4, head_dim=16,
                                        sliding_window=WINDOW, num_hidden_layers=3)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key in ("rope_parameters", "layer_types"):
        config.pop(key)
    config.update(rope_theta=1e6, rope_local_base_freq=100.0, sliding_window_pattern=3,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    path.write_text(json.dumps(config))
    model = load_hf(directory)
    assert model.config.rope == RoPE(rope_type=RopeType.LINEAR, theta=1e6, factor=8.0,
                                     original_max_position_embeddings=256)
    assert model.config.local_rope == RoPE(theta=100.0)
    assert model.config.local_rope_layers == (0, 1)
    tokens = np.random.default_rng(1).integers(3, 300, 24).tolist()
    ref = hf_logits(directory, tokens)
    got = np.asarray(llama.forward_dense(model.params, model.config, jnp.asarray(tokens)))
    assert float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))) <= LOGITS_RTOL


@pytest.mark.parametrize("hf_config, windows", [
    (dict(model_type="gemma2", num_hidden_layers=4, sliding_window=8,
          layer_types=["sliding_attention", "full_attention"] * 2), (8, 0, 8, 0)),
    (dict(model_type="gemma2", num_hidden_layers=3, sliding_window=8), (8, 0, 8)),
    (dict(model_type="gemma3_text", num_hidden_layers=7, sliding_window=5), (5,) * 5 + (0, 5)),
    (dict(model_type="gemma3_text", num_hidden_layers=4, sliding_window=5,
          sliding_window_pattern=2), (5, 0, 5, 0)),
    (dict(model_type="mistral", num_hidden_layers=2, sliding_window=9), (9, 9)),
    (dict(model_type="mistral", num_hidden_layers=2, sliding_window=None), ()),
    (dict(model_type="llama", num_hidden_layers=2), ()),
    (dict(model_type="gemma2", num_hidden_layers=2, sliding_window=8,
          layer_types=["full_attention"] * 2), ()),
])
def test_layer_windows_from_hf(hf_config, windows):
    """Per-layer windows as transformers lays them out (Gemma 3: every sixth layer global by
    default, the pattern counted from 1)."""
    assert layer_windows_from_hf(hf_config) == windows
    if windows:
        assert ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                           num_layers=len(windows), num_heads=1, num_kv_heads=1, head_dim=8,
                           layer_windows=windows).layer_windows == windows


def test_layer_types_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="layer_types has 1 entries, num_hidden_layers is 2"):
        layer_windows_from_hf(dict(model_type="gemma2", num_hidden_layers=2, sliding_window=4,
                              layer_types=["sliding_attention"]))


_TINY_GEMMA2 = dict(model_type="gemma2", vocab_size=32, hidden_size=16, intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=8, hidden_activation="gelu_pytorch_tanh", sliding_window=8)


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True),
     "use_bidirectional_attention"),
    (dict(attn_logit_softcapping=-1.0), "attn_logit_softcap must be None or a positive"),
])
def test_unsupported_gemma_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**_TINY_GEMMA2, **overrides})


def test_local_rope_fields_are_validated():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=1,
                num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="must be set together"):
        ModelConfig(**base, local_rope=RoPE(theta=10.0))
    with pytest.raises(ValueError, match="ascending distinct layers < 2"):
        ModelConfig(**base, local_rope=RoPE(theta=10.0), local_rope_layers=(2,))
    dynamic = RoPE(rope_type=RopeType.DYNAMIC, factor=2.0, original_max_position_embeddings=8)
    with pytest.raises(ValueError, match="chooses frequencies by position"):
        ModelConfig(**base, rope=dynamic, local_rope=RoPE(theta=10.0), local_rope_layers=(0,))


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """The Gemma 3 case's Model without its windows (its RoPEs alone refuse the engine
    settings below; windows refuse them too, for another reason)."""
    model_type, overrides = CASES["gemma3"]
    model = load_hf(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("gemma"), model_type,
                                            seed=5, **overrides))
    return dataclasses.replace(model, config=dataclasses.replace(model.config,
                                                                  layer_windows=()))


@pytest.mark.parametrize("overrides, setting", [
    (dict(context_reuse="none"), "context_reuse='none'"),
    (dict(retention="streaming", retention_budget=32,
          retention_options={"num_sinks": 2, "cache_positions": True}), "retention='streaming'"),
])
def test_gemma3_refuses_single_rope_key_rotations(tiny_gemma3, overrides, setting):
    """Chunk re-rotation and rotated sinks turn keys by one RoPE; Gemma 3's local layers use
    another (kvjax/engine/compat.py, "Refused by the model")."""
    with pytest.raises(ValueError, match=rf"{setting}.*per_layer_rope"):
        kvjax.Engine(tiny_gemma3, kvjax.EngineConfig(**{**ENGINE, **overrides}))
