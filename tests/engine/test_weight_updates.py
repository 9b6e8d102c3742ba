"""Weight updates mid-flight: no stale KV is ever read, and each in-flight policy does what it says.

Oracle: `greedy_reference` (cache-free dense recomputation) on the weights each token was made with.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason, WeightUpdatePolicy
from kvjax.models import llama
from kvjax.scheduler.spec import SpecConfig
from kvjax.testing import greedy_reference, tiny_model

NEW = 12
CONFIG = dict(page_size=4, num_pages=128, max_num_batched_tokens=32, max_prefill_chunk=16,
              max_num_seqs=8, debug_provenance=True)


@pytest.fixture(scope="module")
def models():
    old = tiny_model(seed=0)
    new = tiny_model(seed=1)
    return old, new


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(0, 120, size=16)]
    return [shared + [int(t) for t in rng.integers(0, 120, size=n)] for n in (3, 9, 14)]


def _start(engine, prompts, steps):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW))
    for _ in range(steps):
        engine.step()
    return {f"r{i}": list(engine.sequence(f"r{i}#0").output_ids) for i in range(len(prompts))}


def _drain(engine):
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    return done


# Plain decoding, and sparse self-drafts whose unverified drafts an update must drop.
SPECS = pytest.mark.parametrize("spec", [
    SpecConfig(), SpecConfig("sparse_self", 3, options=dict(num_sinks=4, window=8))],
    ids=["plain", "speculative"])


@SPECS
def test_recompute_continues_exactly_like_fresh_new_weights(models, prompts, spec):
    old, new = models
    engine = Engine(old, EngineConfig(**CONFIG, spec=spec))
    before = _start(engine, prompts, steps=4)
    assert any(before.values()), "some tokens should exist before the update"
    engine.update_weights(new.params, "v1", in_flight=WeightUpdatePolicy.RECOMPUTE)
    done = _drain(engine)
    for i, p in enumerate(prompts):
        out = done[f"r{i}"].outputs[0].token_ids
        head = before[f"r{i}"]
        assert out[:len(head)] == head
        assert out[len(head):] == greedy_reference(new, p + head, NEW - len(head),
                                                   stop=new.config.eos_token_ids)
    assert engine.stats["stale_kv_reads"] == 0


@SPECS
def test_finish_old_drains_under_old_weights_while_new_requests_use_new(models, prompts, spec):
    old, new = models
    engine = Engine(old, EngineConfig(**CONFIG, spec=spec))
    _start(engine, prompts[:2], steps=3)
    engine.update_weights(new.params, "v1", in_flight=WeightUpdatePolicy.FINISH_OLD)
    engine.add_request("late", prompts[2], SamplingParams(max_new_tokens=NEW))
    done = _drain(engine)
    for i in range(2):
        assert done[f"r{i}"].outputs[0].token_ids == greedy_reference(old, prompts[i], NEW)
    assert done["late"].outputs[0].token_ids == greedy_reference(new, prompts[2], NEW)
    assert list(engine.runner.params) == ["v1"], "old weights are released once drained"
    assert engine.stats["stale_kv_reads"] == 0


def test_abort_policy_and_prefix_cache_never_hits_old_version(models, prompts):
    old, new = models
    engine = Engine(old, EngineConfig(**CONFIG))
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=2))  # fills the prefix cache
    _start(engine, prompts[1:2], steps=2)
    hits_before = engine.prefix_cache_stats()["prefix_hit_tokens"]
    engine.update_weights(new.params, "v1", in_flight=WeightUpdatePolicy.ABORT)
    aborted = engine.step()
    assert [o.outputs[0].finish_reason for o in aborted] == [FinishReason.ABORT]
    (out,) = engine.generate([prompts[0]], SamplingParams(max_new_tokens=NEW))
    assert engine.prefix_cache_stats()["prefix_hit_tokens"] == hits_before
    assert out.outputs[0].token_ids == greedy_reference(new, prompts[0], NEW)


def test_stale_read_detector_fires_when_provenance_ignores_the_version(models, prompts,
                                                                      monkeypatch):
    """Proves the detector can fail: a fingerprint without the version leaks old pages."""
    old, new = models
    original = Engine.provenance
    monkeypatch.setattr(Engine, "provenance",
                        lambda self, tenant=None, weights_version=None: original(self, tenant, "x"))
    engine = Engine(old, EngineConfig(**CONFIG))
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=2))
    engine.update_weights(new.params, "v1")
    with pytest.raises(RuntimeError, match="stale KV"):
        engine.generate([prompts[0]], SamplingParams(max_new_tokens=2))
    assert engine.stats["stale_kv_reads"] > 0


def test_update_rejects_bad_params_and_reused_versions(models):
    old, new = models
    engine = Engine(old, EngineConfig(**CONFIG))
    bad = jax.tree.map(lambda x: x, new.params)
    bad["layers"] = dict(bad["layers"], wq=bad["layers"]["wq"][:, :, :8])
    with pytest.raises(ValueError, match="wq"):
        engine.update_weights(bad, "v1")
    engine.update_weights(new.params, "v1")
    with pytest.raises(ValueError, match="already in use"):
        engine.update_weights(old.params, "v1")
    assert llama.check_params(engine.model.params, engine.model.config) is None
