"""EngineConfig.fused_kv_write: the K/V projection writes its rows into the pages itself.

Oracles: the cache-free dense forward pass (`greedy_reference`) and the same engine without the
fused write (its tokens; in batch-invariant mode its logprobs, bitwise).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.engine import compat
from kvjax.models import linear
from kvjax.testing import TINY, greedy_reference, tiny_model

pytestmark = pytest.mark.skipif(linear.kv_write_unavailable_reason() is not None,
                                reason=str(linear.kv_write_unavailable_reason()))

PAGE = 4
PROMPTS = [[7, 21, 3, 90, 14, 60, 33, 8, 5, 41, 77], [2, 99, 64, 18, 30, 11, 45, 70, 6],
           [7, 21, 3, 90, 14, 60, 33, 8, 12, 50, 3], [40, 41]]
GREEDY = kvjax.SamplingParams(max_new_tokens=8, ignore_eos=True)


def _engine(model, fused, **overrides):
    config = dict(num_pages=14, page_size=PAGE, max_num_seqs=4, max_prefill_chunk=8,
                  max_num_batched_tokens=16, enable_prefix_cache=True)
    return kvjax.Engine(model, kvjax.EngineConfig(**{**config, **overrides},
                                                  fused_kv_write=fused))


@pytest.mark.parametrize("config", [
    TINY,
    # Biased projections, and sliding-window layers whose pool slots follow their groups.
    dataclasses.replace(TINY, qkv_bias=True, layer_windows=(6, 0), name="tiny-bias-windows"),
], ids=["llama", "bias-windows"])
def test_greedy_tokens_equal_the_dense_reference_and_compiles_stay_flat(config):
    model = tiny_model(config)
    engine = _engine(model, True)
    got = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert engine.stats["preemptions"] > 0  # 14 pages: sequences recomputed mid-run
    assert got == [greedy_reference(model, p, GREEDY.max_new_tokens) for p in PROMPTS]
    # The same workload again (its step shapes all compiled): nothing new compiles.
    compiled = engine.num_compiles
    engine.generate(PROMPTS, GREEDY)
    assert engine.num_compiles == compiled


def test_compile_count_flat_after_warmup_with_steps_past_the_native_matmul(monkeypatch):
    """Steps of more than NATIVE_MAX_TOKENS tokens (XLA's matmuls and the scatter under AUTO;
    the float32 limit lowered to 128 here to keep the prompt short) beside fused decode steps:
    the long prompt's tokens are the dense reference's, and nothing compiles after warm-up."""
    monkeypatch.setitem(linear.NATIVE_MAX_TOKENS, jnp.dtype(jnp.float32), 128)
    model = tiny_model()
    engine = _engine(model, True, num_pages=96, max_prefill_chunk=256,
                     max_num_batched_tokens=256)
    warm = engine.warmup()
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 120, int(n))] for n in rng.integers(1, 30, 8)]
    prompts.append([int(t) for t in rng.integers(0, 120, 128 + 40)])
    outs = engine.generate(prompts, kvjax.SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert engine.num_compiles == warm
    assert outs[-1].outputs[0].token_ids == greedy_reference(model, prompts[-1], 5)


def test_batch_invariant_logprobs_are_bitwise_the_unfused_modes():
    """The kernel's invariant products and RoPE round as the unfused invariant step's XLA ops
    do: the same logprobs bit for bit, beside companions."""
    model = tiny_model()
    sampled = kvjax.SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9,
                                   top_p=0.9, seed=3)
    outs = {fused: _engine(model, fused, batch_invariant=True, num_pages=64).generate(
        PROMPTS, sampled) for fused in (True, False)}
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_array_equal(np.asarray(a.outputs[0].logprobs),
                                      np.asarray(b.outputs[0].logprobs))


def test_refused_where_it_cannot_write():
    qk_norm = tiny_model(dataclasses.replace(TINY, qk_norm=True, name="tiny-qk-norm"))
    with pytest.raises(ValueError, match="tiny-qk-norm.*does not reproduce bit for bit"):
        _engine(qk_norm, True, batch_invariant=True)
    model = tiny_model()
    bf16 = dataclasses.replace(model, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                          model.params))
    with pytest.raises(ValueError, match="fused_kv_write for model 'tiny'.*bfloat16"):
        _engine(bf16, True)
    with pytest.raises(ValueError, match="fused_kv_write for model 'tiny'.*bfloat16 pages"):
        _engine(model, True, kv_dtype="bfloat16")
    with pytest.raises(ValueError, match=compat.refusal(compat.Feature.INT8,
                                                        compat.Feature.FUSED_KV_WRITE)):
        _engine(model, True, kv_codec="int8")
    with pytest.raises(ValueError, match="matmul_impl='xla'"):
        kvjax.EngineConfig(fused_kv_write=True, matmul_impl="xla")
    kvjax.EngineConfig(fused_kv_write=True, matmul_impl="xla", attention_impl="pallas")


def test_qk_norm_model_greedy_tokens_equal_the_dense_reference():
    """The keys' per-head norm inside the native kernel (Qwen3's form, non-unit weights)."""
    model = tiny_model(dataclasses.replace(TINY, qk_norm=True, name="tiny-qk-norm"))
    layers = dict(model.params["layers"])
    layers["k_norm"] = jnp.asarray(np.random.default_rng(2).uniform(0.5, 1.5, (2, 8)),
                                   jnp.float32)
    model = dataclasses.replace(model, params={**model.params, "layers": layers})
    got = [o.outputs[0].token_ids for o in _engine(model, True).generate(PROMPTS, GREEDY)]
    assert got == [greedy_reference(model, p, GREEDY.max_new_tokens) for p in PROMPTS]
