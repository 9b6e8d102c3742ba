"""Paged and contiguous KV give identical logits for the same inputs, and both match the
cache-free dense forward pass."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.engine.step import LogitsMode, StepPrograms, StepShape, empty_step_input
from kvjax.kv.state import init_contiguous_kv, init_paged_kv
from kvjax.models import llama
from kvjax.testing import tiny_model

P = 4
WIDTH = 16  # block table width (pages per sequence)


def _prefill_then_decode(runner, model, kv, tables, prompts, next_tokens):
    """One prefill step for all prompts (packed), then one decode step; returns both steps'
    logits."""
    lens = [len(p) for p in prompts]
    shape = StepShape(0, len(prompts), 64, WIDTH, logits_mode=LogitsMode.ALL, row_chunk=16)
    buf = empty_step_input(shape)
    starts = np.cumsum([0] + lens[:-1])
    for b, (prompt, table, t0) in enumerate(zip(prompts, tables, starts, strict=True)):
        pos = np.arange(len(prompt))
        buf["tokens"][t0:t0 + len(prompt)] = prompt
        buf["positions"][t0:t0 + len(prompt)] = pos
        buf["slot_mapping"][t0:t0 + len(prompt)] = table[pos // P] * P + pos % P
        buf["block_tables"][b] = table
        buf["kv_lens"][b] = buf["q_lens"][b] = len(prompt)
        buf["row_starts"][b] = t0
        buf["token_rows"][t0:] = b
    out, kv = runner.step(model.params, kv, buf, shape)
    prefill_logits = [np.asarray(out.logits[t0:t0 + n]) for t0, n in zip(starts, lens, strict=True)]
    shape = StepShape(len(prompts), 0, 1, WIDTH, logits_mode=LogitsMode.LAST)
    buf = empty_step_input(shape)
    for b, (n, table, token) in enumerate(zip(lens, tables, next_tokens, strict=True)):
        buf["tokens"][b], buf["positions"][b] = token, n
        buf["slot_mapping"][b] = table[n // P] * P + n % P
        buf["block_tables"][b] = table
        buf["kv_lens"][b], buf["q_lens"][b] = n + 1, 1
    out, kv = runner.step(model.params, kv, buf, shape)
    return prefill_logits, np.asarray(out.logits)


def test_paged_and_contiguous_logits_identical():
    model = tiny_model()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=n).astype(np.int32) for n in (13, 1, 16)]
    next_tokens = [7, 9, 11]
    runner = StepPrograms(model.config)
    # Paged: a shuffled pool with pages scattered across it.
    paged = init_paged_kv(model.config, 64, P)
    perm = rng.permutation(64).astype(np.int32)
    paged_tables = [perm[i * WIDTH:(i + 1) * WIDTH] for i in range(3)]
    contiguous = init_contiguous_kv(model.config, 3, WIDTH * P, P)
    slot_tables = [contiguous.block_table(i, WIDTH) for i in range(3)]
    paged_prefill, paged_decode = _prefill_then_decode(runner, model, paged, paged_tables,
                                                       prompts, next_tokens)
    cont_prefill, cont_decode = _prefill_then_decode(runner, model, contiguous, slot_tables,
                                                     prompts, next_tokens)
    for a, b in zip(paged_prefill, cont_prefill, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(paged_decode, cont_decode)
    for b, prompt in enumerate(prompts):
        dense = llama.forward_dense(model.params, model.config,
                                    jnp.asarray(list(prompt) + [next_tokens[b]]))
        np.testing.assert_allclose(paged_prefill[b], np.asarray(dense[:-1]), atol=1e-4)
        np.testing.assert_allclose(paged_decode[b], np.asarray(dense[-1]), atol=1e-4)


def test_contiguous_layout_serves_parallel_samples():
    """n > 1 on the contiguous baseline forks a slot by copying its pages."""
    from kvjax import EngineConfig, KVLayout, SamplingParams
    from kvjax.engine.engine import Engine
    from kvjax.testing import greedy_reference

    model = tiny_model()
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32]
    engine = Engine(model, EngineConfig(kv_layout=KVLayout.CONTIGUOUS, page_size=4,
                                        max_num_seqs=4, max_prefill_chunk=16))
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=8, n=3))
    assert [o.token_ids for o in out.outputs] == [greedy_reference(model, prompt, 8)] * 3
