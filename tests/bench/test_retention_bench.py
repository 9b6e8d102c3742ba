"""Tests of the retention benchmark's pieces (kvjax.bench.retention) that need no engine."""

import numpy as np
import pytest

from kvjax.bench import retention
from kvjax.kv import quest


def test_variants_parse_to_policy_budget_and_typed_options():
    assert retention.parse_variant("none") == ("none", None, {})
    assert retention.parse_variant("h2o:512") == ("h2o", 512, {})
    assert retention.parse_variant("quest:1024:dense_layers=0:heads=max") == (
        "quest", 1024, dict(dense_layers=0, heads="max"))
    assert retention.parse_variant("snapkv:256:pool=false:offset=-2") == (
        "snapkv", 256, dict(pool=False, offset=-2))


def test_recall_groups_leave_out_the_dense_layers():
    recall = np.arange(6, dtype=np.float64)  # [L]
    assert retention.recall_by_group(recall, 0, [2, 4]) == {"0-1": 0.5, "2-3": 2.5, "4-5": 4.5}
    assert retention.recall_by_group(recall, 3, [2, 4]) == {"3-3": 3.0, "4-5": 4.5}


def test_quest_recall_is_nan_when_every_page_is_read_and_one_for_a_clear_winner():
    rng = np.random.default_rng(0)
    page_size, s = 4, 16
    k = rng.normal(size=(1, s, 1, 8)).astype(np.float32)  # [L, S, K, D]
    q = np.zeros((1, 1, 1, 8), np.float32)  # [L, T, N, D]
    recall = retention.quest_layer_recall(q, k, page_size, 4, quest.HeadReduction.SUM)
    assert np.isnan(recall).all()
    # One key far along the query's direction: its page takes the most attention mass and has
    # the largest upper bound; the query's own page (always read) takes the next most.
    q[0, 0, 0, 0] = 1.0
    k[0, 5, 0, 0] = 50.0
    k[0, 12:, 0, 0] = 8.0
    recall = retention.quest_layer_recall(q, k, page_size, 2, quest.HeadReduction.SUM)
    assert recall[0] == pytest.approx(1.0)


def test_exact_runs_cache_round_trips_and_refuses_other_probes(tmp_path):
    rng = np.random.default_rng(0)
    probes = [([1, 2, 3], [4]), ([5, 6], [7, 8])]
    runs = [dict(logits=rng.normal(size=(3, 5)), tokens=[4, 9, 9], peak_pages=3,
                 decode_peak_pages=2, decode_step_s=[0.5, 0.25]),
            dict(logits=rng.normal(size=(3, 5)), tokens=[7, 8, 1], peak_pages=4,
                 decode_peak_pages=4, decode_step_s=[0.125])]
    path = str(tmp_path / "runs" / "exact.npz")  # its folder is made on saving
    assert retention.load_exact_runs(path, probes, 3) is None  # no file yet
    retention.save_exact_runs(path, probes, runs, 3)
    loaded = retention.load_exact_runs(path, probes, 3)
    for got, want in zip(loaded, runs, strict=True):
        np.testing.assert_array_equal(got["logits"], want["logits"])
        assert {k: got[k] for k in want if k != "logits"} == {
            k: want[k] for k in want if k != "logits"}
    assert retention.load_exact_runs(path, probes, 4) is None  # other forced-token count
    assert retention.load_exact_runs(path, probes[:1], 3) is None  # fewer probes
    assert retention.load_exact_runs(path, [probes[0], ([5, 6], [7, 9])], 3) is None


def test_a_probing_press_pads_its_probe_rows_to_the_longest_probe_not_the_chunk(embedded_model):
    """The bench prefills in one chunk; kvzip's probe rows (its 200-token chunk and the
    instruction) pad to 256 tokens, so a probe costs a forward pass of its own length."""
    engine = retention.make_engine(embedded_model, "kvzip:64:chunk=200", 1000, page_size=16,
                                   chunk=1024)
    assert engine.config.min_chunk_bucket == 256
    assert engine.config.max_prefill_chunk == 1024
    exact = retention.make_engine(embedded_model, "none", 1000, page_size=16, chunk=1024)
    assert exact.config.min_chunk_bucket == 1024
