"""Decode step time of every retention press and budget scheme against exact KV, at batch B:
what `scripts/bench_press_decode.py` runs; `run` is the whole benchmark.

One engine per variant (`kvjax.bench.retention.make_engine`, the variant strings of
`scripts/bench_retention.py`: `snapkv:2000`, `snapkv:2000:schedule=adakv`, `tova:2000`, ...)
and exact KV ("none") serve the same B corpus-text prompts of `context` tokens
(`kvjax.bench.decode.make_prompts`). Each runs its own prefill and its press's own
prefill-time selection (no shared prefix pages: every engine's prefix cache is off), then
decodes; the engines take turns, one step each (`kvjax.bench.decode.timed_engine_runs`), so a
loaded machine slows all alike and the ratios of their medians are what to read. Only steps
that decode all B sequences, run no prefill and compile nothing are timed. Every engine steps
synchronously (a press that evicts from each step's key scores must): an engine that returned
before its device work ended would hand that work's time to the next engine's step.

At the dispatch of every such step an observer reads, from the engine's allocator, the pages
each sequence holds (`num_held_pages`: every block table, so one page of one layer and kv head
under the per-head schedules), and the KV bytes the step's attention reads are those pages
times the bytes of a page (`kv_bytes_per_page`; what the paged kernel walks: every held page
of a row, up to its cached length). Beside it, the pages the budget alone implies, counted
from the sequence's tokens: exact KV ceil(n / P) for its n cached tokens; a press that
compresses once ceil((budget + g) / P) pages per table for its g generated tokens (exact for
the uniform and per_head schedules; under pyramid and adakv the tables' budgets differ around
the same mean, so ceil(T (budget + g) / P) over the T tables, a lower bound that each table's
rounding up to whole pages exceeds); a press that evicts as it decodes
(streaming, h2o, tova) at most ceil(budget / P) + 1 (it evicts back to the budget once it
caches budget + P tokens). Quest keeps every page and reads a subset, so pages held are not
what it reads: it is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

import kvjax
from kvjax.bench import decode
from kvjax.bench import retention as retention_bench
from kvjax.engine.runner import StepObserver
from kvjax.kv.retention import make_retention

EXACT = "none"
# Schedules whose block tables keep different numbers of tokens (their mean is the budget).
UNEQUAL_SCHEDULES = ("pyramid", "adakv", "pyramid_adakv", "global")


@dataclasses.dataclass(frozen=True)
class PressDecodeBench:
    """What one run compares.

    Attributes:
      variants: retention variants (`kvjax.bench.retention.parse_variant`), each against exact
        KV, which always runs.
      batch: sequences decoding at once (B).
      context: prompt tokens per sequence.
      new_tokens: tokens each sequence decodes after the prompts' prefill steps (about as many
        full-batch decode steps are timed).
      page_size: tokens per page (P).
      chunk: prefill chunk (one sequence prefills at a time).
      seed: which corpus text the prompts are.
    """

    variants: tuple[str, ...]
    batch: int = 8
    context: int = 8000
    new_tokens: int = 32
    page_size: int = 16
    chunk: int = 2048
    seed: int = 0

    def __post_init__(self):
        for variant in self.variants:
            if retention_bench.parse_variant(variant)[0] == "quest":
                raise ValueError(f"variant {variant!r}: quest holds every page and reads a "
                                 "subset, so its pages held are not the bytes it reads")


def expected_pages(variant: str, num_prompt: int, num_computed: int, page_size: int,
                   num_tables: int) -> int:
    """Pages (of one block table each) the budget alone implies for a sequence that has
    computed `num_computed` tokens of which `num_prompt` are its prompt (module docstring):
    exact, or for an evicting-as-it-decodes press an upper bound, or under pyramid and adakv
    a lower bound."""
    name, budget, options = retention_bench.parse_variant(variant)
    if name == EXACT:
        return -(-num_computed // page_size)
    options, fields = retention_bench.split_options(options)
    schedule = fields.get("retention_schedule", "uniform")
    if not make_retention(name, budget, page_size, **options).compresses_once:
        return -(-budget // page_size) + 1
    per_table = budget + num_computed - num_prompt  # tokens, on average over the tables
    if schedule in UNEQUAL_SCHEDULES:
        return -(-num_tables * per_table // page_size)
    return num_tables * -(-per_table // page_size)


class HeldPages(StepObserver):
    """Records, at the dispatch of each full-batch decode step, every running sequence's held
    pages (read from the allocator) and computed tokens (the step's own included)."""

    def __init__(self, engine: kvjax.Engine, batch: int):
        self.engine = engine
        self.batch = batch
        self.samples: list[list[tuple[int, int, int]]] = []  # per step: (held, computed, prompt)

    def before_step(self, shape, host_input) -> None:
        running = list(self.engine.scheduler.running)
        if shape.num_prefill or len(running) != self.batch or any(
                s.num_computed <= s.num_prompt_tokens for s in running):
            return
        allocator = self.engine.allocator
        self.samples.append([(allocator.num_held_pages(s.seq_id), s.num_computed,
                              s.num_prompt_tokens) for s in running])


def pages_summary(variant: str, engine: kvjax.Engine, samples: list[list[tuple[int, int, int]]],
                  page_size: int) -> dict:
    """Mean pages held per sequence and per step, the budget's expected count, and the mean KV
    bytes of the pages the batch holds per step (what its attention reads)."""
    if not samples:
        raise ValueError(f"variant {variant!r}: no full-batch decode step: raise new_tokens")
    num_tables = len(engine.kv_spec.table_groups())
    held = np.array([[h for h, _, _ in step] for step in samples], np.float64)  # [steps, B]
    expected = np.array([[expected_pages(variant, p, c, page_size, num_tables)
                          for _, c, p in step] for step in samples], np.float64)
    page_bytes = engine.kv_bytes_per_page
    return dict(pages_held_per_seq=float(held.mean()), pages_expected_per_seq=float(
        expected.mean()), pages_held_max=int(held.max()), page_bytes=page_bytes,
        num_tables=num_tables, kv_bytes_per_step=float(held.sum(axis=1).mean() * page_bytes),
        samples=[[list(seq) for seq in step] for step in samples])


def run(model: kvjax.Model, settings: PressDecodeBench,
        prompts: list[list[int]] | None = None) -> dict:
    """Exact KV and every variant, side by side, on `prompts` (B of `context` tokens; None:
    corpus text). Returns a JSON-ready dict: env, settings, rows (per variant: step times,
    their device and host parts, pages, bytes, their ratios to exact, and `samples`: per
    timed dispatch, each sequence's [held pages, computed tokens, prompt tokens])."""
    if prompts is None:
        prompts = decode.make_prompts(model, settings.batch, settings.context, settings.seed)
    env = decode.environment()
    # A step's chunk is shared with the rows already decoding (up to B - 1 of them).
    prefill_steps = -(-settings.context // (settings.chunk - settings.batch + 1)) * settings.batch
    num_tokens = settings.new_tokens + prefill_steps
    max_len = settings.context + num_tokens
    engines, observers = {}, {}
    for variant in (EXACT, *settings.variants):
        engine = retention_bench.make_engine(model, variant, max_len,
                                             page_size=settings.page_size, chunk=settings.chunk,
                                             num_seqs=settings.batch,
                                             async_scheduling=False)
        observers[variant] = HeldPages(engine, settings.batch)
        engine.add_step_observer(observers[variant])
        engines[variant] = engine
    runs = decode.timed_engine_runs(engines, prompts, num_tokens, profile=False)
    rows = {}
    for variant, timed in runs.items():
        steps = [r for r in timed.records if r.num_decode == settings.batch
                 and r.num_prefill == 0 and not r.compiled]
        if not steps:
            raise ValueError(f"variant {variant!r}: no full-batch decode step: raise new_tokens")
        # device_s: dispatch (the step's input building included) to tokens on the host;
        # host_s: scheduling and committing. A gap between variants in device_s alone is the
        # device step's own, in host_s the host's per-table work.
        rows[variant] = dict(step_s=decode.summarize([r.wall_s for r in steps]),
                             device_s=decode.summarize([r.device_s for r in steps]),
                             host_s=decode.summarize([r.host_s for r in steps]),
                             **pages_summary(variant, timed.engine, observers[variant].samples,
                                             settings.page_size))
    exact = rows[EXACT]
    for row in rows.values():
        row.update(step_ratio=row["step_s"]["median"] / exact["step_s"]["median"],
                   kv_bytes_ratio=row["kv_bytes_per_step"] / exact["kv_bytes_per_step"])
    env["load_average_end"] = list(os.getloadavg())
    return dict(env=env, settings=dataclasses.asdict(settings), rows=rows)


def format_table(report: dict) -> str:
    """A markdown table, one row per variant."""
    lines = ["| variant | step ms (median) | dispatch + wait ms | host ms | step vs exact | "
             "KV bytes read / step vs exact | pages held / seq (allocator) | "
             "pages expected / seq (budget) | tables / seq |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for variant, r in report["rows"].items():
        lines.append(f"| {variant} | {1e3 * r['step_s']['median']:.1f} | "
                     f"{1e3 * r['device_s']['median']:.1f} | {1e3 * r['host_s']['median']:.1f} "
                     f"| {r['step_ratio']:.2f} "
                     f"| {r['kv_bytes_ratio']:.3f} | {r['pages_held_per_seq']:.1f} | "
                     f"{r['pages_expected_per_seq']:.1f} | {r['num_tables']} |")
    return "\n".join(lines)


def write(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
