"""The engine under the prefill presses (knorm, expected_attention, observed_attention).

The oracle: the cache-free dense forward pass records every layer's queries, keys and values of
the prompt, and tests/presses_reference.py scores them (summed over layers) in numpy. After
the step that completes the prefill, the engine caches exactly the reference's kept tokens, and
the allocator holds exactly the pages of the budget (the others went back to the pool); a second
request of the same shape compiles nothing. TOVA runs against the masked dense oracle of
tests/engine/test_engine_retention.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import presses_reference as ref
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.models import llama
from kvjax.models.rope import RoPE, RopeType
from kvjax.testing import tiny_model

P = 4
CHUNK = 32  # the prompt is prefilled in one step (ExpectedAttention's statistics: all of it)
PROMPT, BUDGET, MAX_NEW = 22, 8, 5
BASE = dict(page_size=P, max_num_batched_tokens=CHUNK, max_prefill_chunk=CHUNK,
            min_chunk_bucket=CHUNK, max_num_seqs=2, max_prefill_seqs=1, num_pages=32,
            max_model_len=64, enable_prefix_cache=False)
EA_OPTIONS = dict(num_sinks=2, num_future=32)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompt_of(seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 120, size=PROMPT)]


def dense_qkv(model, tokens):
    """Every layer's q [L, S, N, D], k, v [L, S, K, D] of the dense causal forward pass."""
    config = model.config
    t = len(tokens)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))

    def attend(layer, q, k, v, captured):
        g = config.group_size
        qg = q.reshape(t, config.num_kv_heads, g, config.head_dim).astype(jnp.float32)
        scores = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32)) / np.sqrt(
            config.head_dim)
        probs = jax.nn.softmax(jnp.where(causal[None, None], scores, -jnp.inf), axis=-1)
        out = jnp.einsum("kgts,skd->tkgd", probs, v.astype(jnp.float32))
        qs, ks, vs = captured
        captured = (qs.at[layer].set(q), ks.at[layer].set(k), vs.at[layer].set(v))
        return out.reshape(t, config.num_heads, config.head_dim).astype(q.dtype), captured

    shape = (config.num_layers, t)
    init = (jnp.zeros((*shape, config.num_heads, config.head_dim)),
            jnp.zeros((*shape, config.num_kv_heads, config.head_dim)),
            jnp.zeros((*shape, config.num_kv_heads, config.head_dim)))
    _, (q, k, v) = llama.decode_body(model.params, config, jnp.asarray(tokens, jnp.int32),
                                     jnp.arange(t, dtype=jnp.int32), attend, init)
    return np.asarray(q), np.asarray(k), np.asarray(v)


def reference_keep(model, name, prompt) -> list[int]:
    q, k, v = dense_qkv(model, prompt)
    rope = model.config.rope
    assert rope.rope_type is RopeType.DEFAULT
    inv_freq = 1.0 / rope.theta ** (np.arange(0, model.config.head_dim, 2)
                                    / model.config.head_dim)
    layers = range(model.config.num_layers)
    if name == "knorm":
        return ref.keep(sum(ref.knorm(k[i]) for i in layers), BUDGET)
    if name == "observed_attention":
        return ref.keep(sum(ref.observed(q[i], k[i]) for i in layers), BUDGET)
    scores = sum(ref.expected_attention(q[i], k[i], v[i], inv_freq, covariance=True,
                                        vnorm=True, **EA_OPTIONS) for i in layers)
    return ref.keep(scores, BUDGET, first=EA_OPTIONS["num_sinks"])


def serve(engine, request_id, prompt, max_new=MAX_NEW):
    """Runs one request; after each step, its cached positions and the pages in use."""
    engine.add_request(request_id, prompt,
                       SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    steps, output = [], None
    while engine.has_unfinished():
        for out in engine.step():
            output = out
        steps.append((engine.retention.cached_positions(f"{request_id}#0").tolist(),
                      engine.allocator.num_used_pages()))
    assert engine.allocator.num_used_pages() == 0, "pages leaked"
    return output.outputs[0].token_ids, steps


OPTIONS = {"knorm": {}, "observed_attention": {}, "expected_attention": EA_OPTIONS}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_prefill_press_keeps_the_reference_tokens_and_returns_the_rest_of_its_pages(model,
                                                                                  name):
    engine = Engine(model, EngineConfig(**BASE, retention=name, retention_budget=BUDGET,
                                        retention_options=OPTIONS[name]))
    engine.warmup()  # every compaction size: how many tokens move depends on the prompt
    prompt = prompt_of(0)
    tokens, steps = serve(engine, "a", prompt)
    assert len(tokens) == MAX_NEW
    cached, used = steps[0]  # the prefill step, compressed after it ran
    assert cached == reference_keep(model, name, prompt)
    assert used == -(-BUDGET // P)
    assert engine.retention.stats["freed_pages"] == -(-PROMPT // P) - -(-BUDGET // P)
    for i, (cached, used) in enumerate(steps[1:-1], start=1):  # generated tokens are all kept
        assert len(cached) == BUDGET + i
        assert used == -(-(BUDGET + i) // P)
    compiles = engine.num_compiles
    serve(engine, "b", prompt_of(1))
    assert engine.num_compiles == compiles, "a request of the same shape compiled"


def test_expected_attention_refuses_a_rope_that_depends_on_the_position(model):
    dynamic = RoPE(RopeType.DYNAMIC, factor=2.0, original_max_position_embeddings=16)
    scaled = tiny_model(dataclasses.replace(model.config, rope=dynamic))
    with pytest.raises(ValueError, match="retention='expected_attention' does not serve model"):
        Engine(scaled, EngineConfig(**BASE, retention="expected_attention",
                                    retention_budget=BUDGET))


def test_tova_holds_the_pages_of_its_budget_plus_at_most_one(model):
    """TOVA evicts at budget + P cached tokens back to the budget, the prompt's step
    included: the allocator holds the pages of what it caches and never more."""
    engine = Engine(model, EngineConfig(**BASE, retention="tova", retention_budget=BUDGET))
    tokens, steps = serve(engine, "a", prompt_of(0) + prompt_of(1)[:2], max_new=7)  # 24 tokens
    assert len(tokens) == 7
    assert [len(cached) for cached, _ in steps[:-1]] == [8, 9, 10, 11, 8, 9]
    assert [used for _, used in steps[:-1]] == [2, 3, 3, 3, 2, 3]
    # 24 tokens (6 pages) down to 8 (2 pages), then 12 (3 pages) down to 8.
    assert engine.retention.stats["freed_pages"] == 4 + 1


def test_the_uniform_budget_scheme_keeps_what_the_engine_keeps(model):
    """`kvjax.kv.budgets`' uniform scheme over the per-layer, per-head scores of the simulated
    cache (`kvjax.bench.budgets`) is what the engine's SnapKV caches after the prefill, so the
    per-layer and per-head schemes are measured beside the engine's own selection."""
    from kvjax.bench import budgets as bench_budgets
    from kvjax.kv.budgets import BudgetScheme

    engine = Engine(model, EngineConfig(**BASE, retention="snapkv", retention_budget=BUDGET,
                                        retention_options=dict(window=4)))
    prompt = prompt_of(2)
    _, steps = serve(engine, "a", prompt)
    q, k, v, _ = bench_budgets.capture_qkv(model, prompt)
    press = bench_budgets.PressSpec("snapkv", window=4)
    scores = bench_budgets.layer_head_scores(q, k, v, press, model.config.rope)
    kept = BudgetScheme().select(scores, BUDGET, last=4, rank=press.rank)
    assert (kept == kept[:1, :1]).all(), "the uniform scheme keeps one set everywhere"
    assert steps[0][0] == np.flatnonzero(kept[0, 0]).tolist()
    assert steps[0][1] == -(-BUDGET // P)
