"""Engine snapshots: pause/resume and migration continue exactly; foreign snapshots are refused.

Oracles: the same requests run uninterrupted on one engine, and `greedy_reference` (cache-free
dense recomputation).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.request import SeqStatus
from kvjax.engine.snapshot import restore_snapshot, save_snapshot
from kvjax.testing import greedy_reference, tiny_model

NEW = 10
CONFIG = dict(page_size=4, num_pages=96, max_num_batched_tokens=64, max_prefill_chunk=32,
              max_num_seqs=8, debug_provenance=True)
GREEDY = SamplingParams(max_new_tokens=NEW)
SAMPLED = SamplingParams(max_new_tokens=NEW, temperature=1.0, n=3, seed=7)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    shared = [int(t) for t in rng.integers(0, 120, size=9)]
    return [shared + [int(t) for t in rng.integers(0, 120, size=n)] for n in (2, 7, 12)]


def _submit(engine, prompts):
    # The contiguous layout cannot fork a group's shared prompt, so it samples one at a time.
    contiguous = engine.config.kv_layout.value == "contiguous"
    for i, prompt in enumerate(prompts):
        sampled = dataclasses.replace(SAMPLED, n=1) if contiguous else SAMPLED
        engine.add_request(f"r{i}", prompt, sampled if i == 1 else GREEDY)


def _drain(engine):
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    return done


def _tokens(out):
    return [s.token_ids for s in out.outputs]


def _run_uninterrupted(model, prompts, config):
    engine = Engine(model, config)
    _submit(engine, prompts)
    return {r: _tokens(out) for r, out in _drain(engine).items()}


@pytest.fixture(scope="module")
def uninterrupted(model, prompts):
    return _run_uninterrupted(model, prompts, EngineConfig(**CONFIG))


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="paged"),
    pytest.param(dict(kv_codec="int8"), id="int8", marks=pytest.mark.slow),
    pytest.param(dict(kv_layout="contiguous", num_pages=None), id="contiguous",
                 marks=pytest.mark.slow),
    # KIVI's exact windows travel beside the pages; retention's record of what they hold too.
    pytest.param(dict(kv_codec="kivi4", kv_codec_options=dict(group=4, residual=4),
                      enable_prefix_cache=False), id="kivi-residual"),
    pytest.param(dict(retention="h2o", retention_budget=12,
                      retention_options=dict(num_recent=3)), id="h2o", marks=pytest.mark.slow),
    pytest.param(dict(retention="quest", retention_budget=8), id="quest",
                 marks=pytest.mark.slow),
])
def test_pause_resume_continues_like_an_uninterrupted_run(model, prompts, uninterrupted,
                                                          overrides, tmp_path):
    config = EngineConfig(**dict(CONFIG, **overrides))
    source = Engine(model, config)
    _submit(source, prompts)
    def all_decoding():
        live = [s for s in source.scheduler.sequences() if s.status is SeqStatus.RUNNING]
        return (live and not source.scheduler.waiting
                and all(s.num_pending == 1 and s.output_ids for s in live))

    for _ in range(6):  # prompts sharing pages may wait for them: a few steps at most
        source.step()
        if all_decoding():
            break
    assert all_decoding(), "every sequence should be decoding when the snapshot is taken"
    save_snapshot(source, tmp_path / "snap")
    target = Engine(model, config)
    assert sorted(restore_snapshot(target, tmp_path / "snap")) == ["r0", "r1", "r2"]
    done = {r: _tokens(out) for r, out in _drain(target).items()}
    assert target.stats["prefill_tokens"] == 0, "the KV came from the snapshot, not a recompute"
    assert target.stats["stale_kv_reads"] == 0
    expected = uninterrupted if not overrides else _run_uninterrupted(model, prompts, config)
    assert done == expected
    if not {"kv_codec", "retention"} & set(overrides):  # Exact KV: matches recomputation.
        for i in (0, 2):
            assert done[f"r{i}"] == [greedy_reference(model, prompts[i], NEW)]


def test_snapshot_mid_prefill_and_before_admission_resumes(model, prompts, uninterrupted,
                                                          tmp_path):
    config = EngineConfig(**dict(CONFIG, max_prefill_chunk=8, max_prefill_seqs=1))
    source = Engine(model, config)
    _submit(source, prompts)
    source.step()
    statuses = {s.seq_id: (s.status, s.num_pending) for s in source.scheduler.sequences()}
    assert any(st is SeqStatus.WAITING for st, _ in statuses.values())
    save_snapshot(source, tmp_path / "snap")
    target = Engine(model, config)
    restore_snapshot(target, tmp_path / "snap")
    assert {r: _tokens(out) for r, out in _drain(target).items()} == uninterrupted


def test_migrating_one_request_to_a_busy_engine(model, prompts, uninterrupted, tmp_path):
    config = EngineConfig(**CONFIG)
    source = Engine(model, config)
    _submit(source, prompts)
    for _ in range(3):
        source.step()
    save_snapshot(source, tmp_path / "snap", request_ids=["r1"])
    source.abort("r1")
    target = Engine(model, config)
    target.add_request("local", prompts[0][::-1], GREEDY)
    target.step()
    assert restore_snapshot(target, tmp_path / "snap") == ["r1"]
    moved = _drain(target)
    stayed = _drain(source)
    assert _tokens(moved["r1"]) == uninterrupted["r1"]
    assert moved["local"].outputs[0].token_ids == greedy_reference(model, prompts[0][::-1], NEW)
    for r in ("r0", "r2"):
        assert _tokens(stayed[r]) == uninterrupted[r]
    assert target.stats["stale_kv_reads"] == 0


def test_restore_refuses_a_mismatched_snapshot_and_changes_nothing(model, prompts, tmp_path):
    source = Engine(model, EngineConfig(**CONFIG))
    _submit(source, prompts)
    source.step()
    save_snapshot(source, tmp_path / "snap")
    newer = Engine(dataclasses.replace(model, weights_version="v1"), EngineConfig(**CONFIG))
    with pytest.raises(ValueError, match="weights version '0'.*'v1'"):
        restore_snapshot(newer, tmp_path / "snap")
    assert not newer.has_unfinished()
    bigger_pages = Engine(model, EngineConfig(**dict(CONFIG, page_size=8)))
    with pytest.raises(ValueError, match="page_size 4 does not match the engine's page_size 8"):
        restore_snapshot(bigger_pages, tmp_path / "snap")
    same = Engine(model, EngineConfig(**CONFIG))
    restore_snapshot(same, tmp_path / "snap")
    with pytest.raises(ValueError, match="'r0' already exists"):
        restore_snapshot(same, tmp_path / "snap")
    with pytest.raises(ValueError, match="already exists"):
        save_snapshot(source, tmp_path / "snap")
    with pytest.raises(ValueError, match="'nope'"):
        save_snapshot(source, tmp_path / "other", request_ids=["nope"])

