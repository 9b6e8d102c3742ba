"""The joint serving benchmark driver: a config in, one metrics dict per run out.

A run builds the workload (`kvjax.bench.workloads`), an `Engine` from the config's engine
section, compiles every step shape (`Engine.warmup`), then replays the requests on a clock
and turns what came back into `compute_metrics`'s dict (keys `METRIC_KEYS`).

Clocks (`config.clock`):
    real: the engine's clock is `time.perf_counter()` minus the run's start. A request is
        submitted once the wall clock passes its arrival time (its TTFT counts from that
        arrival time, so a late submission shows up as latency); the loop steps while
        anything is pending and sleeps when the engine is idle.
    simulated: a virtual clock that only the cost model advances, so a run replays the same
        way on any host. Each step's dispatch advances it by

            overhead_s + per_token_s * T + per_context_token_s * S + host_bytes / host_bytes_per_s

        with T the step's padded token count (what static-shape hardware computes), S the
        sum of the KV lengths its rows read (what retention kept; quest's decode rows at most
        its budget) and host_bytes the device-host traffic since the previous step (swaps,
        and with tiers on, spills and loads). When the engine is idle the clock jumps to the next
        arrival. Tokens are stamped with the clock after their step's cost is added.

Counters (estimates from the model config and each step's token layout, not measurements):
    flops: 2 * (matmul parameters per layer stack) * T + 2 * H * V per sampled row
        + 4 * L * N * D * (query, key) pairs attended (causal within a prefill chunk).
    bytes_moved.device: every weight read once per step, plus KV written for the step's real
        tokens and KV read for its rows' contexts (at the engine's bytes per token, codec
        included), plus both sides of copy-on-write page copies.
    bytes_moved.host: device <-> host traffic, both ways: the tiers' counters with a host
        tier (swaps, prefix-cache spills and loads), else the swap traffic
        (`stats['swap_bytes']`).
    bytes_moved.disk: host <-> disk traffic of the disk tier (0 without one).

Quality (only for a non-exact variant: a quantized codec, a retention policy, or a KV dtype
other than the model's), on the first `quality.num_prompts` prompts. Without retention an
exact engine generates `quality.num_tokens` greedy tokens; the exact and the variant engine
then score prompt + continuation teacher-forced (`score_tokens`). With retention (which acts
between steps, so a single prefill would not show it) the variant decodes the tokens step
by step, keeping each step's logits, and the exact engine scores prompt + those tokens.
`quality_stats` compares the rows that predict the continuation.

Retrieval: a request with an `answer` (a needle probe) is correct when its decoded output
contains the answer (`retrieval_accuracy`).
"""

from __future__ import annotations

import ast
import collections
import copy
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import platform
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from ml_collections import ConfigDict
from tqdm import tqdm

from kvjax import cpu_kernels
from kvjax.bench.energy import get_profile
from kvjax.bench.metrics import (
    DEFAULT_TABLE_COLUMNS,
    Clock,
    RequestRecord,
    compute_metrics,
    format_table,
    quality_stats,
)
from kvjax.bench.workloads import BenchRequest, Tokenizer, make_workload
from kvjax.config import resolve_dtype
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.request import RequestOutput
from kvjax.engine.runner import StepObserver
from kvjax.engine.step import LogitsMode, StepShape
from kvjax.memory.ops import KVOp, KVOpKind
from kvjax.memory.tiers import TierConfig
from kvjax.memory.transfer import FaultConfig
from kvjax.models.loading import load_model
from kvjax.models.model import Model
from kvjax.sampling import SamplingParams
from kvjax.scheduler.controller import SLO, make_controller
from kvjax.scheduler.spec import SpecConfig
from kvjax.shapes import next_power_of_2

# Columns of results.md: the design's joint metrics plus what makes a row interpretable.
TABLE_COLUMNS: tuple[str, ...] = (
    "num_requests", "duration_s", *DEFAULT_TABLE_COLUMNS, "compiles_after_warmup",
    "padded_token_fraction")

# Sections whose keys are free-form keyword arguments, so an override may add a key.
_OPEN_SECTIONS = ("workload.params", "kv.codec_options", "kv.retention_options",
                  "kv.context_reuse_options", "spec.options", "engine.controller_options")

# A stuck engine (work queued, nothing schedulable) would otherwise spin forever.
_MAX_IDLE_STEPS = 1000

# One set of step programs per distinct static configuration for the whole process: its jitted
# step holds one program per step shape, so the runs of a sweep (and the scoring engines)
# compile each shape once. Programs hold only static configuration (their public attributes,
# the key here); the runner owns the KV state and passes the params to every call.
_SHARED_PROGRAMS: dict[tuple[Any, ...], Any] = {}


def _new_engine(model: Model, engine_config: EngineConfig, **kwargs: Any) -> Engine:
    engine = Engine(model, engine_config, **kwargs)
    programs = engine.runner.programs
    key = (type(programs), *sorted((k, repr(v)) for k, v in vars(programs).items()
                                   if not k.startswith("_")))
    engine.runner.programs = _SHARED_PROGRAMS.setdefault(key, programs)
    return engine


# ----------------------------------------------------------------------------- configs


def load_config(path: str | os.PathLike) -> ConfigDict:
    """Calls `get_config()` of the config file at `path` (what --config=path does)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"_kvjax_config_{path.stem}", path)
    if spec is None or not path.is_file():
        raise ValueError(f"no config file at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _parent_and_leaf(config: ConfigDict, field: str) -> tuple[ConfigDict, str]:
    *parents, leaf = field.split(".")
    node = config
    for i, part in enumerate(parents):
        if not isinstance(node, ConfigDict) or part not in node:
            raise ValueError(f"unknown config field {'.'.join(parents[:i + 1])!r} "
                             f"(in override {field!r})")
        node = node[part]
    if not isinstance(node, ConfigDict):
        raise ValueError(f"config field {'.'.join(parents)!r} is not a section "
                         f"(in override {field!r})")
    if leaf not in node and ".".join(parents) not in _OPEN_SECTIONS:
        raise ValueError(f"unknown config field {field!r}")
    return node, leaf


def _parse_value(text: str, kind: type | None) -> Any:
    """A command-line value as the type of the field it overrides."""
    text = text.strip()
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError
            return lowered in ("true", "1")
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is str:
            return text
        if text.lower() in ("none", "null"):
            return None
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if kind is None:
            return text
        raise ValueError(f"cannot read {text!r} as {kind.__name__}") from None


def parse_sweep(text: str, config: ConfigDict) -> list[dict[str, Any]]:
    """Parses --sweep: `field=v1,v2;field2=w1,w2` is the product of the axes, in order.

    Values take the type of the field they override (e.g. `engine.page_size=16,32` gives
    ints). Returns one {field: value} dict per variant.
    """
    axes = []
    for part in (p for p in text.split(";") if p.strip()):
        if "=" not in part:
            raise ValueError(f"sweep axis {part.strip()!r} needs the form field=v1,v2,...")
        field, values = (s.strip() for s in part.split("=", 1))
        parent, leaf = _parent_and_leaf(config, field)
        kind = parent.get_ref(leaf).get_type() if leaf in parent else None
        parsed = [_parse_value(v, kind) for v in values.split(",") if v.strip()]
        if not parsed:
            raise ValueError(f"sweep axis {field!r} has no values")
        axes.append([(field, v) for v in parsed])
    if not axes:
        raise ValueError(f"empty sweep {text!r}")
    return [dict(combo) for combo in itertools.product(*axes)]


def _variant_name(overrides: Mapping[str, Any]) -> str:
    return ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in overrides.items() if k != "name")


def apply_overrides(config: ConfigDict, overrides: Mapping[str, Any]) -> ConfigDict:
    """A copy of `config` with dotted-path `overrides` set (key "name" names the variant).

    Raises:
        ValueError: for an unknown field or a value of the wrong type.
    """
    config = copy.deepcopy(config)
    for field, value in overrides.items():
        parent, leaf = _parent_and_leaf(config, field)
        try:
            with parent.unlocked():
                parent[leaf] = value
        except TypeError as e:
            raise ValueError(f"override {field}={value!r}: {e}") from None
    if "name" not in overrides:
        config.name = _variant_name(overrides) or config.name
    return config


def check_supported(config: ConfigDict) -> None:
    """Raises ValueError for a config no run can honour (checked before anything loads)."""
    if config.kv.codec != "none" and importlib.util.find_spec("kvjax.kv.quantized") is None:
        raise ValueError(f"not yet supported: kv.codec={config.kv.codec!r} (the engine's "
                         f"quantized KV state, kvjax.kv.quantized, is not installed)")
    if config.quality.prompts not in ("first", "longest"):
        raise ValueError(f"quality.prompts must be 'first' or 'longest', got "
                         f"{config.quality.prompts!r}")
    if Clock(config.clock) is Clock.SIMULATED:
        for name, value in config.sim.items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"sim.{name} must be finite and >= 0, got {value!r}")


def retention_budget_from(config: ConfigDict) -> int | None:
    """`kv.budget` in tokens per sequence.

    A value in (0, 1) is a fraction of the context limit `engine.max_model_len`, floored to
    whole tokens (at least 1); a value >= 1 is a token count and must be whole.
    """
    budget, max_len = config.kv.budget, config.engine.max_model_len
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0:
        raise ValueError(f"kv.budget must be > 0 (tokens, or a fraction in (0, 1) of "
                         f"engine.max_model_len), got {budget!r}")
    if budget < 1:
        if max_len is None:
            raise ValueError(f"kv.budget={budget!r} is a fraction of engine.max_model_len, "
                             f"which is None; give tokens or set engine.max_model_len")
        return max(1, math.floor(budget * max_len))
    if not float(budget).is_integer():
        raise ValueError(f"kv.budget={budget!r} must be whole tokens when >= 1")
    return int(budget)


def tier_config_from(config: ConfigDict) -> TierConfig:
    """The `TierConfig` of a benchmark config's `tiers` section (None or 0 MiB host: off)."""
    t, f = config.tiers, config.tiers.fault_injection
    faults = FaultConfig(fail_fraction=f.transfer_failure_rate,
                         corrupt_fraction=f.corruption_rate, delay_fraction=f.delay_rate,
                         delay_polls=f.delay_polls, seed=f.seed)
    host_bytes = int((t.host_budget_mb or 0) * 2**20)
    if not host_bytes and (faults.enabled or t.disk_budget_mb):
        raise ValueError(f"tiers.fault_injection and tiers.disk_budget_mb need a host tier "
                         f"(tiers.host_budget_mb > 0), got host_budget_mb={t.host_budget_mb!r}")
    return TierConfig(
        host_bytes=host_bytes, disk_bytes=int((t.disk_budget_mb or 0) * 2**20),
        disk_dir=t.disk_dir, transfer_layout=t.transfer_layout,
        max_chunk_pages=t.max_chunk_pages, timeout_polls=t.timeout_polls,
        max_inflight_loads=t.max_inflight_loads,
        swap_bandwidth_bytes_per_s=t.swap_bandwidth_bytes_per_s,
        recompute_tokens_per_s=t.recompute_tokens_per_s, faults=faults)


def engine_config_from(config: ConfigDict) -> EngineConfig:
    """The `EngineConfig` of a benchmark config's `engine`, `kv` and `tiers` sections.

    Raises:
        ValueError: for an invalid value, or a combination `kvjax.engine.compat` refuses
            (e.g. a retention policy on the contiguous layout).
    """
    e = config.engine
    budget = None if e.kv_budget_mb is None else int(e.kv_budget_mb * 2**20)
    return EngineConfig(
        kv_layout=e.kv_layout, page_size=e.page_size, kv_budget_bytes=budget,
        num_pages=e.num_pages, kv_dtype=e.kv_dtype, kv_codec=config.kv.codec,
        kv_codec_options=config.kv.codec_options.to_dict(), max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens, max_prefill_chunk=e.max_prefill_chunk,
        max_prefill_seqs=e.max_prefill_seqs, max_model_len=e.max_model_len,
        enable_prefix_cache=e.enable_prefix_cache,
        prefix_cache_eviction=e.prefix_cache_eviction,
        max_tenant_page_share=e.max_tenant_page_share,
        contended_prefill_chunk=e.contended_prefill_chunk,
        contention_window_s=e.contention_window_s,
        hide_shared_prefix_hits=e.hide_shared_prefix_hits,
        scheduler_policy=e.scheduler_policy,
        preemption_mode=e.preemption_mode, watermark=e.watermark,
        scrub_freed_pages=e.scrub_freed_pages, attention_impl=e.attention_impl,
        matmul_impl=e.matmul_impl,
        min_chunk_bucket=e.min_chunk_bucket, chunk_bucket_factor=e.chunk_bucket_factor,
        prefill_padding_limit=e.prefill_padding_limit, tiers=tier_config_from(config),
        retention=config.kv.retention, retention_budget=retention_budget_from(config),
        retention_options=config.kv.retention_options.to_dict(),
        context_reuse=config.kv.context_reuse,
        context_reuse_options=config.kv.context_reuse_options.to_dict(),
        spec=SpecConfig(config.spec.method, config.spec.num_draft_tokens,
                        config.spec.options.to_dict(), adaptive=config.spec.adaptive),
        trace=config.trace, controller=e.controller,
        controller_options=e.controller_options.to_dict(),
        slo=SLO(config.slo.ttft_s, config.slo.tpot_s, config.slo.kl_budget))


# ----------------------------------------------------------------------------- workloads


def _split(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights`, by largest remainder."""
    shares = np.asarray(weights, np.float64) / np.sum(weights) * total  # [num_tenants]
    counts = np.floor(shares).astype(int)
    for i in np.argsort(counts - shares)[:total - counts.sum()]:
        counts[i] += 1
    return counts.tolist()


def build_workload(config: ConfigDict, tokenizer: Tokenizer) -> list[BenchRequest]:
    """The config's workload, sorted by arrival.

    With `workload.tenant_weights` (w_0, ..), tenant t ("tenant-t") gets its own copy of the
    generator with num_requests and any `rate` scaled by w_t / sum(w) and its own seed; the
    copies are merged (superposed Poisson processes stay Poisson). `tenant_priorities` gives
    each tenant's requests a priority, and `tenant_slos` ((ttft_s, tpot_s, kl_budget) per
    tenant) each tenant's requests an SLO; both also apply, by tenant name, to a generator
    that names tenants "tenant-t" itself (multi_tenant_burst).
    """
    w = config.workload
    params = w.params.to_dict()
    weights, priorities = tuple(w.tenant_weights), tuple(w.tenant_priorities)
    slos = [SLO(*s) for s in w.get("tenant_slos", ())]
    if not weights:
        return _per_tenant(make_workload(w.name, tokenizer, seed=w.seed,
                                         num_requests=w.num_requests, **params),
                           priorities, slos)
    if any(not x > 0 for x in weights):
        raise ValueError(f"workload.tenant_weights must be > 0, got {weights}")
    if priorities and len(priorities) != len(weights):
        raise ValueError(f"workload.tenant_priorities {priorities} needs one entry per tenant "
                         f"({len(weights)})")
    requests = []
    for t, count in enumerate(_split(w.num_requests, weights)):
        if count == 0:
            continue
        mine = dict(params)
        if "rate" in mine:
            mine["rate"] = mine["rate"] * weights[t] / sum(weights)
        seed = int(np.random.SeedSequence([w.seed, t]).generate_state(1)[0])
        for r in make_workload(w.name, tokenizer, seed=seed, num_requests=count, **mine):
            requests.append(dataclasses.replace(
                r, request_id=f"tenant-{t}/{r.request_id}", tenant=f"tenant-{t}"))
    return sorted(_per_tenant(requests, priorities, slos),
                  key=lambda r: (r.arrival_time, r.request_id))


def _per_tenant(requests: list[BenchRequest], priorities: Sequence[int],
                slos: Sequence[SLO]) -> list[BenchRequest]:
    """Requests of tenant "tenant-t" with priorities[t] and slos[t] (where given)."""
    if not priorities and not slos:
        return requests
    out = []
    for r in requests:
        match = re.fullmatch(r"tenant-(\d+)", r.tenant or "")
        t = int(match[1]) if match else None
        for name, table in (("priorities", priorities), ("slos", slos)):
            if table and (t is None or t >= len(table)):
                raise ValueError(f"workload.tenant_{name} has no entry for request "
                                 f"{r.request_id!r} of tenant {r.tenant!r}")
        out.append(dataclasses.replace(
            r, priority=priorities[t] if priorities else r.priority,
            slo=slos[t] if slos else r.slo))
    return out


# ----------------------------------------------------------------------------- clocks


class _WallClock:
    """Seconds since `reset()` on time.perf_counter."""

    def __init__(self):
        self.origin = time.perf_counter()

    def reset(self) -> None:
        self.origin = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.origin

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self()))


class _VirtualClock:
    """A clock that moves only when told to."""

    def __init__(self):
        self.now = 0.0

    def reset(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wait_until(self, t: float) -> None:
        self.now = max(self.now, t)


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """Seconds one step takes on the simulated clock (see the module docstring)."""

    step_overhead_s: float
    per_token_s: float
    per_context_token_s: float
    host_bytes_per_s: float

    def step_seconds(self, num_padded_tokens: int, num_context_tokens: int,
                     host_bytes: int) -> float:
        host = host_bytes / self.host_bytes_per_s if host_bytes else 0.0
        return (self.step_overhead_s + self.per_token_s * num_padded_tokens
                + self.per_context_token_s * num_context_tokens + host)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step: when it ended, its token layout and how long it took (seconds)."""

    time_s: float
    num_tokens: int
    num_padded_tokens: int
    num_context_tokens: int
    duration_s: float


def fit_step_cost(steps: Sequence[StepRecord]) -> dict[str, float] | None:
    """Non-negative least-squares fit of duration = overhead + per_token * T + per_context * S.

    Feed it a real-clock run's steps to calibrate the simulated clock. Every subset of the
    three terms is fitted and the best fit with no negative coefficient wins (a negative cost
    would let the simulated clock run backwards). None with fewer than three steps.
    """
    if len(steps) < 3:
        return None
    a = np.array([[1.0, s.num_padded_tokens, s.num_context_tokens] for s in steps])  # [n, 3]
    b = np.array([s.duration_s for s in steps])  # [n]
    best, best_error = np.zeros(3), float(np.sum(b * b))
    for size in (1, 2, 3):
        for columns in itertools.combinations(range(3), size):
            coef = np.linalg.lstsq(a[:, columns], b, rcond=None)[0]
            error = float(np.sum((a[:, columns] @ coef - b) ** 2))
            if np.all(coef >= 0) and error < best_error:
                best, best_error = np.zeros(3), error
                best[list(columns)] = coef
    return dict(step_overhead_s=float(best[0]), per_token_s=float(best[1]),
                per_context_token_s=float(best[2]))


# ----------------------------------------------------------------------------- step meter


@dataclasses.dataclass(frozen=True)
class _ModelCosts:
    """Per-token and per-step costs of one model under one engine."""

    matmul_params: int  # parameters of the layer stack's matmuls
    head_params: int  # H * V, the output projection
    weight_bytes: int  # bytes of weights every step reads
    attention_flops_per_pair: int  # 4 * L * N * D
    kv_bytes_per_token: int

    @classmethod
    def of(cls, engine: Engine) -> _ModelCosts:
        c, params = engine.model.config, engine.model.params
        layers = jax.tree.leaves(params["layers"])
        head = params.get("lm_head", params["embed"])
        return cls(
            matmul_params=sum(x.size for x in layers if x.ndim == 3),
            head_params=c.hidden_size * c.vocab_size,
            weight_bytes=sum(x.nbytes for x in layers) + params["final_norm"].nbytes
            + head.nbytes,
            attention_flops_per_pair=4 * c.num_layers * c.num_heads * c.head_dim,
            kv_bytes_per_token=int(engine.kv_bytes_per_token))


def host_link_bytes(engine: Engine) -> int:
    """KV bytes moved between device and host so far, both ways (`Engine.kv_bytes_moved`)."""
    return engine.kv_bytes_moved()["host"]


def disk_bytes(engine: Engine) -> int:
    """KV bytes written to and read from the disk tier so far (0 without one)."""
    return engine.kv_bytes_moved()["disk"]


class _StepMeter(StepObserver):
    """Tallies each step from its token layout (query and KV lengths per row) and each page
    copy, and advances a virtual clock by the cost model's estimate of the step."""

    def __init__(self, engine: Engine, cost_model: StepCostModel | None,
                 clock: _VirtualClock | None):
        self._engine = engine
        self._costs = _ModelCosts.of(engine)
        self._cost_model = cost_model
        self._clock = clock
        self._host_bytes_seen = host_link_bytes(engine)
        self.flops = 0
        self.device_bytes = 0
        self.step_tokens = 0  # token slots computed, padding included
        self.padded_tokens = 0
        self.last_layout: tuple[int, int, int] | None = None  # (tokens, padded, context)
        self.last_cost_s = 0.0

    def before_step(self, shape: StepShape, host_input: dict[str, np.ndarray]) -> None:
        q_lens = host_input["q_lens"].astype(np.int64)  # [R]
        kv_lens = host_input["kv_lens"].astype(np.int64)  # [R]
        policy = self._engine.retention.policy
        if policy.narrows_reads:  # quest: a decode query reads only its chosen pages
            page_size = self._engine.config.page_size
            kv_lens = np.where(q_lens == 1,
                               np.minimum(kv_lens, policy.budget // page_size * page_size),
                               kv_lens)  # [R]
        num_tokens, context = int(q_lens.sum()), int(kv_lens.sum())
        pairs = int(np.sum(q_lens * kv_lens - q_lens * (q_lens - 1) // 2))
        c = self._costs
        self.flops += (2 * c.matmul_params * shape.num_tokens + 2 * c.head_params * shape.num_rows
                       + c.attention_flops_per_pair * pairs)
        self.device_bytes += c.weight_bytes + c.kv_bytes_per_token * (num_tokens + context)
        self.last_layout = (num_tokens, shape.num_tokens, context)
        self.step_tokens += shape.num_tokens
        self.padded_tokens += shape.num_tokens - num_tokens
        if self._clock is not None:
            moved = host_link_bytes(self._engine)
            swapped, self._host_bytes_seen = moved - self._host_bytes_seen, moved
            self.last_cost_s = self._cost_model.step_seconds(shape.num_tokens, context, swapped)
            self._clock.now += self.last_cost_s

    def on_kv_op(self, op: KVOp) -> None:
        if op.kind is KVOpKind.COPY:
            self.device_bytes += 2 * len(set(op.pages)) * self._engine.kv_bytes_per_page


# ----------------------------------------------------------------------------- scoring


class _Scorer:
    """An engine that runs a whole sequence as one prefill chunk, for teacher forcing."""

    def __init__(self, engine_config: EngineConfig, model: Model, max_len: int):
        bucket = next_power_of_2(max(max_len, engine_config.page_size, 2))
        config = dataclasses.replace(
            engine_config, max_num_seqs=1, max_prefill_seqs=1, max_prefill_chunk=bucket,
            min_chunk_bucket=bucket, max_num_batched_tokens=bucket, max_model_len=2 * bucket,
            enable_prefix_cache=False, kv_budget_bytes=None, num_pages=None,
            scheduler_policy="fcfs", tiers=TierConfig())
        self.engine = _new_engine(model, config)
        self._ids = itertools.count()

    def generate(self, prompt: Sequence[int], num_tokens: int) -> list[int]:
        """Greedy continuation of `num_tokens` tokens (EOS ignored)."""
        (out,) = self.engine.generate(
            [list(prompt)], SamplingParams(max_new_tokens=num_tokens, ignore_eos=True))
        if out.error:
            raise ValueError(f"cannot score this prompt: {out.error}")
        return out.outputs[0].token_ids

    def score(self, token_ids: Sequence[int], first_row: int = 0) -> np.ndarray:
        """[len - 1 - first_row, V] float64 log-probabilities; row i predicts token
        first_row + i + 1."""
        if len(token_ids) < 2:
            raise ValueError(f"scoring needs at least 2 tokens, got {len(token_ids)}")
        engine = self.engine
        engine.add_request(f"score-{next(self._ids)}", list(token_ids),
                           SamplingParams(max_new_tokens=1, ignore_eos=True))
        engine.step(logits_mode=LogitsMode.ALL)
        if engine.has_unfinished():
            raise RuntimeError("the scoring prefill did not fit one step")
        # One prefill row and no decode rows: its tokens are rows 0 .. len-1 of [T, V]. Only
        # the rows asked for leave the device (a long prompt's [T, V] is large).
        logits = np.asarray(engine.last_logits[first_row:len(token_ids) - 1],
                            np.float64)  # [n, V]
        shifted = logits - logits.max(axis=-1, keepdims=True)  # [n, V]
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # [n, V]


class _LogitsTap(StepObserver):
    """Keeps each step's logits of an engine's one real row.

    For a single sequence, every step from the one that finishes its prefill on samples one
    output token, so the last n rows kept are the distributions of its n output tokens.
    """

    def __init__(self, engine: Engine):
        self.rows: list[np.ndarray] = []
        engine.add_step_observer(self)

    def after_step(self, shape: StepShape, host_input: dict[str, np.ndarray], out) -> None:
        (row,) = np.flatnonzero(host_input["q_lens"])
        self.rows.append(np.asarray(out.logits[row], np.float64))  # [V]


def _generate_with_logits(engine_config: EngineConfig, model: Model, prompt: Sequence[int],
                          num_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens of one sequence served alone under `engine_config` (its chunking,
    codec and retention), with the [num_tokens, V] logits each was chosen from."""
    config = dataclasses.replace(engine_config, max_num_seqs=1, kv_budget_bytes=None,
                                 num_pages=None, enable_prefix_cache=False,
                                 tiers=TierConfig())
    engine = _new_engine(model, config)
    tap = _LogitsTap(engine)
    engine.add_request("quality", list(prompt),
                       SamplingParams(max_new_tokens=num_tokens, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step(logits_mode=LogitsMode.LAST)
    (out,) = outputs
    if out.error:
        raise ValueError(f"cannot score this prompt: {out.error}")
    return out.outputs[0].token_ids, np.stack(tap.rows[-num_tokens:])


def score_tokens(engine_config: EngineConfig, model: Model, token_ids: Sequence[int]
                 ) -> np.ndarray:
    """Teacher-forced next-token log-probabilities of `token_ids` under an engine config.

    The whole sequence runs as one prefill (K/V written through the config's KV layout and
    codec, then read back by attention), so quantized or lower-precision KV shows in the
    result. Returns [len - 1, V] float64; row i is the distribution of token i + 1.
    """
    return _Scorer(engine_config, model, len(token_ids)).score(token_ids)


def _is_exact(engine_config: EngineConfig, model: Model) -> bool:
    return engine_config.kv_codec == "none" and engine_config.retention == "none" and (
        engine_config.kv_dtype is None or resolve_dtype(engine_config.kv_dtype) == model.dtype)


def measure_quality(config: ConfigDict, engine_config: EngineConfig, model: Model,
             requests: Sequence[BenchRequest]) -> dict[str, float] | None:
    q = config.quality
    if not q.enabled or _is_exact(engine_config, model) or make_controller(
            engine_config.controller, **engine_config.controller_options).manages_retention:
        return None  # (a controller's quality cost is each request's kl_spent)
    ranked = sorted(requests, key=lambda r: -len(r.prompt_ids)) \
        if q.prompts == "longest" else requests
    prompts = [r.prompt_ids for r in ranked[:q.num_prompts]]
    if not prompts:
        return None
    max_len = max(len(p) for p in prompts) + q.num_tokens
    exact_config = dataclasses.replace(engine_config, kv_codec="none", kv_codec_options={},
                                       kv_dtype=None, retention="none", retention_budget=None,
                                       retention_options={})
    exact = _Scorer(exact_config, model, max_len)
    refs, tests = [], []
    if engine_config.retention == "none":
        variant = _Scorer(engine_config, model, max_len)
        for prompt in prompts:
            sequence = list(prompt) + exact.generate(prompt, q.num_tokens)
            first = len(prompt) - 1  # the rows from here on predict the continuation
            refs.append(exact.score(sequence, first))
            tests.append(variant.score(sequence, first))
        return quality_stats(np.concatenate(refs), np.concatenate(tests))
    # Retention acts between steps (evicting, or narrowing decode reads), so one
    # teacher-forced prefill would not see it: the variant decodes step by step, and exact
    # KV scores the same tokens.
    for prompt in prompts:
        tokens, logits = _generate_with_logits(engine_config, model, prompt, q.num_tokens)
        refs.append(exact.score(list(prompt) + tokens, len(prompt) - 1))
        tests.append(logits)
    return quality_stats(np.concatenate(refs), np.concatenate(tests))


# ----------------------------------------------------------------------------- runs


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """One run: the metrics dict and the timelines behind it (for plots and re-analysis).

    Attributes:
        metrics: `compute_metrics`'s dict (keys `METRIC_KEYS`).
        records: one per request sample (a request with n samples gives n records).
        kv_samples: (time, live KV bytes, reserved KV bytes) after each step.
        steps: one `StepRecord` per engine step that ran the model.
        trace: the KV-semantic trace (Trace Event Format JSON) with config.trace, else None.
    """

    metrics: dict[str, Any]
    records: list[RequestRecord]
    kv_samples: list[tuple[float, int, int]]
    steps: list[StepRecord]
    trace: dict | None = None


def environment() -> dict[str, Any]:
    """Software and hardware the run used."""
    device = jax.devices()[0]
    return dict(jax=jax.__version__, backend=jax.default_backend(),
                device_kind=device.device_kind, num_devices=jax.device_count(),
                cpu=cpu_kernels.cpu_model(), cpu_count=os.cpu_count(),
                python=platform.python_version(),
                platform=platform.platform())


def _is_correct(request: BenchRequest, token_ids: Sequence[int],
                tokenizer: Tokenizer | None) -> bool | None:
    """Whether a retrieval probe's decoded output holds its answer; None for other requests
    (or a tokenizer that cannot decode)."""
    if request.answer is None or not hasattr(tokenizer, "decode"):
        return None
    return request.answer in tokenizer.decode(list(token_ids))


def _records(out: RequestOutput, request: BenchRequest,
             tokenizer: Tokenizer | None = None) -> list[RequestRecord]:
    """Sample 0 carries the engine's per-token times; other samples share its first token
    time (they are forked together) and are judged from their finish time."""
    return [RequestRecord(
        request_id=out.request_id if len(out.outputs) == 1 else f"{out.request_id}#{c.index}",
        tenant=request.tenant, arrival_time=out.arrival_time,
        first_token_time=out.first_token_time if c.token_ids else None,
        token_times=list(out.token_times) if c.index == 0 else [],
        finish_time=out.finish_time, num_prompt_tokens=len(out.prompt_ids),
        num_output_tokens=len(c.token_ids), error=None,
        num_cached_prompt_tokens=out.num_cached_prompt_tokens,
        is_correct=_is_correct(request, c.token_ids, tokenizer),
        slo_ttft_s=None if request.slo is None else request.slo.ttft_s,
        slo_tpot_s=None if request.slo is None else request.slo.tpot_s,
        kl_spent=out.kl_spent) for c in out.outputs]


def _failed_record(request: BenchRequest, error: str) -> RequestRecord:
    return RequestRecord(
        request_id=request.request_id, tenant=request.tenant,
        arrival_time=request.arrival_time, first_token_time=None, token_times=[],
        finish_time=request.arrival_time, num_prompt_tokens=len(request.prompt_ids),
        num_output_tokens=0, error=error)


def _echo(config: ConfigDict) -> dict[str, Any]:
    echoed = config.to_dict()
    echoed.pop("sweep", None)
    return echoed


def _serve(engine: Engine, meter: _StepMeter, clock: _WallClock | _VirtualClock,
           requests: Sequence[BenchRequest], sampling: dict[str, Any], *, name: str,
           progress: bool, tokenizer: Tokenizer | None = None
           ) -> tuple[list[RequestRecord], list[StepRecord]]:
    """Replays `requests` on `clock` until every one has finished or failed."""
    by_id = {r.request_id: r for r in requests}
    records: list[RequestRecord] = []
    steps: list[StepRecord] = []
    pending = collections.deque(requests)
    bar = tqdm(total=len(requests), desc=name, unit="req", disable=not progress)
    idle_steps = 0
    clock.reset()
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_time <= clock():
            r = pending.popleft()
            prompt = r.segments() if r.reuse_spans else r.prompt_ids
            try:
                engine.add_request(r.request_id, prompt, SamplingParams(
                    max_new_tokens=r.max_new_tokens, n=r.n, **sampling), tenant=r.tenant,
                    priority=r.priority, arrival_time=r.arrival_time, slo=r.slo)
            except ValueError as e:
                records.append(_failed_record(r, str(e)))
                bar.update()
        if not engine.has_unfinished():
            if pending:
                clock.wait_until(pending[0].arrival_time)
            continue
        steps_before, step_time_before = engine.stats["steps"], engine.stats["step_time_s"]
        finished = engine.step()
        if engine.stats["steps"] == steps_before:  # only scheduling (e.g. a preemption)
            idle_steps += 1
            if idle_steps > _MAX_IDLE_STEPS:
                raise RuntimeError(f"the engine made no progress in {_MAX_IDLE_STEPS} steps")
        else:
            idle_steps = 0
            tokens, padded, context = meter.last_layout
            duration = (meter.last_cost_s if isinstance(clock, _VirtualClock)
                        else engine.stats["step_time_s"] - step_time_before)
            steps.append(StepRecord(clock(), tokens, padded, context, duration))
        for out in finished:
            records.extend(_records(out, by_id[out.request_id], tokenizer))
            bar.update()
    bar.close()
    return records, steps


def run_benchmark_detailed(config: ConfigDict, *, model: Model | None = None,
                           tokenizer: Tokenizer | None = None,
                           requests: Sequence[BenchRequest] | None = None,
                           progress: bool = False) -> BenchResult:
    """Runs one benchmark config; see the module docstring.

    Args:
        config: a benchmark config (schema: configs/serve_default.py).
        model: a loaded model; None loads `config.model`.
        tokenizer: builds the workload's prompts; None uses the model's.
        requests: the workload to replay; None builds `config.workload`.
        progress: show a tqdm bar of requests done.
    """
    check_supported(config)
    clock_mode = Clock(config.clock)
    engine_config = engine_config_from(config)
    profile = get_profile(config.energy_profile)
    if model is None:
        model = load_model(config.model.name, dtype=config.model.dtype)
    tokenizer = tokenizer if tokenizer is not None else model.tokenizer
    if requests is None:
        if tokenizer is None:
            raise ValueError(f"model {model.config.name!r} has no tokenizer; pass tokenizer=")
        requests = build_workload(config, tokenizer)
    requests = sorted(requests, key=lambda r: r.arrival_time)

    if clock_mode is Clock.SIMULATED:
        clock, cost_model = _VirtualClock(), StepCostModel(**config.sim.to_dict())
        # The virtual clock advances as steps are dispatched; a token read one step later
        # would carry the next step's cost. The engine's rate estimates (swap or recompute,
        # a controller's costs) are the clock's own unless configured, not measured wall
        # time, so a run replays the same way on any host.
        tiers = engine_config.tiers
        engine_config = dataclasses.replace(
            engine_config, async_scheduling=False, tiers=dataclasses.replace(
                tiers, swap_bandwidth_bytes_per_s=tiers.swap_bandwidth_bytes_per_s
                or cost_model.host_bytes_per_s or None,
                recompute_tokens_per_s=tiers.recompute_tokens_per_s
                or (1 / cost_model.per_token_s if cost_model.per_token_s else None)))
    else:
        clock, cost_model = _WallClock(), None
    engine = _new_engine(model, engine_config, clock=clock)
    compiles = engine.warmup()
    meter = _StepMeter(engine, cost_model, clock if cost_model is not None else None)
    engine.add_step_observer(meter)
    sampling = dict(temperature=float(config.sampling.temperature), ignore_eos=True)
    records, steps = _serve(engine, meter, clock, requests, sampling, name=config.name,
                            progress=progress, tokenizer=tokenizer)
    # Every request failing at t=0 on the virtual clock leaves no time to divide by.
    duration_s = max(clock(), math.ulp(1.0))

    prefix = engine.prefix_cache_stats()
    counters = dict(
        # Pages a tier loads back continue the device's hash chain hit: reuse all the same.
        prefix_hit_tokens=prefix["prefix_hit_tokens"] + engine.stats["tier_hit_tokens"],
        prefix_query_tokens=prefix["prefix_query_tokens"],
        preemptions=engine.stats["preemptions"], bytes_moved_device=meter.device_bytes,
        bytes_moved_host=host_link_bytes(engine), bytes_moved_disk=disk_bytes(engine),
        compiles_after_warmup=engine.num_compiles - compiles, flops=meter.flops,
        step_tokens=meter.step_tokens, padded_tokens=meter.padded_tokens,
        **{k: engine.stats[k] for k in ("spec_proposed", "spec_accepted", "spec_verify_rows",
                                        "spec_draft_steps", "prefill_tokens", "chunk_hits",
                                        "chunk_fills", "chunk_reused_tokens",
                                        "blend_tokens")})
    metrics = compute_metrics(
        records, slo_ttft_s=float(config.slo.ttft_s), slo_tpot_s=float(config.slo.tpot_s),
        duration_s=duration_s, kv_samples=engine.kv_samples, counters=counters,
        quality=measure_quality(config, engine_config, model, requests), energy=profile,
        config=_echo(config), env=environment(), clock=clock_mode)
    trace = engine.tracer.to_chrome() if engine.tracer.enabled else None
    return BenchResult(metrics=metrics, records=records, kv_samples=list(engine.kv_samples),
                       steps=steps, trace=trace)


def run_benchmark(config: ConfigDict, **kwargs: Any) -> dict[str, Any]:
    """`run_benchmark_detailed(config, **kwargs).metrics`: all `METRIC_KEYS`."""
    return run_benchmark_detailed(config, **kwargs).metrics


def run_sweep_detailed(config: ConfigDict, overrides_list: Sequence[Mapping[str, Any]], *,
                       model: Model | None = None, **kwargs: Any) -> list[BenchResult]:
    """Runs `config` once per override set (see `apply_overrides`), in order.

    Variants that share `model.name` and `model.dtype` share one loaded model. Other
    keyword arguments go to `run_benchmark_detailed`.
    """
    variants = [apply_overrides(config, o) for o in overrides_list]
    names = [v.name for v in variants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"sweep variants need distinct names, got {duplicates} twice")
    models: dict[tuple[str, str], Model] = {}
    results = []
    for variant in variants:
        key = (variant.model.name, variant.model.dtype)
        if model is None and key not in models:
            models[key] = load_model(variant.model.name, dtype=variant.model.dtype)
        results.append(run_benchmark_detailed(
            variant, model=model if model is not None else models[key], **kwargs))
    return results


def run_sweep(config: ConfigDict, overrides_list: Sequence[Mapping[str, Any]],
              **kwargs: Any) -> list[dict[str, Any]]:
    """One metrics dict per override set; see `run_sweep_detailed`."""
    return [r.metrics for r in run_sweep_detailed(config, overrides_list, **kwargs)]


# ----------------------------------------------------------------------------- outputs


def _strict_json(value: Any) -> Any:
    """`value` with non-finite floats as the strings "inf", "-inf", "nan" (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(v) for v in value]
    return value


def _dump(value: Any, **kwargs: Any) -> str:
    return json.dumps(_strict_json(value), allow_nan=False, **kwargs) + "\n"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name).strip("_") or "run"


def write_results(results: Sequence[BenchResult], workdir: str | os.PathLike, *,
                  command: str | None = None, plots: bool = True) -> list[Path]:
    """Writes <run>.json (metrics), <run>.details.json, results.md and PNG plots.

    JSON is strict: non-finite numbers are written as the strings "inf", "-inf" or "nan".

    Returns the paths written, results.md first.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = [workdir / "results.md"]
    for result in results:
        slug = _slug(result.metrics["config"]["name"])
        metrics_path, details_path = workdir / f"{slug}.json", workdir / f"{slug}.details.json"
        metrics_path.write_text(_dump(result.metrics, indent=2))
        details = dict(
            records=[dataclasses.asdict(r) for r in result.records],
            kv_samples=result.kv_samples, steps=[dataclasses.asdict(s) for s in result.steps],
            step_cost_fit=fit_step_cost(result.steps))
        details_path.write_text(_dump(details))
        paths += [metrics_path, details_path]
        if result.trace is not None:
            paths.append(workdir / f"{slug}.trace.json")
            paths[-1].write_text(json.dumps(result.trace))
    runs = [r.metrics for r in results]
    lines = ["# serve_bench results", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [format_table(runs, TABLE_COLUMNS), ""]
    tenants = sorted({t for run in runs if run["fairness"] for t in run["fairness"]["per_tenant"]})
    if tenants:
        lines += ["Per-tenant TTFT p99 (s):", "", format_table(
            runs, [f"fairness.per_tenant.{t}.ttft_p99_s" for t in tenants]), ""]
    lines += [f"Clock: {runs[0]['clock']}. Energy is an estimate from FLOPs and bytes moved "
              f"(profile {runs[0]['config']['energy_profile']!r}); bytes are in bytes, times "
              f"in seconds.", ""]
    paths[0].write_text("\n".join(lines))
    if plots:
        from kvjax.bench import plots as plots_lib  # matplotlib loads only when plotting.

        paths += plots_lib.write_plots(results, workdir)
    return paths
