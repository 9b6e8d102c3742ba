"""kvjax's RoPE against transformers' `modeling_rope_utils` (frequencies, attention factors) and
its rotary embedding modules (cos / sin per position), read from the same config.json forms."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hf_utils import import_torch

from kvjax import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.models.rope import RoPE, RopeType
from kvjax.testing import TINY, tiny_model

D = 32  # head dim of every case
M = 32  # the pre-training context length the scaled cases start from
_SHAPE = dict(hidden_size=4 * D, num_attention_heads=4, head_dim=D)
# Long and short factors with spread, so mixing them up moves every angle.
_SHORT = [1.0 + 0.05 * i for i in range(D // 2)]
_LONG = [1.0 + 0.7 * i for i in range(D // 2)]

# name -> (config.json fields, transformers config class name). Legacy `rope_scaling` with
# `type`, and transformers 5's `rope_parameters`, both appear.
CASES = {
    "default": (dict(rope_theta=5000.0, max_position_embeddings=M), "LlamaConfig"),
    "linear-legacy": (dict(rope_theta=10000.0, max_position_embeddings=M,
                           rope_scaling={"type": "linear", "factor": 4.0}), "LlamaConfig"),
    "dynamic": (dict(max_position_embeddings=M,
                     rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                      "factor": 2.0}), "LlamaConfig"),
    "llama3": (dict(max_position_embeddings=4 * M,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": M}), "LlamaConfig"),
    "yarn": (dict(max_position_embeddings=4 * M,
                  rope_scaling={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": M}), "LlamaConfig"),
    "yarn-mscale-untruncated": (
        dict(max_position_embeddings=4 * M,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                              "original_max_position_embeddings": M, "mscale": 0.9,
                              "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                              "truncate": False}), "LlamaConfig"),
    "longrope": (dict(max_position_embeddings=4 * M, original_max_position_embeddings=M,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                       "short_factor": _SHORT, "long_factor": _LONG}),
                 "Phi3Config"),
}


def _hf_config(name: str):
    import transformers

    fields, config_class = CASES[name]
    return getattr(transformers, config_class)(**_SHAPE, **fields)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seq_len", [None, M, M + 1, 3 * M])
def test_frequencies_and_attention_factor_match_transformers(name, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    import_torch()
    hf_config = _hf_config(name)
    rope = RoPE.from_hf({**_SHAPE, **CASES[name][0]})
    rope_type = hf_config.rope_parameters["rope_type"]
    assert rope.rope_type.value == rope_type
    if rope_type == "default":
        inv_freq = 1.0 / hf_config.rope_parameters["rope_theta"] ** (np.arange(0, D, 2) / D)
        attention_factor = 1.0
    else:
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, seq_len)
        inv_freq = inv_freq.numpy()
    np.testing.assert_allclose(rope.inv_freq(D, seq_len), inv_freq, rtol=2e-6)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_position_embeds_like_transformers_cached_generation(name):
    """Token by token (transformers' generation with a KV cache, each step's sequence ending at
    the token), past the pre-training length: the queries and keys equal transformers'."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    torch = import_torch()
    rotary = LlamaRotaryEmbedding(_hf_config(name))
    rope = RoPE.from_hf({**_SHAPE, **CASES[name][0]})
    num_positions = 3 * M
    x = np.random.default_rng(0).normal(size=(num_positions, 2, D)).astype(np.float32)
    got = np.asarray(rope.apply(jnp.asarray(x), jnp.arange(num_positions)))  # [T, 2, D]
    want = np.empty_like(x)
    for p in range(num_positions):
        cos, sin = rotary(torch.zeros(1), torch.arange(p + 1)[None])  # [1, p + 1, D]
        xp = torch.from_numpy(x[p])[None, :, None]  # [1, heads, 1, D]
        embedded, _ = apply_rotary_pos_emb(xp, xp, cos[:, -1:], sin[:, -1:])
        want[p] = embedded[0, :, 0].numpy()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rotating_an_embedded_key_by_a_shift_is_the_key_at_the_shifted_position(name):
    """What chunk re-rotation and rotated sinks rely on; false for the two RoPE types whose
    frequencies depend on the position (`is_shift_invariant`), which the engine refuses."""
    rope = RoPE.from_hf({**_SHAPE, **CASES[name][0]})
    x = jnp.asarray(np.random.default_rng(1).normal(size=(6, 2, D)), jnp.float32)
    positions = jnp.array([0, 3, 10, 20, 31, 40])
    shifts = jnp.array([5, 40, 30, 1, 60, 7])
    turned = rope.rotate(rope.apply(x, positions), shifts)
    moved = rope.apply(x, positions + shifts)
    assert rope.is_shift_invariant == (name not in ("dynamic", "longrope"))
    assert np.allclose(turned, moved, atol=1e-4) == rope.is_shift_invariant


def test_unknown_or_incomplete_rope_configs_are_refused():
    with pytest.raises(ValueError, match="rope_type 'mrope'"):
        RoPE.from_hf(dict(rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}))
    with pytest.raises(ValueError, match="needs 'factor'"):
        RoPE.from_hf(dict(rope_parameters={"rope_type": "linear"}))
    with pytest.raises(ValueError, match="short_factor and long_factor"):
        RoPE(RopeType.LONGROPE, original_max_position_embeddings=M, short_factor=(1.0,))
    with pytest.raises(ValueError, match="per-layer-type"):
        RoPE.from_hf(dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                           "sliding_attention": {"rope_type": "default"}}))
    with pytest.raises(ValueError, match="head dim 8 needs 4"):
        RoPE.from_hf({**_SHAPE, **CASES["longrope"][0]}).inv_freq(8)


def _engine(rope: RoPE, **options) -> Engine:
    config = dataclasses.replace(TINY, rope=rope, max_position_embeddings=64)
    return Engine(tiny_model(config), EngineConfig(page_size=4, num_pages=32, max_model_len=64,
                                                   **options))


def test_rope_is_part_of_the_kv_provenance():
    """A page keyed under one RoPE is never a prefix-cache hit under another."""
    llama3 = RoPE.from_hf({**_SHAPE, **CASES["llama3"][0]})
    fingerprints = {_engine(rope).provenance() for rope in (
        RoPE(), RoPE(theta=20000.0), llama3, dataclasses.replace(llama3, factor=16.0))}
    assert len(fingerprints) == 4


@pytest.mark.parametrize("options", [
    dict(context_reuse="cacheblend"),
    dict(retention="streaming", retention_budget=16,
         retention_options=dict(num_sinks=2, cache_positions=True)),
], ids=["context_reuse", "rotated_sinks"])
def test_position_dependent_rope_refuses_key_rotation(options):
    longrope = RoPE(RopeType.LONGROPE, original_max_position_embeddings=16,
                    short_factor=(1.0,) * 4, long_factor=(2.0,) * 4)
    with pytest.raises(ValueError, match="position_dependent_rope.*turned by a shift"):
        _engine(longrope, **options)
    _engine(RoPE.from_hf({**_SHAPE, **CASES["yarn"][0]}), **options)  # shift-invariant: served


@pytest.mark.parametrize("name, length", [
    ("default", M), ("linear-legacy", 4 * M), ("dynamic", 2 * M), ("llama3", 4 * M),
    ("yarn", 4 * M), ("yarn-mscale-untruncated", 8 * M), ("longrope", 4 * M)])
def test_a_scaled_model_serves_the_context_its_scaling_stretches_to(name, length):
    fields = CASES[name][0]
    rope = RoPE.from_hf({**_SHAPE, **fields})
    assert rope.context_length(fields["max_position_embeddings"]) == length
