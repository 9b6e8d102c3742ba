"""The swap-vs-recompute cost model behind PreemptionMode.AUTO."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvjax.scheduler.preemption import PreemptionMode, decide_preemption

# 100 tokens of 1000 bytes over a 1 MB/s link: 0.2 s out and back.
SWAP_COST_S = 0.2


@pytest.mark.parametrize("recompute_tokens_per_s, choice", [
    (400, PreemptionMode.SWAP),  # recompute takes 0.25 s: moving is cheaper
    (600, PreemptionMode.RECOMPUTE),  # recompute takes 0.167 s: prefilling again is cheaper
])
def test_swaps_exactly_when_moving_is_cheaper(recompute_tokens_per_s, choice):
    d = decide_preemption("s", 100, swap_bytes=100 * 1000, bandwidth_bytes_per_s=1e6,
                          recompute_tokens_per_s=recompute_tokens_per_s)
    assert d.swap_cost_s == pytest.approx(SWAP_COST_S)
    assert d.recompute_cost_s == pytest.approx(100 / recompute_tokens_per_s)
    assert d.choice is choice


def test_decision_serializes_its_choice_as_the_mode_value():
    d = decide_preemption("s", 10, swap_bytes=10, bandwidth_bytes_per_s=1e9,
                          recompute_tokens_per_s=1)
    assert json.loads(json.dumps(dataclasses.asdict(d)))["choice"] == "swap"
    assert PreemptionMode(d.choice) is PreemptionMode.SWAP


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_tokens=1, swap_bytes=1, bandwidth_bytes_per_s=0, recompute_tokens_per_s=1),
     "rates"),
    (dict(num_tokens=1, swap_bytes=1, bandwidth_bytes_per_s=1, recompute_tokens_per_s=0),
     "rates"),
    (dict(num_tokens=-1, swap_bytes=1, bandwidth_bytes_per_s=1, recompute_tokens_per_s=1),
     "num_tokens"),
    (dict(num_tokens=1, swap_bytes=-1, bandwidth_bytes_per_s=1, recompute_tokens_per_s=1),
     "swap_bytes"),
])
def test_rejects_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        decide_preemption("s", **kwargs)
