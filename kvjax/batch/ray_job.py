"""The offline batch job over Ray Data: the same JSONL in and out as `run_batch`, one engine per
actor.

    stats = run_batch_ray(functools.partial(kvjax.load_model, None, "float32"),
                          "in.jsonl", "out.jsonl", num_workers=2)

The driver reads the input's pending lines (ids already in the output are skipped, repeats
reported, as `run_batch` does); Ray Data maps batches of `batch_size` lines over a pool of
`num_workers` actors, each holding a `BatchRunner` built by `model_factory` inside the actor (so
weights never pass through the driver). An actor parses, orders and runs its batch and returns
one record per line; the driver appends records to the `OutputLog` as they stream in.

Each id exactly once: Ray Data restarts a killed actor and runs its unfinished batch again
(actor pools retry without bound); a batch's records reach the driver only once the whole batch
is done, and the driver writes a record only if its id has no line yet, so a batch run twice
writes nothing twice. A killed driver is rerun with the same command, as with `run_batch`.

Ordering applies within a batch (each actor orders what it is given): `batch_size` trades prefix
reuse inside an actor against balance across actors.

Ray is an optional extra (`pip install 'kvjax[ray]'`); it is imported only when a job starts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import numpy as np

from kvjax.batch.job import (
    BatchRunner,
    BatchStats,
    ProgressBar,
    StatsWriter,
    parse_request,
    pending_lines,
)
from kvjax.batch.output import OutputLog
from kvjax.batch.requests import BadLine
from kvjax.engine.config import EngineConfig
from kvjax.models.model import Model


class EngineBatchWorker:
    """A Ray Data actor's callable: one `BatchRunner`, a batch of input lines in, one JSON
    record per line out.

    Batches are dicts of numpy columns: `line` (str) and `line_number` (int) in; `record`
    (the output line's JSON) and `prefill_tokens` (the tokens the engine prefilled for the
    batch, on its first row; 0 on the others) out.
    """

    def __init__(self, model_factory: Callable[[], Model], runner_kwargs: dict):
        self._model = model_factory()
        self._runner = BatchRunner(self._model, **runner_kwargs)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        items = [parse_request(self._model, str(line), int(n))
                 for line, n in zip(batch["line"], batch["line_number"], strict=True)]
        records: list[str] = []
        before = self._runner.engine.metrics()["prefill_tokens"]
        self._runner.run(items, lambda r: records.append(json.dumps(r, separators=(",", ":"))))
        prefill = np.zeros(len(records), np.int64)
        if records:
            prefill[0] = self._runner.engine.metrics()["prefill_tokens"] - before
        return {"record": np.asarray(records, dtype=object), "prefill_tokens": prefill}


def run_batch_ray(model_factory: Callable[[], Model], input_path: str, output_path: str, *,
                  num_workers: int, batch_size: int = 16, order: str = "input",
                  engine_config: EngineConfig | None = None, window: int | None = None,
                  score_kv_budget_bytes: int | None = None, progress: bool = False
                  ) -> BatchStats:
    """Runs every id of `input_path` not yet in `output_path` on `num_workers` Ray actors.

    Ray must be importable; the job joins the running Ray cluster (`ray.init` first to choose
    one; Ray Data starts a local one otherwise).

    Args:
      model_factory: builds the model inside each actor (a picklable callable, e.g.
        `functools.partial(kvjax.load_model, spec, "float32")`).
      num_workers: actors, one engine each (one CPU each).
      batch_size: input lines per actor call: the unit Ray retries after a worker dies.
      order, engine_config, window, score_kv_budget_bytes, progress: as in `run_batch`, with
        the ordering applied within each batch.
    Returns:
      What this run did; `prefill_tokens` counts batches run again after a worker died twice.
    """
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    import ray.data  # An optional extra: imported only when a Ray job runs.

    runner_kwargs = dict(order=order, engine_config=engine_config, window=window,
                         score_kv_budget_bytes=score_kv_budget_bytes)
    with OutputLog(output_path) as log:
        items = list(pending_lines(input_path, log.done))
        stats = BatchStats(num_skipped=len(log.done))
        bar = ProgressBar(len(items) + len(log.done), len(log.done), progress)
        write = StatsWriter(log, stats, bar)
        lines = [{"line": i[0], "line_number": i[1]} for i in items
                 if not isinstance(i, BadLine)]
        t0 = time.perf_counter()
        for e in items:
            if isinstance(e, BadLine):
                write({"id": e.request_id, "error": str(e), "field": e.field})
        if lines:
            ray.data.DataContext.get_current().enable_progress_bars = False
            dataset = ray.data.from_items(
                lines, override_num_blocks=-(-len(lines) // batch_size)).map_batches(
                EngineBatchWorker, fn_constructor_args=(model_factory, runner_kwargs),
                batch_size=batch_size, compute=ray.data.ActorPoolStrategy(size=num_workers),
                num_cpus=1)
            for row in dataset.iter_rows():
                record = json.loads(row["record"])
                stats.prefill_tokens += int(row["prefill_tokens"])
                if record["id"] not in log.done:  # A batch run again after its actor died.
                    write(record)
        stats.seconds = time.perf_counter() - t0
        bar.close()
    return stats
