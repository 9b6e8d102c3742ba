"""bfloat16 weights and KV pages on the CPU: what a user of `--dtype bfloat16` relies on.

The oracle is the float32 dense forward pass (`kvjax.testing.greedy_reference`, no KV cache)
over the same weights rounded to bfloat16, so only the engine's bfloat16 activations, KV pages
and kernels can make it differ, not the rounding of the weights.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import Engine, EngineConfig, SamplingParams
from kvjax.engine.step import StepInput, empty_step_input
from kvjax.kv import native
from kvjax.testing import TINY, greedy_reference, tiny_model

# Head dim 64: the native prefill kernel's (as well as the decode kernel's), so bfloat16
# pages go through both native kernels.
CONFIG = dataclasses.replace(TINY, head_dim=64)
BASE = dict(page_size=4, max_num_seqs=2, max_num_batched_tokens=32, max_prefill_chunk=16,
            max_prefill_seqs=1, max_model_len=48, num_pages=48)
PROMPTS = [[3, 17, 42, 9, 88, 5, 61, 23, 14, 77, 30, 2, 99, 45, 8, 71, 12, 64, 33],
           [7, 7, 100, 1, 56], [120, 4, 19, 90, 26, 39, 11, 73, 58, 6, 81]]
NUM_AGREE = 4  # greedy tokens each prompt must share with the float32 oracle


@pytest.fixture(scope="module")
def models():
    """(the bfloat16 model, the float32 model of the same bfloat16-rounded weights)."""
    bf16 = tiny_model(CONFIG)
    bf16 = dataclasses.replace(bf16, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                         bf16.params))
    f32 = dataclasses.replace(bf16, params=jax.tree.map(lambda x: x.astype(jnp.float32),
                                                        bf16.params))
    return bf16, f32


def test_bfloat16_engine_greedy_tokens_agree_with_float32(models):
    bf16, f32 = models
    engine = Engine(bf16, EngineConfig(**BASE))
    assert native.prefill_reason_for(engine.kv) is None  # the native bf16 prefill runs
    assert engine.kv.page_leaves()[0].dtype == jnp.bfloat16
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = greedy_reference(f32, prompt, NUM_AGREE)
        assert out.outputs[0].token_ids[:NUM_AGREE] == want, prompt


def test_bfloat16_step_converts_no_weights_or_pages_to_float32(models):
    """XLA's CPU bfloat16 normalization used to convert every stacked weight and the whole page
    pool to float32 in each step (`kvjax.jit`): no float32 array of a stacked weight's or the
    pool's shape may appear in a compiled bfloat16 step."""
    bf16, _ = models
    engine = Engine(bf16, EngineConfig(**BASE))
    runner = engine.runner
    pool_shape = engine.kv.page_leaves()[0].shape
    stacked = {w.shape for w in jax.tree.leaves(bf16.params) if w.ndim == 3}
    shapes = {",".join(map(str, s)) for s in stacked | {pool_shape}}
    for shape in runner.buckets.step_shapes()[:2]:  # a decode and a prefill step
        host = empty_step_input(shape, runner.num_tables)
        text = runner.programs._step.lower(
            runner.params[bf16.weights_version], engine.kv, StepInput(**host),
            shape=shape).compile().as_text()
        f32_arrays = set(re.findall(r"f32\[([0-9,]+)\]", text))
        assert not f32_arrays & shapes, (shape, f32_arrays & shapes)


def test_bfloat16_warmup_compiles_as_float32_and_stays_flat(models):
    """As many programs as float32 (one per step shape), and none after warm-up."""
    bf16, f32 = models
    counts = {}
    for model in (f32, bf16):
        engine = Engine(model, EngineConfig(**BASE))
        before = engine.num_compiles
        counts[model.dtype.name] = engine.warmup() - before
    assert counts["bfloat16"] == counts["float32"]
    warm = engine.num_compiles
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 120, size=int(rng.integers(1, 40)))]
               for _ in range(8)]
    engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert engine.num_compiles == warm
