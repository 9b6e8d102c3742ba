"""Pausing, resuming and migrating a request keeps its greedy tokens (oracle: an
uninterrupted run on the same engine config)."""

from __future__ import annotations

import pytest

from kvjax.engine.config import EngineConfig, PreemptionMode
from kvjax.engine.engine import Engine
from kvjax.engine.snapshot import restore_snapshot, save_snapshot
from kvjax.sampling import SamplingParams
from kvjax.testing import tiny_model

CONFIG = EngineConfig(max_num_seqs=4, preemption_mode=PreemptionMode.SWAP)
PROMPTS = {"a": [3, 14, 15, 92, 65], "b": [35, 89, 79, 32, 38, 46], "c": [26, 43, 38]}
SAMPLING = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def uninterrupted(model):
    return run_all(Engine(model, CONFIG))


def run_all(engine: Engine, add: bool = True) -> dict[str, list[int]]:
    if add:
        for rid, prompt in PROMPTS.items():
            engine.add_request(rid, prompt, SAMPLING)
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    return outputs


def step_until_decoding(engine: Engine, request_id: str, num_tokens: int) -> None:
    while len(engine.sequence(f"{request_id}#0").output_ids) < num_tokens:
        engine.step()


@pytest.mark.parametrize("to_host", [False, True])
def test_pause_then_resume_gives_the_uninterrupted_tokens(model, uninterrupted, to_host):
    engine = Engine(model, CONFIG)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SAMPLING)
    step_until_decoding(engine, "a", 3)
    engine.pause("a", to_host=to_host)
    frozen = list(engine.sequence("a#0").tokens)
    outputs = run_all(engine, add=False)  # b and c finish while a waits.
    assert engine.sequence("a#0").tokens == frozen and "a" not in outputs
    # Kept on the device, a's pages are still held; swapped to the host, none are.
    assert (engine.metrics()["num_used_pages"] > 0) != to_host
    engine.resume("a")
    outputs.update(run_all(engine, add=False))
    assert outputs == uninterrupted


def test_a_paused_request_migrates_to_another_engine(model, uninterrupted, tmp_path):
    source, target = Engine(model, CONFIG), Engine(model, CONFIG)
    for rid, prompt in PROMPTS.items():
        source.add_request(rid, prompt, SAMPLING)
    step_until_decoding(source, "b", 4)
    source.pause("b")
    save_snapshot(source, tmp_path / "snap", request_ids=["b"])
    source.abort("b")
    restore_snapshot(target, tmp_path / "snap")
    outputs = run_all(source, add=False)
    aborted = outputs.pop("b")  # Ends here with what it had; it finishes in the target.
    assert aborted == uninterrupted["b"][:len(aborted)]
    outputs.update(run_all(target, add=False))
    assert outputs == uninterrupted


def test_pause_refuses_unknown_and_repeated_ids(model):
    engine = Engine(model, CONFIG)
    engine.add_request("a", PROMPTS["a"], SAMPLING)
    engine.pause("a")
    with pytest.raises(ValueError, match="'a' is not an unfinished, unpaused"):
        engine.pause("a")
    with pytest.raises(ValueError, match="'zz' is not paused"):
        engine.resume("zz")


def test_a_weight_update_waits_for_paused_requests(model):
    engine = Engine(model, CONFIG)
    engine.add_request("a", PROMPTS["a"], SAMPLING)
    engine.step()
    engine.pause("a")
    with pytest.raises(ValueError, match="paused requests \\['a'\\]"):
        engine.update_weights(model.params, "v2")
