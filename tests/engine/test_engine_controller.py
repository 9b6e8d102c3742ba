"""An engine under a KV controller: decisions carried out, exact requests kept exact, lossy
ones within their KL budgets, nothing dropped, nothing recompiled."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.scheduler.controller import SLO
from kvjax.testing import greedy_reference, tiny_model

NUM_NEW = 8
TABLE = {"4": 0.3, "8": 0.1}
BASE = dict(page_size=4, num_pages=14, max_num_seqs=3, max_num_batched_tokens=16,
            max_prefill_chunk=16, min_chunk_bucket=16, max_prefill_seqs=1, max_model_len=40,
            enable_prefix_cache=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(1)
    return [rng.integers(3, model.config.vocab_size, size=n).tolist()
            for n in (20, 18, 22, 12, 16)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [greedy_reference(model, p, NUM_NEW) for p in prompts]


def serve(model, prompts, config, kl_budgets):
    """Serves the prompts, the later ones outranking the earlier ones (so the controller
    makes room for them); returns the outputs by index and the engine."""
    engine = Engine(model, EngineConfig(**{**BASE, **config}))
    compiles = engine.warmup()
    for i, (prompt, kl) in enumerate(zip(prompts, kl_budgets, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=NUM_NEW,
                                                           ignore_eos=True),
                           priority=i // 2, slo=SLO(ttft_s=60.0, tpot_s=60.0, kl_budget=kl))
    outs = {}
    while engine.has_unfinished():
        outs.update((int(o.request_id[1:]), o) for o in engine.step())
    assert engine.num_compiles == compiles, "a controller decision compiled a program"
    assert engine.allocator.num_used_pages() == 0
    return outs, engine


def test_joint_controller_keeps_exact_requests_exact(model, prompts, reference):
    """Exact-only SLOs: the joint controller may only reorder, preempt and swap, so greedy
    tokens equal the cache-free reference."""
    outs, engine = serve(model, prompts, dict(controller="joint", controller_options=dict(
        retention_kl=TABLE, demote_kl=0.01)), [0.0] * len(prompts))
    assert engine.stats["preemptions"] > 0 and engine.stats["demoted_swaps"] == 0
    for i, ref in enumerate(reference):
        assert outs[i].outputs[0].token_ids == ref and outs[i].kl_spent == 0.0


def test_demoted_swaps_move_fewer_bytes_within_the_kl_budget(model, prompts, reference):
    """Swap preemption with int8 host copies for the requests that accept their KL: fewer
    host bytes than full copies, their KL spent reported, the exact-only ones untouched."""
    budgets = [0.0, 0.0, 0.5, 0.5, 0.5]  # the victims (the latest arrivals) accept int8
    config = dict(preemption_mode="swap", num_pages=10)
    plain, plain_engine = serve(model, prompts, dict(config, controller="fixed"), budgets)
    demoted, engine = serve(model, prompts, dict(config, controller="codec",
                                                 controller_options=dict(demote_kl=0.01)),
                            budgets)
    assert engine.stats["demoted_swaps"] > 0
    assert engine.stats["swaps_out"] == plain_engine.stats["swaps_out"]
    assert engine.stats["swap_bytes"] < plain_engine.stats["swap_bytes"]
    for i, kl in enumerate(budgets):
        out = demoted[i]
        assert len(out.outputs[0].token_ids) == NUM_NEW
        if kl == 0.0:
            assert out.kl_spent == 0.0 and out.outputs[0].token_ids == reference[i]
        assert out.kl_spent <= kl
    assert any(demoted[i].kl_spent > 0 for i in range(len(prompts)))


def test_retention_budgets_within_each_requests_kl_budget(model, prompts, reference):
    """A streaming engine whose sequences start exact: the controller shrinks the budgets of
    requests that accept the loss (measured table), never the exact-only ones'."""
    budgets = [1.0, 0.2, 0.0, 1.0, 0.0]
    outs, engine = serve(model, prompts, dict(
        controller="retention", controller_options=dict(retention_kl=TABLE),
        retention="streaming", retention_budget=12, retention_options=dict(num_sinks=2)),
        budgets)
    assert engine.retention.stats["evictions"] > 0
    for i, kl in enumerate(budgets):
        assert outs[i].kl_spent <= kl
        if kl == 0.0:
            assert outs[i].outputs[0].token_ids == reference[i]
    assert any(outs[i].kl_spent > 0 for i in range(len(prompts)))


def test_bad_slo_fails_alone(model, prompts):
    engine = Engine(model, EngineConfig(**BASE, controller="joint"))
    with pytest.raises(ValueError, match="request 'bad'.*slo"):
        engine.add_request("bad", prompts[0], slo={"ttft_s": 1.0})
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(ttft_s=-1.0)
    engine.add_request("ok", prompts[0], SamplingParams(max_new_tokens=2))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="unknown controller"):
        EngineConfig(controller="nope")
