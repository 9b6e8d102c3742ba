"""docs/api.md is what scripts/make_api_docs.py generates from the code as it is now.

Fails when a public signature or docstring changed without a regeneration:

    .venv/bin/python scripts/make_api_docs.py
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def make_api_docs():
    spec = importlib.util.spec_from_file_location("make_api_docs",
                                                  REPO / "scripts" / "make_api_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_api_reference_is_up_to_date(make_api_docs):
    generated = make_api_docs.render()
    written = (REPO / "docs" / "api.md").read_text()
    diff = list(difflib.unified_diff(written.splitlines(), generated.splitlines(),
                                     "docs/api.md", "generated", lineterm="", n=1))
    assert not diff, ("docs/api.md is out of date; run .venv/bin/python "
                      "scripts/make_api_docs.py\n" + "\n".join(diff[:40]))


def test_api_reference_covers_the_public_entry_points(make_api_docs):
    text = make_api_docs.render()
    for heading in ("kvjax.Engine", "kvjax.EngineConfig", "kvjax.SamplingParams",
                    "kvjax.generate", "kvjax.kv.state.PagedKV", "kvjax.kv.codecs.CODECS",
                    "kvjax.kv.retention.register_retention",
                    "kvjax.scheduler.policies.register_policy", "kvjax.memory.tiers.TierConfig",
                    "kvjax.router.Router", "kvjax.rl.Rollout", "kvjax.bench.run_sweep_detailed"):
        assert f"### `{heading}`\n" in text, heading
    # Signatures are printed as code would name things: no object addresses or quoted strings.
    assert " at 0x" not in text
    assert "<function" not in text
    assert "(self" not in text and "\n    self,\n" not in text, "methods are shown without self"


def test_a_changed_signature_makes_the_reference_stale(make_api_docs, monkeypatch):
    import kvjax.rl.rewards

    def arithmetic_reward(completion: str, answer: int, bonus: float = 0.0) -> float:
        """Scores a completion."""
        return 0.0

    before = make_api_docs.render()
    monkeypatch.setattr(kvjax.rl, "arithmetic_reward", arithmetic_reward)
    after = make_api_docs.render()
    assert before != after
    assert "arithmetic_reward(completion: str, answer: int, bonus: float = 0.0) -> float" in after
