"""Offline batch inference: ordering for prefix reuse, prefill-only scoring, crash-safe jobs.

    from kvjax.batch import run_batch
    stats = run_batch(model, "requests.jsonl", "outputs.jsonl", order="prefix")

Modules: `requests` (input lines), `output` (durable JSONL output), `ordering` (input,
prefix, fields, blend behind a registry), `job` (the job loop), `ray_job` (the same job over
Ray Data, one engine per actor; Ray is an optional extra); scoring requests run on
`kvjax.models.scoring` (layer-by-layer prefill-only scoring).
"""

from kvjax.batch.job import BatchRunner, BatchStats, run_batch
from kvjax.batch.ordering import (
    ORDERINGS,
    Ordering,
    make_ordering,
    prefix_order,
    register_ordering,
    shared_field_order,
)
from kvjax.batch.output import OutputLog, done_ids
from kvjax.batch.ray_job import run_batch_ray
from kvjax.batch.requests import BadLine, BatchRequest, parse_line, render_record
from kvjax.models.scoring import PrefillOnlyScorer

__all__ = [
    "ORDERINGS",
    "BadLine",
    "BatchRequest",
    "BatchRunner",
    "BatchStats",
    "Ordering",
    "OutputLog",
    "PrefillOnlyScorer",
    "done_ids",
    "make_ordering",
    "parse_line",
    "prefix_order",
    "register_ordering",
    "render_record",
    "run_batch",
    "run_batch_ray",
    "shared_field_order",
]
