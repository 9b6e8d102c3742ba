"""The predicted roofline is consistent with what a decode step must read.

Independent arithmetic here: a step over B rows of S tokens reads every live token's K and V
in every layer, so its predicted bytes are at least that, and a step moving those bytes can
be no faster than they take at the target's HBM bandwidth.
"""

from __future__ import annotations

import pytest

from kvjax.bench import deviceless as dl
from kvjax.bench import predicted_roofline as pr

# Bytes one token's K and V take in one layer of the SmolLM2 shape (3 kv heads, head dim 64):
# bf16 values, or int8 codes with one float32 scale per token and head.
_KV_TOKEN_LAYER_BYTES = {"exact": 2 * 3 * 64 * 2, "int8": 2 * (3 * 64 + 3 * 4)}


@pytest.mark.parametrize("kv", ["exact", "int8"])
def test_prediction_covers_the_kv_reads_and_the_bandwidth(kv):
    point = pr.Point("v5e", "smollm2", kv, batch=2, context=2048)
    record = pr.predict(point)
    assert record["status"] == "compiled", record.get("reason")
    # Both read their pages in a Pallas kernel (a Mosaic call), whose reads are added.
    assert record["attention"] == "pallas" and record["mosaic_calls"] > 0, record
    kv_bytes = 2 * 2048 * 30 * _KV_TOKEN_LAYER_BYTES[kv]
    assert record["bytes"] >= kv_bytes
    assert record["bytes"] >= record["must_read_bytes"] >= kv_bytes
    rates = pr.PUBLISHED["v5e"]
    assert record["predicted_step_s"] >= record["bytes"] / rates.hbm_bytes_per_s
    assert record["predicted_step_s"] >= record["flops"] / rates.peak_bf16_flops
    assert 0 < record["useful_fraction"] <= 1


def test_xla_does_not_count_the_kernel_reads_so_they_are_added():
    """The premise of adding the kernel's K/V bytes: XLA's analysis of a TPU paged decode
    kernel alone reports less than the pages the kernel must read."""
    point = pr.Point("v5e", "8b", "exact", batch=8, context=2048)
    record = pr.predict_peer("kvjax_paged_decode", point)
    assert record["status"] == "compiled", record.get("reason")
    must_read = 8 * 2048 * 2 * dl.SHAPES["8b"].num_kv_heads * dl.SHAPES["8b"].head_dim * 2
    assert record["kv_layer_bytes"] == must_read
    assert 0 < record["xla_bytes"] < must_read
    assert record["predicted_layer_s"] >= must_read / pr.PUBLISHED["v5e"].hbm_bytes_per_s
