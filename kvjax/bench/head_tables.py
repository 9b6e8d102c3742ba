"""Decode step time with per-head block tables (AdaKV, `retention_schedule='adakv'`) against
one block table (the same press and budget, every head keeping the same tokens): what the
head-major pages of `kvjax.kv.spec` ("Per-head budgets") cost per step.

Both engines serve the same `batch` prompts of `prompt_len` tokens, compress them once
(SnapKV at `budget`), then decode; their decode steps are timed alternately (one step of
one engine, then one of the other), so a loaded machine slows both alike, and the ratio of
the medians is what the result reports. Pages held after the compaction come from each
engine's allocator, in bytes of one table's page.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import numpy as np

import kvjax
from kvjax.engine.engine import Engine

SCHEDULES = ("uniform", "adakv")


@dataclasses.dataclass
class Result:
    """Attributes: the settings; ms: median decode step ms per schedule; adakv_over_uniform:
    their ratio; kv_bytes: KV bytes the batch held after compaction, per schedule;
    num_tables: block tables per sequence, per schedule."""

    batch: int
    prompt_len: int
    budget: int
    num_steps: int
    ms: dict
    adakv_over_uniform: float
    kv_bytes: dict
    num_tables: dict


def _engine(model: kvjax.Model, schedule: str, batch: int, prompt_len: int, budget: int,
            page_size: int, num_new: int) -> Engine:
    mc = model.config
    tables = 1 if schedule == "uniform" else mc.num_layers * mc.num_kv_heads
    pages = batch * tables * (-(-(prompt_len + num_new) // page_size) + 1)
    return Engine(model, kvjax.EngineConfig(
        page_size=page_size, num_pages=pages, max_model_len=prompt_len + num_new + page_size,
        max_num_seqs=batch, max_prefill_seqs=1, max_prefill_chunk=prompt_len,
        min_chunk_bucket=prompt_len, max_num_batched_tokens=prompt_len,
        enable_prefix_cache=False, retention="snapkv", retention_budget=budget,
        retention_options=dict(window=min(64, budget // 2)), retention_schedule=schedule))


def run(model: kvjax.Model, *, batch: int = 4, prompt_len: int = 512, budget: int = 128,
        num_steps: int = 16, page_size: int = 16, seed: int = 0) -> Result:
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, model.config.vocab_size, prompt_len)]
               for _ in range(batch)]
    warm = 3  # decode steps before timing: the first ones of each shape compile
    num_new = warm + num_steps + 2
    engines = {s: _engine(model, s, batch, prompt_len, budget, page_size, num_new)
               for s in SCHEDULES}
    kv_bytes = {}
    for schedule, engine in engines.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, kvjax.SamplingParams(
                max_new_tokens=num_new, ignore_eos=True))
        for _ in range(batch + warm):  # one prompt per step (max_prefill_seqs=1), then decode
            engine.step()
        kv_bytes[schedule] = engine.allocator.num_used_pages() * engine.kv_spec.page_bytes
    times = {s: [] for s in SCHEDULES}
    for _ in range(num_steps):
        for schedule, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[schedule].append(1e3 * (time.perf_counter() - start))
    ms = {s: statistics.median(t) for s, t in times.items()}
    return Result(batch=batch, prompt_len=prompt_len, budget=budget, num_steps=num_steps,
                  ms=ms, adakv_over_uniform=ms["adakv"] / ms["uniform"],
                  kv_bytes={s: float(b) for s, b in kv_bytes.items()},
                  num_tables={s: len(e.kv_spec.table_groups()) for s, e in engines.items()})


def table(result: Result) -> str:
    """A markdown table of `result`."""
    lines = ["| schedule | block tables / seq | decode step ms (median) | vs one table | KV bytes "
             "held after compaction |", "|---|---:|---:|---:|---:|"]
    for s in SCHEDULES:
        lines.append(f"| {s} | {result.num_tables[s]} | {result.ms[s]:.1f} | "
                     f"{result.ms[s] / result.ms['uniform']:.2f} | {result.kv_bytes[s]:,.0f} |")
    return "\n".join(lines)


def write(result: Result, path: str) -> None:
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(result), f, indent=1)
