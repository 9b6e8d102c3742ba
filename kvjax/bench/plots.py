"""PNG plots of benchmark runs: one line per run in each figure.

Figures are built with matplotlib's object API (`Figure`, no pyplot state), which renders
PNG through the Agg backend whatever backend is configured, so plotting works headless.

    ttft_cdf.png / tpot_cdf.png   empirical CDFs of per-request TTFT and TPOT
    kv_memory.png                 live and reserved KV bytes over time
    load.png                      throughput and goodput against the arrival rate, written
                                  only when the runs differ in `workload.params.rate`
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from kvjax.bench.metrics import RequestRecord
from kvjax.bench.runner import BenchResult


def _label(result: BenchResult) -> str:
    return str(result.metrics["config"]["name"])


def request_latencies(records: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """TTFT and TPOT (seconds) of the served requests, as compute_metrics defines them."""
    ttft, tpot = [], []
    for r in records:
        if r.error is not None or r.first_token_time is None:
            continue
        ttft.append(r.first_token_time - r.arrival_time)
        if r.num_output_tokens >= 2:
            last = r.token_times[-1] if r.token_times else r.finish_time
            tpot.append((last - r.first_token_time) / (r.num_output_tokens - 1))
    return np.asarray(ttft), np.asarray(tpot)


def _cdf(ax, values: np.ndarray, label: str) -> None:
    if values.size:
        x = np.sort(values)
        ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=label)


def plot_latency_cdfs(results: Sequence[BenchResult], workdir: Path) -> list[Path]:
    """ttft_cdf.png and tpot_cdf.png."""
    paths = []
    for index, (name, title) in enumerate((("ttft", "time to first token"),
                                           ("tpot", "time per output token"))):
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        for result in results:
            _cdf(ax, request_latencies(result.records)[index], _label(result))
        ax.set(xlabel=f"{name.upper()} (s, {results[0].metrics['clock']} clock)",
               ylabel="fraction of requests", title=f"CDF of {title}", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        path = workdir / f"{name}_cdf.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        paths.append(path)
    return paths


def plot_kv_memory(results: Sequence[BenchResult], workdir: Path) -> Path | None:
    """kv_memory.png: live (solid) and reserved (dashed) KV MiB after each step, or None when
    no run sampled its KV (a run over HTTP sees only the server's outside)."""
    if not any(result.kv_samples for result in results):
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for result in results:
        if not result.kv_samples:
            continue
        t, live, reserved = np.asarray(result.kv_samples, np.float64).T  # [num_samples] each
        line, = ax.plot(t, live / 2**20, label=f"{_label(result)} live")
        ax.plot(t, reserved / 2**20, linestyle="--", color=line.get_color(),
                label=f"{_label(result)} reserved")
    ax.set(xlabel=f"time (s, {results[0].metrics['clock']} clock)", ylabel="KV MiB",
           title="KV memory over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    path = workdir / "kv_memory.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def _rate(result: BenchResult) -> float | None:
    return result.metrics["config"]["workload"]["params"].get("rate")


def plot_load(results: Sequence[BenchResult], workdir: Path) -> Path | None:
    """load.png: throughput and goodput against the workload's arrival rate, or None when
    fewer than two distinct finite rates were run."""
    points = sorted(((_rate(r), r.metrics) for r in results
                     if _rate(r) is not None and np.isfinite(_rate(r))), key=lambda p: p[0])
    if len({rate for rate, _ in points}) < 2:
        return None
    rates = [rate for rate, _ in points]
    fig = Figure(figsize=(10, 4))
    ax_tok, ax_good = fig.subplots(1, 2)
    ax_tok.plot(rates, [m["throughput_tok_s"] for _, m in points], marker="o")
    ax_tok.set(xlabel="arrival rate (req/s)", ylabel="output tokens / s", title="throughput")
    ax_good.plot(rates, [m["goodput_req_s"] for _, m in points], marker="o")
    ax_good.set(xlabel="arrival rate (req/s)", ylabel="requests within SLO / s",
                title="goodput")
    for ax in (ax_tok, ax_good):
        ax.grid(alpha=0.3)
    path = workdir / "load.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def write_plots(results: Sequence[BenchResult], workdir: str | os.PathLike) -> list[Path]:
    """Every plot that applies to `results`; returns the paths written."""
    if not results:
        return []
    workdir = Path(workdir)
    optional = [plot_kv_memory(results, workdir), plot_load(results, workdir)]
    return plot_latency_cdfs(results, workdir) + [p for p in optional if p is not None]
