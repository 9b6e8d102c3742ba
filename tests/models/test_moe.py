"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) against
transformers, and the two exact ways the routed experts run against a numpy brute force.

Tiny random checkpoints written by transformers load into kvjax: the cache-free forward pass
gives transformers' logits, and the engine (prefix cache, chunked prefill, a batch that changes
size) decodes transformers' greedy tokens, compiling nothing new once its step shapes are seen.
"""

from __future__ import annotations

import itertools
import re

import hf_utils
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import kvjax
from kvjax.config import MoeConfig, MoeScoring
from kvjax.engine import compat
from kvjax.engine.compat import Feature, ModelTrait
from kvjax.models import llama, moe
from kvjax.models.hf import config_from_hf, load_hf
from kvjax.testing import TINY_MOE, greedy_reference, tiny_model

# Relative max |logit difference| to transformers in float32: the MHA families measured 2e-7 to
# 4e-7 (the existing architectures' bound), DeepSeek's MLA 4e-6 to 1e-5 (its absorbed
# attention sums in another order; the MLA tests' bound).
LOGITS_RTOL = {"mha": 1e-5, "mla": 2e-5}
NEW_TOKENS = 16
ENGINE = dict(page_size=4, max_num_seqs=2, max_prefill_chunk=8, min_chunk_bucket=8,
              max_num_batched_tokens=16, max_model_len=64, enable_prefix_cache=True)
_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            num_key_value_heads=4, q_lora_rank=24, first_k_dense_replace=1)
# name -> (model_type, config overrides). 8 experts, so a decode step of up to 4 tokens (k = 2)
# gathers its experts and longer steps run all of them: the engine runs both ways.
CASES = {
    # Softmax over the top-k logits (renormalized top-k probabilities).
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2,
                                intermediate_size=48)),
    # Top-k of the softmax without renormalizing; a shared expert behind a sigmoid gate;
    # Q/K/V biases.
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, norm_topk_prob=False)),
    # Renormalized top-k; per-head Q/K norms.
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True,
                                    head_dim=16)),
    # A dense first layer; two shared experts; group-limited greedy routing (2 of 4 groups) of
    # 3 experts, scaled.
    "deepseek_v2": ("deepseek_v2", dict(**_MLA, n_routed_experts=8, num_experts_per_tok=3,
                                        moe_intermediate_size=32, n_shared_experts=2,
                                        topk_method="group_limited_greedy", n_group=4,
                                        topk_group=2, routed_scaling_factor=1.5)),
    # Sigmoid scores chosen with the correction bias, groups ranked by their two best, weights
    # renormalized and scaled.
    "deepseek_v3": ("deepseek_v3", dict(**_MLA, n_routed_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, n_shared_experts=1, n_group=4,
                                        topk_group=2, routed_scaling_factor=2.5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_logits_and_engine_greedy_match_transformers(tmp_path, name):
    model_type, overrides = CASES[name]
    directory = hf_utils.make_tiny_hf_checkpoint(tmp_path, model_type, seed=3, **overrides)
    model = load_hf(directory)
    assert model.config.moe is not None
    assert model.config.moe.dense_layers == ((0,) if "deepseek" in name else ())
    hf_model = hf_utils.load_hf_model(directory)

    rng = np.random.default_rng(0)
    # 64 tokens: the forward pass runs the grouped experts (`moe.default_method`).
    tokens = rng.integers(3, model.config.vocab_size, 64).tolist()
    ref = hf_utils.hf_logits(hf_model, tokens)  # [T, V]
    got = np.asarray(llama.forward_dense(model.params, model.config, jnp.asarray(tokens)))
    rtol = LOGITS_RTOL["mla" if model.config.mla is not None else "mha"]
    assert float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))) <= rtol

    prompts = hf_utils.shared_prefix_prompts(rng, model.config.vocab_size)
    expected = [hf_utils.hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    # All at once, at most two running.
    engine, tokens = hf_utils.engine_greedy(model, ENGINE, prompts, NEW_TOKENS)
    assert tokens == expected
    assert engine.prefix_cache_stats()["prefix_hit_tokens"] >= 12
    # Other prompts of the same lengths run the same step shapes: nothing compiles.
    compiled = engine.num_compiles
    other = rng.integers(3, model.config.vocab_size, 12).tolist()
    engine.generate([other + [7, 8, 9], rng.integers(3, model.config.vocab_size, 21).tolist(),
                     other + [40]], kvjax.SamplingParams(max_new_tokens=NEW_TOKENS,
                                                         ignore_eos=True))
    assert engine.num_compiles == compiled


def _brute_force_experts(p: dict, x: np.ndarray, experts: np.ndarray, weights: np.ndarray
                         ) -> np.ndarray:
    """sum_j weights[t, j] * SwiGLU expert experts[t, j] of x[t], token by token in float64."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t], weights[t], strict=True):
            gate = x[t] @ p["w_gate_exps"][e]
            act = gate / (1 + np.exp(-gate)) * (x[t] @ p["w_up_exps"][e])
            out[t] += w * (act @ p["w_down_exps"][e])
    return out


def _brute_force_moe(m: MoeConfig, p: dict, x: np.ndarray) -> np.ndarray:
    """Token by token, expert by expert, in float64: route as `MoeConfig` states it, then sum
    the chosen experts' SwiGLU outputs by their weights."""
    x = x.astype(np.float64)
    per_group = m.num_experts // m.num_groups
    chosen_all, weights_all = [], []
    for t in range(x.shape[0]):
        logits = x[t] @ p["router"]
        if m.scoring is MoeScoring.SIGMOID:
            scores = 1 / (1 + np.exp(-logits))
            choice = scores + (p["router_bias"] if m.score_bias else 0)
        else:
            scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            choice = scores.copy()
        groups = choice.reshape(m.num_groups, per_group)
        rank = (np.sort(groups, axis=1)[:, -2:].sum(1) if m.scoring is MoeScoring.SIGMOID
                else groups.max(1))
        kept = np.argsort(-rank)[:m.topk_groups]
        allowed = [e for e in range(m.num_experts) if e // per_group in kept]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:m.num_experts_per_tok]
        weights = scores[chosen] / (scores[chosen].sum() if m.norm_topk_prob else 1.0)
        chosen_all.append(chosen)
        weights_all.append(weights * m.routed_scaling)
    return _brute_force_experts(p, x, np.asarray(chosen_all), np.asarray(weights_all))


@pytest.mark.parametrize("scoring,groups", [(MoeScoring.SOFTMAX, (1, 1)),
                                            (MoeScoring.SOFTMAX, (4, 2)),
                                            (MoeScoring.SIGMOID, (4, 2))])
def test_gathered_and_all_expert_paths_equal_a_brute_force(scoring, groups):
    """A step of few tokens (T * k <= E) gathers each token's experts; a longer one runs every
    expert and sums the chosen: both give the brute force's result, token for token (the
    grouped steps of still longer ones: the next test)."""
    m = MoeConfig(num_experts=8, num_experts_per_tok=2, expert_size=12, scoring=scoring,
                  num_groups=groups[0], topk_groups=groups[1], routed_scaling=1.7,
                  norm_topk_prob=scoring is MoeScoring.SIGMOID,
                  score_bias=scoring is MoeScoring.SIGMOID)
    config = TINY_MOE.__class__(**{**TINY_MOE.__dict__, "moe": m})
    rs = np.random.RandomState(4)
    params = {name: jnp.asarray(0.5 * rs.standard_normal(shape), jnp.float32)
              for name, shape in moe.param_shapes(config).items()}
    x = rs.standard_normal((12, config.hidden_size)).astype(np.float32)
    p64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
    want = _brute_force_moe(m, p64, x)

    @jax.jit
    def run(rows):
        weights, experts = moe.route(m, rows @ params["router"], params.get("router_bias"))
        return moe.routed_experts(m, params, rows, weights, experts)

    assert moe.default_method(m, 4) is moe.ExpertsMethod.GATHER
    assert moe.default_method(m, 12) is moe.ExpertsMethod.ALL
    few = np.concatenate([run(x[i:i + 4]) for i in range(0, 12, 4)])  # 4 * 2 <= 8: gathered
    every = np.asarray(run(x))
    scale = np.abs(want).max()
    assert np.abs(few - want).max() / scale < 1e-5
    assert np.abs(every - want).max() / scale < 1e-5


_GROUPED_PARAMS = {name: jnp.asarray(0.5 * np.random.RandomState(5).standard_normal(shape),
                                     jnp.float32)
                   for name, shape in moe.param_shapes(TINY_MOE).items()}


@jax.jit(static_argnames="method")
def _routed(x, weights, experts, method):
    return moe.routed_experts(TINY_MOE.moe, _GROUPED_PARAMS, x, weights, experts,
                              method=method)


@hypothesis.settings(max_examples=12, deadline=None, database=None)
@hypothesis.given(num_tokens=st.sampled_from([24, 72]), num_used=st.integers(1, 8),
                  seed=st.integers(0, 2**31 - 1))
def test_grouped_experts_equal_a_brute_force_for_any_split(num_tokens, num_used, seed):
    """Rows routed to only some experts (the others get none; with one used expert, every
    token's first choice is that expert, in several tiles), split any way: the grouped step
    gives the brute force's sums, and the all-expert step agrees. Large steps run grouped
    (`moe.default_method`)."""
    assert moe.default_method(TINY_MOE.moe, 72) is moe.ExpertsMethod.GROUPED
    rng = np.random.default_rng(seed)
    e, k = TINY_MOE.moe.num_experts, TINY_MOE.moe.num_experts_per_tok
    used = rng.permutation(e)[:max(num_used, k)]
    experts = np.stack([rng.permutation(used)[:k] for _ in range(num_tokens)])  # [T, k]
    if num_used == 1:
        experts[:, 0] = used[0]
        experts[:, 1] = np.where(experts[:, 1] == used[0], used[1], experts[:, 1])
    weights = rng.uniform(0.1, 1.0, (num_tokens, k)).astype(np.float32)
    x = rng.standard_normal((num_tokens, TINY_MOE.hidden_size)).astype(np.float32)
    p64 = {name: np.asarray(w, np.float64) for name, w in _GROUPED_PARAMS.items()}
    want = _brute_force_experts(p64, x, experts, weights)
    scale = np.abs(want).max()
    for method in (moe.ExpertsMethod.GROUPED, moe.ExpertsMethod.ALL):
        got = np.asarray(_routed(jnp.asarray(x), jnp.asarray(weights),
                                 jnp.asarray(experts, jnp.int32), method=method))
        assert np.abs(got - want).max() / scale < 1e-5, method


def test_tiny_moe_engine_matches_the_dense_reference_across_batch_sizes():
    """The engine's greedy tokens, batch of 1 and of 3, equal the cache-free forward pass's;
    and with 64-token chunks, whose experts run grouped, a 56-token prompt's."""
    model = tiny_model(TINY_MOE)
    prompts = [[7, 21, 3, 90, 14, 60, 33, 8, 5, 41, 77], [2, 99, 64, 18, 30, 11, 45, 70, 6],
               [7, 21, 3, 90, 14, 60, 33, 8, 12, 50, 3]]
    want = [greedy_reference(model, p, 8) for p in prompts]
    greedy = kvjax.SamplingParams(max_new_tokens=8, ignore_eos=True)
    for max_num_seqs in (1, 3):
        engine = kvjax.Engine(model, kvjax.EngineConfig(**{**ENGINE,
                                                           "max_num_seqs": max_num_seqs}))
        assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == want
    long_prompt = np.random.default_rng(1).integers(3, 120, 56).tolist()
    assert moe.default_method(TINY_MOE.moe, 64) is moe.ExpertsMethod.GROUPED
    engine = kvjax.Engine(model, kvjax.EngineConfig(**{
        **ENGINE, "max_prefill_chunk": 64, "max_num_batched_tokens": 64, "max_model_len": 96}))
    short = kvjax.SamplingParams(max_new_tokens=4, ignore_eos=True)
    assert engine.generate([long_prompt], short)[0].outputs[0].token_ids == greedy_reference(
        model, long_prompt, 4)


def test_batch_invariance_is_refused_with_its_reason():
    reason = compat.MODEL_REFUSED[(ModelTrait.MOE, Feature.BATCH_INVARIANT)]
    with pytest.raises(ValueError, match=re.escape(reason)):
        kvjax.Engine(tiny_model(TINY_MOE), kvjax.EngineConfig(page_size=4, max_model_len=64,
                                                              batch_invariant=True))


# Every feature runs with the tiny MoE model through the compatibility table's own harness
# (exact ones against the dense greedy reference, approximate ones within a mean regret bound;
# no page leaked), a few to a run, or is refused for MoE in the table. Each run compiles the
# MoE engine's programs (a minute on the loaded host), so all are slow, as the MLA model's are;
# `make test` runs the check that the list is complete.
COMPOSING = [
    (Feature.HOST_TIER, Feature.SNAPSHOT, Feature.PREFIX_CACHE, Feature.SWAP),
    (Feature.SPECULATIVE, Feature.N_SAMPLES),
    (Feature.PAUSE, Feature.AUTO_PREEMPTION),
    (Feature.CONTROLLER, Feature.STREAMING),
    (Feature.INT8, Feature.H2O, Feature.SWAP),
    (Feature.KIVI, Feature.QUEST, Feature.PREFIX_CACHE),
    (Feature.KIVI_RESIDUAL, Feature.SNAPKV),
    (Feature.STREAMING_ROTATED, Feature.SWAP),
    (Feature.TOVA, Feature.KV_ARENA),
    (Feature.KNORM, Feature.PREFIX_CACHE),
    (Feature.EXPECTED_ATTENTION, Feature.FUSED_KV_WRITE),
    (Feature.OBSERVED_ATTENTION, Feature.HOST_TIER),
    (Feature.KVZIP, Feature.N_SAMPLES),
    (Feature.CONTEXT_REUSE, Feature.HOST_TIER),
    (Feature.CONTIGUOUS,),
    (Feature.HOST_ROWS, Feature.SWAP),
    (Feature.PYRAMID, Feature.PREFIX_CACHE),
    (Feature.ADAKV, Feature.N_SAMPLES),
    (Feature.PYRAMID_ADAKV, Feature.SWAP),
    (Feature.PER_HEAD, Feature.PREFIX_CACHE),
    (Feature.GLOBAL, Feature.SWAP),
    (Feature.ECHO, Feature.INT8),
    (Feature.RECORD_DECISIONS, Feature.SWAP),
    (Feature.DISAGGREGATION, Feature.INT8),
    (Feature.LOWRANK, Feature.SWAP),
    (Feature.MIXED_PRECISION, Feature.SNAPSHOT),
]
# The tiny MoE model's regret bounds (nats; see tests/engine/test_compatibility.py): measured
# 0.56 with context reuse (CacheBlend, recompute ratio 0.5) and 2.96 with ObservedAttention at
# the table's budget of 10 tokens, above the dense tiny model's 0.5 / 2.5 that the table's
# bounds were set from; random tokens score 6.9 on this model.
MOE_MAX_MEAN_REGRET = {"codec": 0.75, "retention": 3.5}
# Features whose MoE runs need a process of their own (8 fake devices), tested there.
TESTED_ELSEWHERE = {
    Feature.MESH: "tests/parallel/test_sharding.py::test_moe_on_a_tp2_mesh_matches_single_device",
}


def test_every_feature_is_run_with_a_moe_model_or_refused_for_it():
    """A feature added to the table must join a MoE run below or be refused for MoE."""
    run = {f for features in COMPOSING for f in features}
    refused = {f for trait, f in compat.MODEL_REFUSED if trait is ModelTrait.MOE}
    assert not run & refused
    assert set(Feature) == run | refused | set(TESTED_ELSEWHERE)


@pytest.mark.parametrize("features", COMPOSING, ids=lambda fs: "+".join(f.value for f in fs))
def test_features_compose_with_a_moe_model(features):
    from engine.test_compatibility import check_outcome, greedy_oracle, run_pair

    assert not [p for p in itertools.combinations(features, 2) if compat.refusal(*p)]
    model = tiny_model(TINY_MOE)
    check_outcome(features, run_pair(model, features, greedy_oracle(model)),
                  MOE_MAX_MEAN_REGRET)


_BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
             num_attention_heads=4, num_experts_per_tok=2)
_DEEPSEEK = dict(_BASE, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=12, n_routed_experts=8, moe_intermediate_size=32)


@pytest.mark.parametrize("hf_config,dense_layers", [
    (dict(_DEEPSEEK, model_type="deepseek_v2", first_k_dense_replace=1, moe_layer_freq=2),
     (0, 1, 3)),
    (dict(_DEEPSEEK, model_type="deepseek_v3", first_k_dense_replace=2), (0, 1)),
    (dict(_BASE, model_type="qwen3_moe", num_experts=8, moe_intermediate_size=32,
          mlp_only_layers=[1], decoder_sparse_step=2), (0, 1, 2)),
    (dict(_BASE, model_type="mixtral", num_local_experts=4), ()),
])
def test_dense_layers_follow_the_config(hf_config, dense_layers):
    assert config_from_hf(hf_config).moe.dense_layers == dense_layers


@pytest.mark.parametrize("overrides,message", [
    (dict(model_type="deepseek_v2", topk_method="noaux_tc"), "topk_method 'noaux_tc'"),
    (dict(model_type="deepseek_v3", scoring_func="softmax"), "scoring_func 'softmax'"),
    (dict(model_type="deepseek_v3", n_group=3), "do not split into num_groups=3"),
    (dict(model_type="deepseek_v2", num_experts_per_tok=9), "exceeds num_experts=8"),
])
def test_unsupported_moe_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**_DEEPSEEK, **overrides})
