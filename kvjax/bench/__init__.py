"""The joint serving benchmark: workloads, the driver, metrics and the energy estimate.

    from kvjax.bench import load_config, run_benchmark
    metrics = run_benchmark(load_config("configs/serve_demo.py"))

Plots live in `kvjax.bench.plots` (imported on demand: it loads matplotlib). The offline
benchmarks that scripts/bench_decode.py, bench_quant.py and bench_retention.py run live in
`kvjax.bench.decode`, `kvjax.bench.quant` and `kvjax.bench.retention`.
"""

from kvjax.bench.energy import PROFILES, HardwareProfile, estimate_energy_j, get_profile
from kvjax.bench.metrics import (
    COUNTER_KEYS,
    METRIC_KEYS,
    QUALITY_KEYS,
    Clock,
    RequestRecord,
    compute_metrics,
    format_table,
    jain_index,
    quality_stats,
)
from kvjax.bench.runner import (
    BenchResult,
    StepCostModel,
    StepRecord,
    apply_overrides,
    build_workload,
    check_supported,
    engine_config_from,
    fit_step_cost,
    load_config,
    parse_sweep,
    run_benchmark,
    run_benchmark_detailed,
    run_sweep,
    run_sweep_detailed,
    score_tokens,
    write_results,
)
from kvjax.bench.workloads import (
    WORKLOADS,
    BenchRequest,
    make_workload,
    read_trace,
    write_trace,
)

__all__ = [
    "COUNTER_KEYS",
    "METRIC_KEYS",
    "PROFILES",
    "QUALITY_KEYS",
    "WORKLOADS",
    "BenchRequest",
    "BenchResult",
    "Clock",
    "HardwareProfile",
    "RequestRecord",
    "StepCostModel",
    "StepRecord",
    "apply_overrides",
    "build_workload",
    "check_supported",
    "compute_metrics",
    "engine_config_from",
    "estimate_energy_j",
    "fit_step_cost",
    "format_table",
    "get_profile",
    "jain_index",
    "load_config",
    "make_workload",
    "parse_sweep",
    "quality_stats",
    "read_trace",
    "run_benchmark",
    "run_benchmark_detailed",
    "run_sweep",
    "run_sweep_detailed",
    "score_tokens",
    "write_results",
    "write_trace",
]
