"""Several models on one shared KV arena and weight budget (kvjax.engine.multi).

Three models share a budget too small for all their weights and KV at once: the tiny model with
exact KV, a model of another shape (3 layers, one KV head), and the tiny model again with int8
KV. Oracles: each model's greedy tokens served alone (the cache-free dense reference for exact
KV, a solo engine of the same codec for int8). The pool must move weights to the host and back,
preempt, and keep KV frames plus resident weights within the budget at every step.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.bench.trace_report import validate_trace
from kvjax.engine.engine import Engine
from kvjax.engine.multi import ModelSpec, MultiModelEngine, PoolConfig
from kvjax.testing import TINY, greedy_reference, tiny_model

BASE = dict(max_num_seqs=3, max_num_batched_tokens=32, max_prefill_chunk=32,
            min_chunk_bucket=32, max_prefill_seqs=1, max_model_len=64)
NUM_NEW = 6


@pytest.fixture(scope="module")
def models():
    other = dataclasses.replace(TINY, num_layers=3, num_heads=2, num_kv_heads=1, name="other")
    return dict(a=tiny_model(), b=tiny_model(other, seed=1))


def _specs(models):
    return {"a": ModelSpec(models["a"], EngineConfig(**BASE)),
            "b": ModelSpec(models["b"], EngineConfig(**BASE)),
            "a-int8": ModelSpec(models["a"], EngineConfig(kv_codec="int8", **BASE))}


def _prompts(seed: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 120, int(rng.integers(9, 30))).tolist() for _ in range(4)]


def _serve(mm, requests):
    outs = {}
    for model, request_id, prompt in requests:
        mm.add_request(request_id, prompt,
                       SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True), model=model)
    while mm.has_unfinished():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in mm.step())
    return outs


def test_each_model_gives_its_solo_tokens_under_one_tight_budget(models):
    specs = _specs(models)
    # Room for two models' weights and a few frames: the third must wait for weights to move.
    budget = models["a"].nbytes + models["b"].nbytes + 24 * 1024
    mm = MultiModelEngine(specs, PoolConfig(budget_bytes=budget, policy="elastic",
                                            page_tokens=4))
    prompts = {name: _prompts(i) for i, name in enumerate(specs)}
    requests = [(name, f"{name}-{i}", p) for i in range(4) for name, ps in prompts.items()
                for p in ps[i:i + 1]]
    outs = _serve(mm, requests)
    for name in ("a", "b"):
        want = [greedy_reference(models[name], p, NUM_NEW) for p in prompts[name]]
        assert [outs[f"{name}-{i}"] for i in range(4)] == want
    solo = Engine(models["a"], EngineConfig(kv_codec="int8", page_size=4, num_pages=64, **BASE))
    want = [o.outputs[0].token_ids for o in solo.generate(
        prompts["a-int8"], SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True))]
    assert [outs[f"a-int8-{i}"] for i in range(4)] == want
    s = mm.summary()
    assert s["weight_offloads"] > 0 and s["weight_loads"] > 0  # weights moved both ways
    assert s["weight_bytes_to_device"] > 0
    assert s["max_used_bytes"] <= budget  # checked after every engine step too
    assert s["frames_in_use"] == sum(m["frames"] for m in s["models"].values())
    assert all(e.allocator.num_used_pages() == 0 for e in mm.engines.values())
    assert len({m["page_size"] for m in s["models"].values()}) == 3  # one frame, three P


def test_weight_offload_and_reload_give_identical_tokens(models, tmp_path):
    mm = MultiModelEngine({"a": ModelSpec(models["a"], EngineConfig(trace=True, **BASE))},
                          PoolConfig(budget_bytes=models["a"].nbytes + 64 * 1024))
    prompts = _prompts(7)
    first = _serve(mm, [("a", f"x{i}", p) for i, p in enumerate(prompts)])
    compiles = mm.engines["a"].num_compiles
    mm.offload_weights("a")
    assert not mm.weights_resident("a") and mm.frames.resident_weight_bytes == 0
    again = _serve(mm, [("a", f"y{i}", p) for i, p in enumerate(prompts)])
    assert mm.weights_resident("a")
    assert [again[f"y{i}"] for i in range(4)] == [first[f"x{i}"] for i in range(4)]
    assert mm.engines["a"].num_compiles == compiles  # reloaded weights compile nothing new
    mm.export_trace(tmp_path / "trace.json")  # the model's KV events, under its name
    events = json.loads((tmp_path / "trace.json").read_text())
    assert validate_trace(events) == []
    assert mm.engines["a"].tracer.count("allocate") > 0


def test_bad_requests_fail_alone(models):
    mm = MultiModelEngine({"a": ModelSpec(models["a"], EngineConfig(**BASE))},
                          PoolConfig(budget_bytes=models["a"].nbytes + 64 * 1024))
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        mm.add_request("r0", [1, 2, 3], model="nope")
    mm.add_request("r1", [1, 2, 3], SamplingParams(max_new_tokens=2), model="a")
    with pytest.raises(ValueError, match="'r1': the id is already in use"):
        mm.add_request("r1", [1, 2, 3], model="a")
    outs = {}
    while mm.has_unfinished():
        outs.update((o.request_id, o) for o in mm.step())
    assert len(outs["r1"].outputs[0].token_ids) == 2
    bad, good = mm.generate("a", [[1, 2.5], [4, 5]], SamplingParams(max_new_tokens=2))
    assert "token ids must be ints" in bad.error and len(good.outputs[0].token_ids) == 2
