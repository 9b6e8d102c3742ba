"""Metrics of the joint serving benchmark: one dict with a fixed schema per run.

`compute_metrics` turns per-request timelines (`RequestRecord`) and the engine's counters into
the dict whose keys are `METRIC_KEYS`; every key is always present and is None when the run
does not measure it. `format_table` lays several runs side by side as markdown.

Conventions:
    - Times are seconds on one clock (real or simulated, recorded in `clock`).
    - Percentiles interpolate linearly between order statistics (numpy's default).
    - Only requests without an error count as served: latency percentiles, throughput,
      goodput and fairness use them; failed ones are counted in `failed_requests`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvjax.bench.energy import TIERS, HardwareProfile, estimate_energy_j

METRIC_KEYS: tuple[str, ...] = (
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "throughput_tok_s",
    "goodput_req_s",
    "kv_utilization_mean",
    "kv_utilization_peak",
    "kv_reserved_mean_bytes",
    "kv_reserved_peak_bytes",
    "prefix_hit_rate",
    "preemptions",
    "bytes_moved",
    "energy_j_est",
    "quality",
    "kl_spent",
    "retrieval_accuracy",
    "fairness",
    "compiles_after_warmup",
    "padded_token_fraction",
    "spec",
    "context_reuse",
    "failed_requests",
    "num_requests",
    "duration_s",
    "clock",
    "config",
    "env",
)

QUALITY_KEYS: tuple[str, ...] = ("kl_mean", "kl_p99", "kl_max", "top1_agreement")

# Engine counters compute_metrics reads; any other name is rejected so a typo cannot turn a
# measured value into a silent None.
COUNTER_KEYS: tuple[str, ...] = (
    "prefix_hit_tokens",  # prompt tokens served from the prefix cache
    "prefix_query_tokens",  # prompt tokens looked up in the prefix cache
    "preemptions",  # sequences preempted (swapped out or dropped for recompute)
    "bytes_moved_device",  # KV bytes read or written in device memory by transfers
    "bytes_moved_host",  # KV bytes moved between device and host memory
    "bytes_moved_disk",  # KV bytes moved to or from disk
    "compiles_after_warmup",  # XLA compilations after the warm-up phase
    "flops",  # floating-point operations executed (for the energy estimate)
    "step_tokens",  # token slots the steps computed, padding included
    "padded_tokens",  # of those, padding (slots that carried no request's token)
    "spec_proposed",  # speculative draft tokens verify steps checked
    "spec_accepted",  # of those, kept
    "spec_verify_rows",  # verify rows (one per sequence per verify step)
    "spec_draft_steps",  # steps that ran draft rows (sparse_self drafts)
    "prefill_tokens",  # tokens computed outside decode rows (chunk fills and recomputes too)
    "chunk_hits",  # reusable chunks copied from the chunk cache into a request
    "chunk_fills",  # chunks computed alone first because the chunk cache lacked them
    "chunk_reused_tokens",  # tokens copied from the chunk cache
    "blend_tokens",  # chunk tokens CacheBlend recomputed after the copy
)

# Time differences of equal instants can differ from the SLO by float rounding; a request is
# within an SLO when it exceeds it by less than this (far below any clock's resolution).
_SLO_TOLERANCE_S = 1e-9


class Clock(enum.Enum):
    """Which clock the timestamps were taken on."""

    REAL = "real"  # wall-clock time of a run on hardware
    SIMULATED = "simulated"  # the time of a simulator or a cost model


@dataclasses.dataclass
class RequestRecord:
    """The timeline of one request, filled in by the benchmark driver as it runs.

    Attributes:
        request_id: the request's id.
        tenant: who sent it; None for a single tenant.
        arrival_time: when it was submitted.
        first_token_time: when its first output token was available; None if never.
        token_times: when each output token was available (empty if not recorded, then
            `finish_time` stands for the last token's time).
        finish_time: when it completed or failed; None if it never did.
        num_prompt_tokens: prompt length.
        num_output_tokens: tokens generated.
        error: why it failed, or None if it succeeded.
        num_cached_prompt_tokens: prompt tokens served from the prefix cache.
        is_correct: for a retrieval probe (a needle prompt), whether the output holds the
            expected answer; None for other requests.
        slo_ttft_s, slo_tpot_s: its own SLO targets; None: the run's.
        kl_spent: the KL (nats per token, estimated from measured tables) a KV controller's
            degradations cost it.
    """

    request_id: str
    tenant: str | None
    arrival_time: float
    first_token_time: float | None
    token_times: list[float]
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None
    num_cached_prompt_tokens: int = 0
    is_correct: bool | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    kl_spent: float = 0.0


def _validate_record(r: RequestRecord) -> None:
    where = f"request {r.request_id!r}"
    if r.num_output_tokens < 0 or r.num_prompt_tokens < 0:
        raise ValueError(f"{where}: token counts must be >= 0, got prompt "
                         f"{r.num_prompt_tokens}, output {r.num_output_tokens}")
    if r.token_times and len(r.token_times) != r.num_output_tokens:
        raise ValueError(f"{where}: {len(r.token_times)} token_times for "
                         f"{r.num_output_tokens} output tokens")
    if np.any(np.diff(r.token_times) < 0):
        raise ValueError(f"{where}: token_times are not non-decreasing")
    if r.first_token_time is not None and r.first_token_time < r.arrival_time:
        raise ValueError(f"{where}: first_token_time {r.first_token_time} precedes "
                         f"arrival_time {r.arrival_time}")
    if r.error is None and r.num_output_tokens > 0 and r.first_token_time is None:
        raise ValueError(f"{where}: succeeded with output tokens but no first_token_time")
    if r.error is None and r.num_output_tokens > 1 and not r.token_times and (
            r.finish_time is None):
        raise ValueError(f"{where}: needs token_times or finish_time to compute TPOT")


def _plain_number(name: str, value: float) -> int | float:
    """A counter as a Python int or float (numpy scalars are not JSON-serializable)."""
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"counter {name!r} must be finite and >= 0, got {value!r}")
    return int(number) if number.is_integer() else number


def _ttft(r: RequestRecord) -> float | None:
    return None if r.first_token_time is None else r.first_token_time - r.arrival_time


def _tpot(r: RequestRecord) -> float | None:
    """(last token time - first token time) / (n_out - 1); None with fewer than 2 tokens."""
    if r.num_output_tokens < 2 or r.first_token_time is None:
        return None
    last = r.token_times[-1] if r.token_times else r.finish_time
    return (last - r.first_token_time) / (r.num_output_tokens - 1)


def _percentile(values: Sequence[float], q: float) -> float | None:
    """numpy's default (linear) percentile, but inf where it interpolates toward an inf."""
    if not len(values):
        return None
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    rank = q / 100.0 * (ordered.size - 1)
    low, high = ordered[math.floor(rank)], ordered[math.ceil(rank)]
    if low == high:  # also inf == inf, where numpy computes inf - inf = nan
        return float(low)
    return float(low + (rank - math.floor(rank)) * (high - low))


def meets_slo(r: RequestRecord, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    """Whether a request met its own targets (else the run's)."""
    slo_ttft_s = slo_ttft_s if r.slo_ttft_s is None else r.slo_ttft_s
    slo_tpot_s = slo_tpot_s if r.slo_tpot_s is None else r.slo_tpot_s
    ttft, tpot = _ttft(r), _tpot(r)
    return (ttft is not None and ttft <= slo_ttft_s + _SLO_TOLERANCE_S
            and (tpot is None or tpot <= slo_tpot_s + _SLO_TOLERANCE_S))


def _kl_spent(served: Sequence[RequestRecord]) -> dict[str, float] | None:
    """What a KV controller's degradations cost in quality: mean and worst estimated KL over
    the served requests, and how many were degraded at all."""
    if not served:
        return None
    kl = np.asarray([r.kl_spent for r in served], np.float64)
    return {"mean": float(kl.mean()), "max": float(kl.max()),
            "degraded_requests": int(np.count_nonzero(kl))}


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2), in [1/n, 1]; 1 when all are equal.

    All zeros count as equal shares (1.0).
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"jain_index needs a non-empty 1-D sequence, got shape {x.shape}")
    if not np.all(np.isfinite(x)) or np.any(x < 0):
        raise ValueError(f"jain_index needs finite non-negative values, got {x.tolist()}")
    sum_squares = float(np.sum(x * x))
    return 1.0 if sum_squares == 0 else float(np.sum(x) ** 2 / (x.size * sum_squares))


def _kv_utilization(kv_samples: Sequence[tuple[float, float, float]]
                    ) -> tuple[float | None, float | None]:
    """Time-weighted mean and peak of live / allocated KV bytes.

    Each sample holds until the next one (the last one only counts for the peak); samples
    with nothing allocated are left out, so the mean is over the time KV was allocated.
    """
    samples = np.asarray(sorted(kv_samples, key=lambda s: s[0]), dtype=np.float64)
    if samples.size == 0:
        return None, None
    if samples.ndim != 2 or samples.shape[1] != 3:
        raise ValueError(f"kv_samples must be (time, live_bytes, allocated_bytes) triples, got "
                         f"shape {samples.shape}")
    times, live, allocated = samples.T  # [num_samples] each
    if np.any(live < 0) or np.any(live > allocated):
        raise ValueError("kv_samples need 0 <= live_token_bytes <= allocated_kv_bytes")
    held = np.append(np.diff(times), 0.0)  # [num_samples] seconds each sample holds
    kept = allocated > 0
    if not np.any(kept):
        return None, None
    utilization = live[kept] / allocated[kept]
    weights = held[kept]
    mean = (np.sum(utilization * weights) / np.sum(weights) if np.sum(weights) > 0
            else np.mean(utilization))
    return float(mean), float(np.max(utilization))


def _kv_reserved(kv_samples: Sequence[tuple[float, float, float]]
                 ) -> tuple[float | None, float | None]:
    """Time-weighted mean and peak of allocated KV bytes; each sample holds until the next."""
    samples = np.asarray(sorted(kv_samples, key=lambda s: s[0]), dtype=np.float64)
    if samples.size == 0:
        return None, None
    times, _, allocated = samples.T  # [num_samples] each
    held = np.append(np.diff(times), 0.0)  # [num_samples]
    mean = (np.sum(allocated * held) / np.sum(held) if np.sum(held) > 0
            else np.mean(allocated))
    return float(mean), float(np.max(allocated))


def _fairness(served: Sequence[RequestRecord], records: Sequence[RequestRecord]
              ) -> dict[str, Any] | None:
    names = sorted({r.tenant or "default" for r in records})
    if len(names) < 2:
        return None
    per_tenant = {}
    for name in names:
        mine = [r for r in served if (r.tenant or "default") == name]
        ttfts = [t for t in map(_ttft, mine) if t is not None]
        per_tenant[name] = {
            "num_requests": sum((r.tenant or "default") == name for r in records),
            "failed_requests": sum((r.tenant or "default") == name and r.error is not None
                                   for r in records),
            "output_tokens": sum(r.num_output_tokens for r in mine),
            "prompt_tokens": sum(r.num_prompt_tokens for r in mine),
            "prefix_hit_rate": (sum(r.num_cached_prompt_tokens for r in mine)
                                / max(sum(r.num_prompt_tokens for r in mine), 1)),
            "ttft_p50_s": _percentile(ttfts, 50),
            "ttft_p99_s": _percentile(ttfts, 99),
        }
    return {
        "per_tenant": per_tenant,
        "jain_output_tokens": jain_index([t["output_tokens"] for t in per_tenant.values()]),
        "jain_prompt_tokens": jain_index([t["prompt_tokens"] for t in per_tenant.values()]),
    }


def _validated_quality(quality: Mapping[str, float]) -> dict[str, float]:
    if set(quality) != set(QUALITY_KEYS):
        raise ValueError(f"quality must have keys {QUALITY_KEYS}, got {sorted(quality)}")
    return {k: float(quality[k]) for k in QUALITY_KEYS}


def compute_metrics(records: Sequence[RequestRecord], *, slo_ttft_s: float, slo_tpot_s: float,
                    duration_s: float,
                    kv_samples: Sequence[tuple[float, float, float]] | None = None,
                    counters: Mapping[str, float] | None = None,
                    quality: Mapping[str, float] | None = None,
                    energy: float | HardwareProfile | None = None,
                    config: Any = None, env: Any = None,
                    clock: Clock | str = Clock.REAL) -> dict[str, Any]:
    """The benchmark's metrics for one run; keys are exactly `METRIC_KEYS`.

    Args:
        records: one per request.
        slo_ttft_s / slo_tpot_s: a request counts toward goodput when it succeeded, its TTFT
            is at most `slo_ttft_s` and its TPOT at most `slo_tpot_s` (a request with one
            output token has no TPOT and is judged on TTFT alone). Use math.inf for none.
        duration_s: the run's duration, the denominator of throughput and goodput.
        kv_samples: (time, live_token_bytes, allocated_kv_bytes) samples for KV utilization.
        counters: engine counters, names from `COUNTER_KEYS`.
        quality: `quality_stats` output, against exact KV.
        energy: joules already estimated, or a `HardwareProfile` to estimate them from
            `counters["flops"]`, the bytes moved and `duration_s`. Always an estimate.
        config / env: echoed (the run's configuration; software and hardware versions).
        clock: whether timestamps are real or simulated.

    Returns:
        A JSON-serializable dict; see the module docstring for the conventions.
    """
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be finite and > 0, got {duration_s!r}")
    for name, slo in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
        if not slo > 0:
            raise ValueError(f"{name} must be > 0 (math.inf for no SLO), got {slo!r}")
    clock = Clock(clock)
    counters = {name: _plain_number(name, value) for name, value in (counters or {}).items()}
    unknown = sorted(set(counters) - set(COUNTER_KEYS))
    if unknown:
        raise ValueError(f"unknown counter(s) {unknown}; expected names from {COUNTER_KEYS}")
    for r in records:
        _validate_record(r)

    served = [r for r in records if r.error is None]
    ttfts = [t for t in map(_ttft, served) if t is not None]
    tpots = [t for t in map(_tpot, served) if t is not None]
    kv_mean, kv_peak = _kv_utilization(kv_samples or [])
    reserved_mean, reserved_peak = _kv_reserved(kv_samples or [])
    probes = [r.is_correct for r in served if r.is_correct is not None]

    query_tokens = counters.get("prefix_query_tokens")
    prefix_hit_rate = (counters.get("prefix_hit_tokens", 0) / query_tokens
                       if query_tokens else None)
    bytes_moved = None
    if any(f"bytes_moved_{tier}" in counters for tier in TIERS):
        bytes_moved = {tier: counters.get(f"bytes_moved_{tier}", 0) for tier in TIERS}

    if isinstance(energy, HardwareProfile):
        if "flops" not in counters:
            raise ValueError("estimating energy from a HardwareProfile needs counters['flops']")
        energy = estimate_energy_j(energy, counters["flops"], bytes_moved or {}, duration_s)

    metrics = {
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "tpot_p50_s": _percentile(tpots, 50),
        "tpot_p99_s": _percentile(tpots, 99),
        "throughput_tok_s": sum(r.num_output_tokens for r in served) / duration_s,
        "goodput_req_s": sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in served)
        / duration_s,
        "kv_utilization_mean": kv_mean,
        "kv_utilization_peak": kv_peak,
        "kv_reserved_mean_bytes": reserved_mean,
        "kv_reserved_peak_bytes": reserved_peak,
        "prefix_hit_rate": prefix_hit_rate,
        "preemptions": counters.get("preemptions"),
        "bytes_moved": bytes_moved,
        "energy_j_est": None if energy is None else float(energy),
        "quality": None if quality is None else _validated_quality(quality),
        "kl_spent": _kl_spent(served),
        "retrieval_accuracy": float(np.mean(probes)) if probes else None,
        "fairness": _fairness(served, records),
        "compiles_after_warmup": counters.get("compiles_after_warmup"),
        "padded_token_fraction": (counters["padded_tokens"] / counters["step_tokens"]
                                  if counters.get("step_tokens") else None),
        "spec": _spec(counters),
        "context_reuse": _context_reuse(counters),
        "failed_requests": len(records) - len(served),
        "num_requests": len(records),
        "duration_s": float(duration_s),
        "clock": clock.value,
        "config": config,
        "env": env,
    }
    return metrics


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Rows of logits [T, V] as log-probabilities, in x's dtype (float64 for accuracy)."""
    row_max = np.max(x, axis=-1, keepdims=True)  # [T, 1]
    if not np.all(np.isfinite(row_max)):
        raise ValueError("every row needs at least one finite log-probability")
    shifted = x - row_max  # [T, V]
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))  # [T, V]


def quality_stats(logp_ref: np.ndarray, logp_test: np.ndarray) -> dict[str, float]:
    """Per-token KL(ref || test) and top-1 agreement of two next-token distributions.

    Args:
        logp_ref: [T, V] log-probabilities (or logits) computed with exact KV.
        logp_test: [T, V] the same positions computed with the KV variant under test.

    Each row is renormalized with a float64 log-softmax, so logits work too. KL is in nats;
    a token the reference gives mass but the test rules out (-inf) has infinite KL.

    Returns:
        {"kl_mean", "kl_p99", "kl_max"} over the T tokens and "top1_agreement", the fraction
        of tokens whose argmax agrees.
    """
    ref = np.asarray(logp_ref, dtype=np.float64)
    test = np.asarray(logp_test, dtype=np.float64)
    if ref.ndim != 2 or ref.shape != test.shape or ref.shape[0] == 0:
        raise ValueError(f"need equal [T, V] shapes with T >= 1, got {ref.shape} and "
                         f"{test.shape}")
    if np.isnan(ref).any() or np.isnan(test).any():
        raise ValueError("log-probabilities contain NaN")
    ref, test = log_softmax(ref), log_softmax(test)  # [T, V]
    p_ref = np.exp(ref)  # [T, V]
    with np.errstate(invalid="ignore"):
        terms = np.where(p_ref > 0, p_ref * (ref - test), 0.0)  # [T, V]
    kl = np.maximum(np.sum(terms, axis=-1), 0.0)  # [T]; clamps float rounding below zero
    agreement = np.argmax(ref, axis=-1) == np.argmax(test, axis=-1)  # [T]
    return {
        "kl_mean": float(np.mean(kl)),
        "kl_p99": _percentile(kl, 99),
        "kl_max": float(np.max(kl)),
        "top1_agreement": float(np.mean(agreement)),
    }


DEFAULT_TABLE_COLUMNS: tuple[str, ...] = (
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "throughput_tok_s",
    "goodput_req_s", "kv_utilization_mean", "kv_utilization_peak", "kv_reserved_peak_bytes",
    "prefix_hit_rate", "preemptions", "bytes_moved.device", "bytes_moved.host", "bytes_moved.disk",
    "energy_j_est", "quality.kl_mean", "quality.kl_max", "quality.top1_agreement",
    "retrieval_accuracy", "fairness.jain_output_tokens", "failed_requests",
)


def _spec(counters: Mapping[str, Any]) -> dict[str, float] | None:
    """Speculative decoding: acceptance_rate (kept / proposed drafts), tokens_per_step
    (tokens a verify row emits: its kept drafts plus the model's own), and draft_steps; None
    without verify rows."""
    rows = counters.get("spec_verify_rows")
    if not rows:
        return None
    accepted = counters.get("spec_accepted", 0)
    return {"acceptance_rate": accepted / max(counters.get("spec_proposed", 0), 1),
            "tokens_per_step": (rows + accepted) / rows,
            "draft_steps": counters.get("spec_draft_steps", 0)}


def _context_reuse(counters: Mapping[str, Any]) -> dict[str, float] | None:
    """Non-prefix context reuse: chunk_hit_rate (chunk copies that found the chunk cached,
    not computed for them first), reused_tokens, blend_tokens and prefill_tokens (every token
    computed outside decode rows, chunk fills and recomputes included); None without copies."""
    hits = counters.get("chunk_hits")
    if not hits:
        return None
    return {"chunk_hit_rate": max(0.0, 1.0 - counters.get("chunk_fills", 0) / hits),
            "reused_tokens": counters.get("chunk_reused_tokens", 0),
            "blend_tokens": counters.get("blend_tokens", 0),
            "prefill_tokens": counters.get("prefill_tokens", 0)}


def _lookup(metrics: Mapping[str, Any], column: str) -> Any:
    top, *rest = column.split(".")
    if top not in METRIC_KEYS:
        raise ValueError(f"unknown column {column!r}; its first part must be in METRIC_KEYS")
    value = metrics.get(top)
    for part in rest:
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_format_cell(v)}" for k, v in value.items())
    return str(value)


def format_table(runs: Sequence[Mapping[str, Any]],
                 columns: Sequence[str] | None = None) -> str:
    """A markdown table with one row per run and one column per metric.

    Args:
        runs: `compute_metrics` dicts. A run is labelled by `config["name"]` when its config
            is a mapping with a name, else by its index.
        columns: metric keys; a dot reaches into a nested dict ("bytes_moved.host",
            "quality.kl_max"). Defaults to `DEFAULT_TABLE_COLUMNS`.
    """
    columns = tuple(DEFAULT_TABLE_COLUMNS if columns is None else columns)
    for column in columns:
        _lookup({}, column)
    lines = ["| run | " + " | ".join(columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for index, run in enumerate(runs):
        config = run.get("config")
        label = config["name"] if isinstance(config, Mapping) and "name" in config else index
        cells = [_format_cell(_lookup(run, column)) for column in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_rows(rows: Mapping[str, Mapping[str, float]],
                columns: Sequence[tuple[str, str, str]], label: str) -> str:
    """A markdown table of named rows, as the offline benchmark scripts print them.

    Args:
        rows: row name -> {key: value}; a key the row lacks leaves its cell blank, a None
            value (a measure the run has none of, e.g. prefix hits without a prefix cache)
            is "-".
        columns: (key, header, format spec such as "{:.2e}") per column.
        label: the header of the row-name column.
    """
    lines = [f"| {label} | " + " | ".join(header for _, header, _ in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for name, row in rows.items():
        cells = ["" if key not in row else "-" if row[key] is None else fmt.format(row[key])
                 for key, _, fmt in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
