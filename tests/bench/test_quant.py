"""Tests of the codec benchmark's pieces (kvjax.bench.quant) that need no engine."""

import numpy as np
import pytest

from kvjax.bench import quant
from kvjax.bench.metrics import quality_stats
from kvjax.testing import TINY


def test_codec_specs_become_engine_options():
    assert quant.codec_options("kivi4-r32", 128, 32) == dict(group=32, page_size=128,
                                                            residual=32)
    assert quant.codec_options("kivi2", 64, 16) == dict(group=16, page_size=64, residual=0)
    assert quant.codec_options("int4", 128, 32) == dict(group=32)
    assert quant.codec_options("fp8_e4m3-cal", 128, 32) == dict(scaling="calibrated")
    assert quant.codec_options("int8", 128, 32) == {}


def test_token_stats_agree_with_quality_stats_and_score_the_targets():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(300, 16))  # more rows than one 128-row slice
    test = ref + 0.3 * rng.normal(size=ref.shape)
    targets = rng.integers(0, 16, size=300)
    stats = quant.token_stats(ref, test, targets)
    summary = quality_stats(ref, test)
    assert stats["kl"].shape == (300,)
    assert stats["kl"].mean() == pytest.approx(summary["kl_mean"])
    assert stats["agree"].mean() == pytest.approx(summary["top1_agreement"])
    logp = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(stats["nll_ref"], -logp[np.arange(300), targets])
    same = quant.token_stats(ref, ref, targets)
    np.testing.assert_allclose(same["kl"], 0.0, atol=1e-12)
    np.testing.assert_array_equal(same["nll_ref"], same["nll_test"])


def test_capacity_counts_pages_in_the_budget_against_float32():
    settings = quant.QuantBench(codecs=("int8",), contexts=(64,), page_size=16, group=8,
                                budget_mib=1, num_probes=2)
    exact = quant.capacity(TINY, "none", settings)
    assert exact["bytes_per_token"] == TINY.kv_bytes_per_token(np.float32)
    assert exact["capacity_x"] == 1.0 and exact["window_bytes"] == 0
    int8 = quant.capacity(TINY, "int8", settings)
    assert int8["bytes_per_token"] < exact["bytes_per_token"]
    assert int8["pages"] == (1 << 20) // (int8["bytes_per_token"] * 16)
    kivi = quant.capacity(TINY, "kivi4-r32", settings)
    assert kivi["window_bytes"] > 0  # the exact windows come out of the budget first
