"""EngineConfig.fused_kv_write beside the Pallas attention: the Pallas kernel writes K and V
(the keys' per-head norm of a qk_norm model inside it) into the pages, in every step.

Oracles: the same engine without the fused write (its tokens and its pages after the run) and
the cache-free dense forward pass (`greedy_reference`). On the CPU the kernels run through the
Pallas interpreter (slow: a tiny model, short prompts).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.testing import TINY, greedy_reference, tiny_model

PROMPTS = [[7, 21, 3, 90, 14, 60, 33, 8, 5], [2, 99, 64, 18, 30], [40, 41]]
GREEDY = kvjax.SamplingParams(max_new_tokens=4, ignore_eos=True)
# Qwen3's form: each key head RMS-normalized before RoPE, biased projections.
QWEN3_LIKE = dataclasses.replace(TINY, qk_norm=True, qkv_bias=True, name="tiny-qwen3")


def _qwen3_like():
    model = tiny_model(QWEN3_LIKE)
    layers = dict(model.params["layers"])
    rng = np.random.default_rng(5)
    for name in ("q_norm", "k_norm"):  # not all ones: the weight must be applied
        layers[name] = jnp.asarray(rng.uniform(0.5, 1.5, layers[name].shape), jnp.float32)
    return dataclasses.replace(model, params={**model.params, "layers": layers})


def _run(model, fused, **overrides):
    engine = kvjax.Engine(model, kvjax.EngineConfig(**{
        **dict(num_pages=24, page_size=4, max_num_seqs=3, max_prefill_chunk=8,
               max_num_batched_tokens=16, attention_impl="pallas"), **overrides},
        fused_kv_write=fused))
    tokens = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]
    return engine, tokens


@pytest.mark.parametrize("matmul_impl", ["auto", "xla"])
def test_tokens_and_pages_equal_the_unfused_step(matmul_impl):
    """auto: the native matmuls' stacked weights (the kernel picks the layer); xla: the
    layer scan's weight slices. Compile counts stay flat on the same workload again."""
    model = _qwen3_like()
    fused, got = _run(model, True, matmul_impl=matmul_impl)
    unfused, want = _run(model, False, matmul_impl=matmul_impl)
    assert got == want == [greedy_reference(model, p, GREEDY.max_new_tokens) for p in PROMPTS]
    for name in ("k_pages", "v_pages"):
        np.testing.assert_allclose(np.asarray(getattr(fused.kv, name)),
                                   np.asarray(getattr(unfused.kv, name)), rtol=1e-5,
                                   atol=1e-5)
    fused.generate(PROMPTS, GREEDY)  # prefix-cache hits: their step shapes compile
    compiled = fused.num_compiles
    fused.generate(PROMPTS, GREEDY)
    assert fused.num_compiles == compiled


def test_written_pages_are_the_kernels_not_the_scatter(monkeypatch):
    """With the Pallas kernel replaced by one that writes nothing, the pages stay empty: the
    engine's K/V reach the pages only through the kernel (no scatter beside it)."""
    from pallas_kernels.fused_kv_write import kernel

    monkeypatch.setattr(kernel, "_pipelined", lambda x, wk, wv, bias, norm, cos, sin, slots,
                        kp, vp, *a, **kw: (kp, vp))
    jax.clear_caches()
    engine = kvjax.Engine(_qwen3_like(), kvjax.EngineConfig(
        num_pages=24, page_size=4, max_num_seqs=3, attention_impl="pallas",
        fused_kv_write=True))
    engine.generate(PROMPTS[:1], kvjax.SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert not np.any(np.asarray(engine.kv.k_pages))


def test_greedy_tokens_equal_the_dense_reference():
    """The cheap case: one short prompt through the fused write of a qk_norm model."""
    model = _qwen3_like()
    engine = kvjax.Engine(model, kvjax.EngineConfig(
        num_pages=8, page_size=4, max_num_seqs=1, attention_impl="pallas",
        fused_kv_write=True))
    out = engine.generate([PROMPTS[2]], kvjax.SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert out[0].outputs[0].token_ids == greedy_reference(model, PROMPTS[2], 2)
