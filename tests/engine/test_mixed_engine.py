"""An engine on a mixed-precision pool (kv_codec='mixed'): exact tokens while every row is
exact, and in-place demotion instead of preemption under a tight budget.

The oracle of exactness is the cache-free greedy reference (and the default engine); a tight
budget's outcome is checked against the same engine with the fixed controller, which has only
preemption to make room.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.scheduler.controller import SLO
from kvjax.testing import TINY, greedy_reference, tiny_model

P = 4
TIGHT = dict(page_size=P, num_pages=9, max_num_seqs=3, max_num_batched_tokens=16,
             max_prefill_chunk=16, min_chunk_bucket=16, max_prefill_seqs=1, max_model_len=32,
             enable_prefix_cache=False)
KL_TABLE = {8: 0.01, 4: 0.05}  # nats per token the controller prices int8 / int4 at


def _serve(engine: Engine, prompts, num_new: int, **request) -> dict:
    """request id -> its finished RequestOutput."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=num_new,
                                                           ignore_eos=True),
                           **({k: v(i) for k, v in request.items()}))
    out = {}
    while engine.has_unfinished():
        out.update((o.request_id, o) for o in engine.step() if o.finished)
    return out


def _tokens(outputs: dict) -> dict[str, list[int]]:
    return {r: o.outputs[0].token_ids for r, o in outputs.items()}


def test_mixed_pool_at_exact_serves_the_greedy_reference_with_flat_compiles():
    """Rows written exact and never demoted give the cache-free reference's tokens through the
    pool's words, preempting under the tight budget like any pool; a second identical
    workload compiles nothing new and leaves the ledger empty."""
    model = tiny_model()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 120, 16)] for _ in range(3)]
    engine = Engine(model, EngineConfig(**TIGHT, kv_codec="mixed",
                                        kv_codec_options=dict(group=4)))
    want = {f"r{i}": greedy_reference(model, p, 8) for i, p in enumerate(prompts)}
    assert _tokens(_serve(engine, prompts, 8)) == want
    assert engine.stats["preemptions"] > 0
    compiles = engine.num_compiles
    assert _tokens(_serve(engine, prompts, 8)) == want
    assert engine.num_compiles == compiles
    ledger = engine.scheduler.in_place.ledger
    assert engine.allocator.num_used_pages() == 0 and ledger.bytes_held == 0
    assert ledger.bytes_freed == 0


def test_mixed_pool_options_are_checked():
    with pytest.raises(ValueError, match="write_bits"):
        EngineConfig(**TIGHT, kv_codec="mixed", kv_codec_options=dict(write_bits=(2, 0)))
    with pytest.raises(ValueError, match="colour"):
        EngineConfig(**TIGHT, kv_codec="mixed", kv_codec_options=dict(colour=1))
    with pytest.raises(ValueError, match="prefix"):
        EngineConfig(**{**TIGHT, "enable_prefix_cache": True}, kv_codec="mixed")
    with pytest.raises(ValueError, match="NATIVE"):
        EngineConfig(**TIGHT, kv_codec="mixed", attention_impl="native")


def test_tight_budget_demotes_in_place_instead_of_preempting():
    """Three requests whose pages outgrow a budget of 9 exact pages: the fixed controller
    preempts; the in-place controller re-encodes running sequences' cold pages at int8 / int4
    instead, within each request's KL budget, and preempts none. Nothing compiles after
    warm-up (every DEMOTE op is padded to one width), over two workloads."""
    model = tiny_model(dataclasses.replace(TINY, head_dim=32, name="tiny-d32"))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 120, 16)] for _ in range(3)]
    request = dict(slo=lambda i: SLO(ttft_s=60.0, tpot_s=60.0, kl_budget=0.1),
                   priority=lambda i: i)
    config = dict(TIGHT, kv_codec="mixed", kv_codec_options=dict(group=32))
    fixed = Engine(model, EngineConfig(**config))
    _serve(fixed, prompts, 8, **request)
    assert fixed.stats["preemptions"] > 0
    engine = Engine(model, EngineConfig(**config, controller="inplace",
                                        controller_options=dict(demote_kl=KL_TABLE)))
    ledger = engine.scheduler.in_place.ledger
    compiles = engine.warmup()
    for _ in range(2):
        out = _serve(engine, prompts, 8, **request)
        assert sorted(out) == ["r0", "r1", "r2"]
        assert all(len(t) == 8 for t in _tokens(out).values())
        assert engine.stats["preemptions"] == 0
        assert ledger.bytes_freed > 0 and ledger.bytes_held == 0
        assert engine.allocator.num_used_pages() == 0
        spent = [o.kl_spent for o in out.values()]
        assert max(spent) > 0 and all(kl <= 0.1 + 1e-9 for kl in spent), spent
        assert engine.num_compiles == compiles
