"""The measured counterpart of the link model runs on any machine: on this CPU it measures
transfers and attention at tiny sizes and says its figures are the CPU's."""

from __future__ import annotations

import jax

from kvjax.bench import host_attention, link_measure


def test_link_measure_reports_measured_figures_beside_the_model():
    report = link_measure.run(link_measure.LinkMeasure(
        transfer_bytes=1 << 20, num_rows=1, context=64, kv_heads=1, head_dim=8, page_size=16,
        repeats=1))
    on_cpu = jax.default_backend() == "cpu"
    assert (report["note"] is not None and "no GPU: CPU figures" in report["note"]) == on_cpu
    rows = report["rows"]
    for name in ("host->device GB/s", "device->host GB/s"):
        assert rows[name]["measured"] > 0
        assert rows[name]["model_pcie5_x16"] == host_attention.LINKS["pcie5_x16"] / 1e9
    assert rows["host attention ms"]["measured"] == 1e3 * report["host_attention_s"] > 0
    assert report["attention_kv_bytes"] == 2 * 64 * 1 * 8 * 4  # K and V, float32
    assert rows["host / device attention time"]["measured"] == (
        report["host_attention_s"] / report["device_attention_s"])
