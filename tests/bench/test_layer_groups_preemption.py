"""The layer-groups preemption benchmark on a tiny load: every mode decodes the same tokens,
and its counters say what each mode did (recompute re-prefills, swap moves bytes)."""

from __future__ import annotations

from kvjax.bench import layer_groups

SETUP = layer_groups.Setup(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1,
                           head_dim=16, num_requests=3, page_size=4, chunk=32,
                           pressure_window=8, pressure_prompt=24, pressure_new_tokens=24)


def test_every_mode_decodes_the_recompute_tokens_and_counts_its_moves():
    result = layer_groups.preemption(SETUP, repeats=1)
    modes = result["modes"]
    assert all(m["same_tokens_as_recompute"] for m in modes.values())
    recompute, swap = modes["recompute"], modes["swap"]
    assert recompute["preemptions"] > 0 and recompute["prefilled_again"] > 0
    assert recompute["swaps_out"] == recompute["swap_bytes"] == 0
    assert swap["swaps_out"] == swap["preemptions"] > 0 and swap["prefilled_again"] == 0
    assert swap["swap_bytes"] > 0
    rows = layer_groups.preemption_rows(result)
    assert set(rows) == {"recompute", "swap", "auto"}
