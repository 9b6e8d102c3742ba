"""Multi-head latent attention (DeepSeek-V2/V3, dense layers) against transformers.

Tiny random checkpoints written by transformers load into kvjax, whose attention runs in the
absorbed form over a cache of latents: logits match transformers' expanded per-head K/V on the
same weights, and the engine's greedy tokens (paged latent pool, prefix cache, preemption)
match transformers' greedy decoding. The pool holds d_c + d_r values per token and layer,
nothing per head, and features that cannot read a latent are refused with their reason.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hf_utils import hf_greedy, hf_logits, make_tiny_hf_checkpoint

import kvjax
from kvjax.engine import compat
from kvjax.engine.compat import Feature, ModelTrait
from kvjax.engine.step import AttentionImpl
from kvjax.models import llama
from kvjax.models.hf import config_from_hf, load_hf
from kvjax.testing import TINY_MLA, greedy_reference, tiny_model

# Relative max |logit difference| to transformers in float32 (measured 4e-6 to 7e-6: the
# absorbed form sums in another order than the expanded one).
LOGITS_RTOL = 2e-5
MLA_DIMS = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                num_key_value_heads=4, first_k_dense_replace=2)
_YARN = dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
             original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707,
             beta_fast=32, beta_slow=1)
CASES = {
    # DeepSeek-V2-Lite's form: a full-rank query, interleaved RoPE.
    "v2": ("deepseek_v2", dict(q_lora_rank=None)),
    # A low-rank query with its own norm; YaRN with mscale_all_dim (the softmax scale).
    "v2-q_lora-yarn": ("deepseek_v2", dict(q_lora_rank=24, rope_parameters=_YARN)),
    # DeepSeek-V3's attention (rope_interleave on by default).
    "v3": ("deepseek_v3", dict(q_lora_rank=24)),
}
NEW_TOKENS = 16
ENGINE = dict(page_size=4, max_num_seqs=3, max_prefill_chunk=8, min_chunk_bucket=8,
              max_num_batched_tokens=16, max_model_len=64, enable_prefix_cache=True)


def _checkpoint(tmp_path, name, seed=1):
    model_type, overrides = CASES[name]
    return make_tiny_hf_checkpoint(tmp_path, model_type, seed=seed, **MLA_DIMS, **overrides)


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(tmp_path, name):
    directory = _checkpoint(tmp_path, name)
    model = load_hf(directory)
    assert model.config.mla is not None and model.config.num_kv_heads == 1
    ids = [int(t) for t in np.random.RandomState(0).randint(3, 300, 40)]
    ref = hf_logits(directory, ids)
    got = np.asarray(llama.forward_dense(model.params, model.config, np.asarray(ids, np.int32)))
    assert np.abs(got - ref).max() / np.abs(ref).max() < LOGITS_RTOL


def test_rope_permutation_is_what_matches(tmp_path):
    """Loading DeepSeek's interleaved RoPE columns unpermuted gives other logits: the
    permutation is doing the work, not a symmetric random init."""
    from kvjax.models import hf

    directory = _checkpoint(tmp_path, "v2")
    model = load_hf(directory)
    plain = hf.params_from_hf(hf._read_checkpoint(hf._checkpoint_files(directory)),
                              model.config, rope_interleaved=False)
    ids = np.arange(3, 30, dtype=np.int32)
    ref = hf_logits(directory, ids.tolist())
    got = np.asarray(llama.forward_dense(plain, model.config, ids))
    assert np.abs(got - ref).max() / np.abs(ref).max() > 100 * LOGITS_RTOL


@pytest.mark.parametrize("name,new_tokens", [("v2-q_lora-yarn", NEW_TOKENS), ("v3", 32)])
def test_engine_greedy_with_prefix_cache_and_preemption_matches_transformers(
        tmp_path, name, new_tokens):
    directory = _checkpoint(tmp_path, name, seed=2)
    model = load_hf(directory)
    rs = np.random.RandomState(1)
    prefix = [int(t) for t in rs.randint(3, 300, 12)]
    prompts = [prefix + [int(t) for t in rs.randint(3, 300, n)] for n in (5, 9, 3)]
    want = [hf_greedy(directory, p, new_tokens) for p in prompts]
    # 16 pages of 4 tokens cannot hold three sequences of 31 to 53 tokens at once:
    # preemption, and the batch changes size.
    engine = kvjax.Engine(model, kvjax.EngineConfig(**ENGINE, num_pages=16))
    outs = engine.generate(prompts, kvjax.SamplingParams(max_new_tokens=new_tokens,
                                                         ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert engine.attention_name == "reference"  # no kernel reads latent pages
    metrics = engine.metrics()
    assert metrics["preemptions"] > 0
    assert metrics["prefix_hit_tokens"] >= 8  # two full pages of the shared prefix
    assert metrics["num_used_pages"] == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_engine_swap_and_recompute_keep_the_greedy_tokens(mode):
    model = tiny_model(TINY_MLA)
    prompts = [[7, 21, 3, 90, 14, 60, 33, 8, 5, 41, 77], [2, 99, 64, 18, 30, 11, 45, 70, 6],
               [7, 21, 3, 90, 14, 60, 33, 8, 12, 50, 3]]
    engine = kvjax.Engine(model, kvjax.EngineConfig(**ENGINE, num_pages=10,
                                                    preemption_mode=mode))
    outs = engine.generate(prompts, kvjax.SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [
        greedy_reference(model, p, 12) for p in prompts]
    assert engine.metrics()["preemptions"] > 0


def test_pool_holds_the_latent_bytes_only():
    """Bytes per token and layer are (d_c + d_r) * 4 in float32, one tensor: the spec, the
    pool's buffers and the pages a budget buys agree."""
    c = TINY_MLA
    per_layer = (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) * 4
    engine = kvjax.Engine(tiny_model(c), kvjax.EngineConfig(
        page_size=4, max_model_len=64, kv_budget_bytes=50 * 4 * c.num_layers * per_layer))
    assert c.kv_bytes_per_token("float32") == c.num_layers * per_layer
    assert engine.kv_bytes_per_page == 4 * c.num_layers * per_layer
    assert engine.num_pages == 50
    assert engine.kv.nbytes() == 50 * engine.kv_bytes_per_page
    # The same model with its K and V expanded per head would take this many bytes a token.
    expanded = c.num_layers * c.num_heads * (c.mla.qk_head_dim + c.mla.v_head_dim) * 4
    assert c.kv_bytes_per_token("float32") < expanded / 2


_SETTINGS = {
    Feature.INT8: dict(kv_codec="int8"),
    Feature.KIVI: dict(kv_codec="kivi4", kv_codec_options=dict(group=4)),
    Feature.KIVI_RESIDUAL: dict(kv_codec="kivi4", kv_codec_options=dict(group=4, residual=4)),
    Feature.STREAMING_ROTATED: dict(retention="streaming", retention_budget=10,
                                    retention_options=dict(num_sinks=2, cache_positions=True)),
    Feature.KNORM: dict(retention="knorm", retention_budget=10),
    Feature.EXPECTED_ATTENTION: dict(retention="expected_attention", retention_budget=10),
    Feature.CONTEXT_REUSE: dict(context_reuse="cacheblend", enable_prefix_cache=True),
    Feature.KV_ARENA: dict(kv_arena=True),
    Feature.CONTIGUOUS: dict(kv_layout="contiguous"),
    Feature.BATCH_INVARIANT: dict(batch_invariant=True),
    Feature.FUSED_KV_WRITE: dict(fused_kv_write=True),
    Feature.ADAKV: dict(retention="snapkv", retention_budget=10,
                        retention_options=dict(window=3), retention_schedule="adakv"),
    Feature.PYRAMID_ADAKV: dict(retention="snapkv", retention_budget=10,
                                retention_options=dict(window=3),
                                retention_schedule="pyramid_adakv"),
    Feature.PER_HEAD: dict(retention="snapkv", retention_budget=10,
                           retention_options=dict(window=3), retention_schedule="per_head"),
    Feature.GLOBAL: dict(retention="snapkv", retention_budget=10,
                         retention_options=dict(window=3), retention_schedule="global"),
    Feature.LOWRANK: dict(kv_codec="lowrank", kv_codec_options=dict(rank=4)),
    Feature.MIXED_PRECISION: dict(kv_codec="mixed", kv_codec_options=dict(group=4),
                                  enable_prefix_cache=False),
}


@pytest.mark.parametrize("feature", [f for (t, f) in compat.MODEL_REFUSED
                                     if t is ModelTrait.MLA_LATENT])
def test_features_that_cannot_read_a_latent_are_refused(feature):
    reason = compat.MODEL_REFUSED[(ModelTrait.MLA_LATENT, feature)]
    model = tiny_model(TINY_MLA)
    with pytest.raises(ValueError, match=re.escape(reason)):
        if feature is Feature.MESH:
            from kvjax.parallel.sharding import make_mesh

            kvjax.Engine(model, kvjax.EngineConfig(page_size=4, max_model_len=64),
                         mesh=make_mesh(tp=1))
        else:
            kvjax.Engine(model, kvjax.EngineConfig(page_size=4, max_model_len=64,
                                                   **_SETTINGS[feature]))


def test_kernels_refuse_latent_pages_with_their_reason():
    from pallas_kernels import dispatch

    engine = kvjax.Engine(tiny_model(TINY_MLA), kvjax.EngineConfig(page_size=4,
                                                                   max_model_len=64))
    assert "MLA latent pages" in dispatch.unsupported_reason(engine.kv)
    with pytest.raises(ValueError, match="native CPU kernel does not read MLA latent pages"):
        kvjax.Engine(tiny_model(TINY_MLA), kvjax.EngineConfig(
            page_size=4, max_model_len=64, attention_impl=AttentionImpl.NATIVE)).generate(
                [[5, 6, 7]], kvjax.SamplingParams(max_new_tokens=1))


@pytest.mark.parametrize("overrides,message", [
    (dict(first_k_dense_replace=1, topk_method="noaux_tc", num_experts_per_tok=2,
          moe_intermediate_size=32), "topk_method 'noaux_tc'"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_unsupported_deepseek_configs_are_refused(overrides, message):
    hf_config = dict(model_type="deepseek_v2", vocab_size=300, hidden_size=64,
                     intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                     n_routed_experts=8, first_k_dense_replace=2)
    config_from_hf(hf_config)  # dense everywhere: accepted
    with pytest.raises(ValueError, match=message):
        config_from_hf({**hf_config, **overrides})


# Features that read and move a latent pool like any other page pool, run by the
# compatibility table's own harness on the tiny MLA model (exact ones against the dense
# greedy reference, retention within the table's regret bound; no page leaked).
COMPOSING = [
    (Feature.HOST_TIER, Feature.SNAPSHOT, Feature.PREFIX_CACHE, Feature.SWAP),
    (Feature.SPECULATIVE, Feature.N_SAMPLES),
    (Feature.PAUSE, Feature.AUTO_PREEMPTION),
    (Feature.CONTROLLER,),
    (Feature.H2O, Feature.SWAP),
    (Feature.QUEST, Feature.PREFIX_CACHE),
    (Feature.STREAMING,), (Feature.SNAPKV,), (Feature.TOVA,), (Feature.OBSERVED_ATTENTION,),
]


@pytest.mark.parametrize("features", COMPOSING, ids=lambda fs: "+".join(f.value for f in fs))
def test_features_compose_with_a_latent_pool(features):
    from engine.test_compatibility import check_outcome, greedy_oracle, run_pair

    model = tiny_model(TINY_MLA)
    check_outcome(features, run_pair(model, features, greedy_oracle(model)))
