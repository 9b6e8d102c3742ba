"""Agentic trajectory locality: sticky, migrating and locality-blind turn placement over
rollout workers.

    rows = run(model, EngineConfig(...), num_workers=2, num_trajectories=4, num_turns=6,
               short_turns=2)
    print(table(rows)); write(rows, workdir)

Each trajectory opens with its own random prompt; each turn generates `max_new_tokens`
greedily, then the environment answers with `answer_len` tokens (seeded by trajectory and
turn), and the next turn's prompt is the whole conversation (`kvjax.rl.agentic`). With
`short_turns`, the trajectories whose home is not worker 0 end after that many turns, so the
loads drift apart: worker 0 keeps its trajectories while the others idle. Every placement runs
on the same in-process workers, warmed up first (every step shape and page move compiled),
each over trajectories of its own (distinct first pages, so none hits another's pages).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvjax.engine.config import EngineConfig
from kvjax.models.model import Model
from kvjax.rl.agentic import TurnPlacement, run_trajectories
from kvjax.rl.workers import LocalRolloutPool
from kvjax.sampling import SamplingParams


def run(model: Model, engine_config: EngineConfig, *, num_workers: int = 2,
        num_trajectories: int = 4, num_turns: int = 6, short_turns: int | None = 2,
        first_len: int = 64, answer_len: int = 24, max_new_tokens: int = 16,
        seed: int = 0) -> list[dict[str, Any]]:
    """One row per placement: prompt tokens prefilled and hit, hit rate, migrations, KV bytes
    moved, wall and parallel (side-by-side workers) seconds."""
    pool = LocalRolloutPool(num_workers, lambda: model, engine_config)
    for worker in pool.workers:
        worker.engine.warmup()
    pool.warm_migration()
    turns = [num_turns if short_turns is None or j % num_workers == 0 else short_turns
             for j in range(num_trajectories)]
    vocab = model.config.vocab_size
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)

    def observe(trajectory: int, turn: int, completion: list[int]) -> list[int]:
        rng = np.random.default_rng([seed, trajectory, turn])
        return [int(t) for t in rng.integers(0, vocab, size=answer_len)]

    rows = []
    for offset, placement in enumerate(TurnPlacement):
        rng = np.random.default_rng([seed, offset])
        firsts = [[int(t) for t in rng.integers(0, vocab, size=first_len)]
                  for _ in range(num_trajectories)]
        result = run_trajectories(pool, firsts, observe, num_turns=turns,
                                  sampling=sampling, placement=placement, seed=seed,
                                  name=f"agentic-{placement.value}")
        rows.append(dict(placement=placement.value, num_workers=num_workers,
                         num_trajectories=num_trajectories, num_turns=turns,
                         prompt_tokens=result.prefill_tokens + result.prefix_hit_tokens,
                         prefill_tokens=result.prefill_tokens,
                         prefix_hit_tokens=result.prefix_hit_tokens,
                         prefix_hit_rate=result.prefix_hit_rate, wall_s=result.wall_s,
                         parallel_s=result.parallel_s, migrations=len(result.migrations),
                         kv_bytes_moved=result.kv_bytes_moved))
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = ["| placement | prompt tokens | prefilled | prefix hits | hit rate | migrations | "
             "KV MB moved | seconds (in turn) | seconds (side by side) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['placement']} | {r['prompt_tokens']} | {r['prefill_tokens']} | "
                     f"{r['prefix_hit_tokens']} | {r['prefix_hit_rate']:.3f} | "
                     f"{r['migrations']} | {r['kv_bytes_moved'] / 1e6:.2f} | "
                     f"{r['wall_s']:.1f} | {r['parallel_s']:.1f} |")
    return "\n".join(lines)


def write(rows: Sequence[dict[str, Any]], workdir: str | os.PathLike) -> pathlib.Path:
    """Writes the rows as agentic.json under `workdir`; returns its path."""
    path = pathlib.Path(workdir) / "agentic.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(rows), indent=2))
    return path
