"""The batch job in one process against the same job over Ray Data with 1..N actors.

`compare_workers` writes the lines as a JSONL input, runs `run_batch` in this process (the
baseline) and `run_batch_ray` on a fresh local Ray instance per worker count, and reports for
each: wall time of the whole call (Ray's includes starting actors, loading the model in each
and compiling; the baseline's includes building and compiling its one engine), the job's own
time (`BatchStats.seconds`, from the first request), generated tokens per second over both,
the prefix hit rate, and whether every id's tokens equal the baseline's.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence

from kvjax.batch import BatchStats, run_batch, run_batch_ray
from kvjax.engine.config import EngineConfig
from kvjax.models.model import Model
from kvjax.parallel.ray_local import init_local_ray


def _row(stats: BatchStats, wall: float, tokens: dict, baseline: dict | None) -> dict:
    return dict(wall_seconds=round(wall, 2), job_seconds=round(stats.seconds, 2),
                num_done=stats.num_done, generated_tokens=stats.generated_tokens,
                tokens_per_s_wall=round(stats.generated_tokens / wall, 1),
                tokens_per_s_job=round(stats.generated_tokens / max(stats.seconds, 1e-9), 1),
                prefix_hit_rate=round(stats.prefix_hit_rate, 3),
                prefill_tokens=stats.prefill_tokens,
                tokens_equal_single_process=None if baseline is None else tokens == baseline)


def _tokens(path: str) -> dict[str, list[int]]:
    with open(path) as f:
        return {r["id"]: r.get("tokens") for r in map(json.loads, f)}


def compare_workers(model_factory: Callable[[], Model], lines: Sequence[dict],
                    worker_counts: Sequence[int], config: EngineConfig, *,
                    batch_size: int, order: str = "prefix") -> dict:
    """{'single_process': row, 'ray_<n>': row per worker count}; see the module docstring."""
    import ray  # An optional extra.

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        input_path = os.path.join(tmp, "in.jsonl")
        with open(input_path, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        out = os.path.join(tmp, "single.jsonl")
        t0 = time.perf_counter()
        stats = run_batch(model_factory(), input_path, out, order=order, engine_config=config)
        baseline = _tokens(out)
        results["single_process"] = _row(stats, time.perf_counter() - t0, baseline, None)
        for n in worker_counts:
            out = os.path.join(tmp, f"ray_{n}.jsonl")
            init_local_ray(n)
            try:
                t0 = time.perf_counter()
                stats = run_batch_ray(model_factory, input_path, out, num_workers=n,
                                      batch_size=batch_size, order=order, engine_config=config)
                wall = time.perf_counter() - t0
            finally:
                ray.shutdown()
            results[f"ray_{n}"] = _row(stats, wall, _tokens(out), baseline)
    return results
