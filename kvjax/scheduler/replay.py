"""Decision replay: record what a scheduler was asked and decided, and decide it again.

The scheduler is host code whose inputs are few and plain: the requests the engine adds (and
aborts, pauses, resumes), the `RunnerOutput` of each step, and its clock. A `DecisionRecorder`
attached to a live engine's scheduler records each of those calls as an event, with what the
call returned (the step's `SchedulerOutput`, KV operations included) and the clock readings
it took. `replay` builds a fresh `Scheduler` from the trace's `SchedulerRecipe` (no model, no
runner, no device array: this module imports no jax), feeds it the same calls, and checks
that it decides the same, step by step:

    recorder = engine.record_decisions()       # before the engine's first step
    engine.generate(prompts, sampling)
    recorder.stop().save("run.trace")
    ...
    trace = DecisionTrace.load("run.trace")
    replay(trace)                              # raises ReplayMismatch at the first difference

To try a policy change, replay a trace into a scheduler built with the change
(`build_scheduler(dataclasses.replace(trace.recipe, policy="priority"), ...)`, or one made by
hand) with `counterfactual=True`: each sampled token is then taken from the recording by
sequence and token index (what a seeded or greedy request samples does not depend on which
step or batch computes it), requests arrive before the same step as they did, and the run
goes on until every request finishes. The new decisions come back for comparison.

Limits: KV operations of the kinds `kvjax.memory.ops.DATA_KINDS` (copy-on-write copies, scrubs,
window copies, retention compactions, chunk loads, swaps to host slots and back) are plain
data and replay as such, so runs under an evicting retention policy, context reuse or swap
preemption replay (not those whose retention policy rotates kept keys or reads RoPE: the host
record is built without a model). Tier traffic is data too (`TIER_KINDS`): a run with a host
tier replays, its ledger fed the transfers that landed from the recorded `RunnerOutput`s (a
disk tier's transfers finish on its workers' time, which a trace does not hold: not recorded).
A KIVI run replays too, its windows' copies, scrubs and swaps (through the tiers as well) being
data. Ops that still run a device program when issued (scatters from outside) do not replay
(`ReplayDevice` raises a ValueError naming the op's kind). Warm-up records (`KVOpKind.WARMUP`) are
compilations, not decisions, and are left out of the comparison. Snapshot restores are not
recorded, nor requests under a grammar (a ValueError names the request). `Engine.record_decisions`
refuses, with the reason from `kvjax.engine.compat`, what a replay could not decide again: tiers,
policies that need the model's RoPE, host pools, snapshots and page imports (disaggregation).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvjax.kv.retention_host import RetentionManager, make_retention
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.memory.ops import DATA_KINDS, KVOp, KVOpKind
from kvjax.memory.tiers import PlannedTierPort, TieredSwapSpace, TierManager
from kvjax.scheduler.context import make_strategy
from kvjax.scheduler.controller import make_controller
from kvjax.scheduler.output import RunnerOutput, SchedulerOutput
from kvjax.scheduler.policies import make_policy
from kvjax.scheduler.request import RequestOutput
from kvjax.scheduler.scheduler import Scheduler, SchedulerConfig
from kvjax.scheduler.spec import make_drafter

# The scheduler's entry points a recorder records (calls the engine makes into it).
ENTRY_POINTS = ("add_request", "abort", "pause", "resume", "force_last_token",
                "on_weights_update", "schedule", "update_from_output", "receive_tier_landed")


@dataclasses.dataclass(frozen=True)
class SchedulerRecipe:
    """How to build a scheduler like a recorded one, as plain data.

    Attributes:
      config: its `SchedulerConfig`.
      allocator: a copy of its KV cache manager's allocator when recording began (host
        metadata only: block tables, free list, prefix cache).
      policy: the scheduling policy's registered name (`kvjax.scheduler.policies`).
      retention, retention_budget, retention_options: the retention policy
        (`kvjax.kv.retention_host.make_retention`).
      drafter, drafter_options: the speculative drafter (`kvjax.scheduler.spec`).
      controller, controller_options: the KV controller (`kvjax.scheduler.controller`).
      context_reuse, context_reuse_options: the context-reuse strategy
        (`kvjax.scheduler.context`).
      watermark, scrub_freed_pages: as in EngineConfig.
      weights_version: the weights version the scheduler started with.
      cache_keys: (tenant, weights version) -> the provenance fingerprint the engine gave
        pages of that tenant and version.
      tiers: the host tier's `TierConfig` (no disk tier), or None without tiers.
      tier_pages: with tiers, (page shapes, page dtypes, memory kind) of the pool's pages
        (`PlannedTierPort`): what the tiers' ledger sizes and stages pages by.
      keeps_windows: whether sequences hold state beside their pages (KIVI windows): their
        slots are copied, scrubbed and swapped with them.
      quantized_lens: KIVI: of a sequence's first n tokens, how many its pages hold, by n
        (`WindowFloors.quantized_lens`); None without a window.
    """

    config: SchedulerConfig
    allocator: Any
    policy: str = "fcfs"
    retention: str = "none"
    retention_budget: int | None = None
    retention_options: dict = dataclasses.field(default_factory=dict)
    drafter: str = "none"
    drafter_options: dict = dataclasses.field(default_factory=dict)
    controller: str = "fixed"
    controller_options: dict = dataclasses.field(default_factory=dict)
    context_reuse: str = "full"
    context_reuse_options: dict = dataclasses.field(default_factory=dict)
    watermark: float = 0.01
    scrub_freed_pages: bool = False
    weights_version: str = ""
    cache_keys: dict = dataclasses.field(default_factory=dict)
    tiers: Any = None
    tier_pages: tuple = ()
    keeps_windows: bool = False
    quantized_lens: tuple[int, ...] | None = None


@dataclasses.dataclass
class Event:
    """One call into the scheduler.

    Attributes:
      name: the entry point (`ENTRY_POINTS`).
      args, kwargs: its arguments as they were on entry (update_from_output's first argument
        is the index of the `schedule` event whose output it commits; a RunnerOutput's
        device logits are dropped).
      result: what it returned (schedule: the SchedulerOutput; update_from_output: the KV
        operations it planned); None for the others.
      error: the type name of the exception it raised, or None.
      clock: the clock readings the scheduler and its allocator took during the call.
      step_time_s: the engine's measured step time when the call began (the AUTO preemption
        cost model reads it).
    """

    name: str
    args: tuple
    kwargs: dict
    result: Any = None
    error: str | None = None
    clock: tuple[float, ...] = ()
    step_time_s: float = 0.0


@dataclasses.dataclass
class DecisionTrace:
    """A recorded run: how to build its scheduler, and every call it took, in order."""

    recipe: SchedulerRecipe
    events: list[Event] = dataclasses.field(default_factory=list)

    @property
    def outputs(self) -> list[SchedulerOutput]:
        """The recorded SchedulerOutputs, one per step formed."""
        return [e.result for e in self.events if e.name == "schedule"]

    def save(self, path) -> None:
        """Writes the trace (a pickle of plain dataclasses, numpy arrays and builtins)."""
        with open(path, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load(path) -> DecisionTrace:
        """Reads a trace `save` wrote (a pickle: load only traces you trust)."""
        with open(path, "rb") as f:
            trace = pickle.load(f)
        if not isinstance(trace, DecisionTrace):
            raise ValueError(f"{path!s} holds a {type(trace).__name__}, not a DecisionTrace")
        return trace


def is_recorded(scheduler: Scheduler) -> bool:
    """Whether a `DecisionRecorder` is attached to `scheduler` now."""
    return any(name in vars(scheduler) for name in ENTRY_POINTS)


class DecisionRecorder:
    """Records the calls into one scheduler (`Engine.record_decisions` attaches it).

    Calls the scheduler makes into itself (an abort of a chunk fill nobody waits for) are
    part of the outer call and not recorded apart.
    """

    def __init__(self, scheduler: Scheduler, recipe: SchedulerRecipe,
                 cache_key: Callable[[str | None, str], bytes]):
        if scheduler.stats.get("steps", 0) or scheduler.has_unfinished() or scheduler.paused:
            raise ValueError("a decision recording starts before the scheduler's first step, "
                             "with no request in it")
        self.scheduler = scheduler
        self.trace = DecisionTrace(recipe)
        self._cache_key = cache_key
        self._depth = 0
        self._clock_values: list[float] = []
        self._step_of: dict[int, int] = {}  # id(SchedulerOutput) -> its schedule event
        self._raw_clock = scheduler.clock
        kv_cache = scheduler.kv_cache
        self._allocator_clock = kv_cache.allocator.clock if kv_cache.has_prefix_cache else None
        self._install_clock(self._clock)
        for name in ENTRY_POINTS:
            setattr(scheduler, name, self._wrap(name, getattr(scheduler, name)))

    def _install_clock(self, clock) -> None:
        self.scheduler.clock = clock
        if self._allocator_clock is not None:
            self.scheduler.kv_cache.allocator.clock = clock

    def _clock(self) -> float:
        value = self._raw_clock()
        if self._depth:
            self._clock_values.append(value)
        return value

    def _wrap(self, name: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def recorded(*args, **kwargs):
            if self._depth:
                return method(*args, **kwargs)
            event = Event(name, *self._arguments(name, args, kwargs),
                          step_time_s=self.scheduler.stats.get("step_time_s", 0.0))
            self._clock_values = []
            self._depth += 1
            try:
                result = method(*args, **kwargs)
            except Exception as e:
                event.error = type(e).__name__
                raise
            finally:
                self._depth -= 1
                event.clock = tuple(self._clock_values)
                self.trace.events.append(event)
            if name == "schedule":
                self._step_of[id(result)] = len(self.trace.events) - 1
                event.result = copy.deepcopy(result)
            elif name == "update_from_output":
                event.result = tuple(result)
            return result

        return recorded

    def _arguments(self, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if name == "add_request" and any(s.grammar is not None for s in args[2]):
            raise ValueError(f"request {args[0]!r}: a request under a grammar cannot be "
                             f"recorded, its matcher being a native object a trace cannot copy")
        if name != "update_from_output":
            return copy.deepcopy(args), copy.deepcopy(kwargs)
        so, out = args
        out = dataclasses.replace(out, logits=None)  # a device array; nothing decides on it
        return (self._step_of.pop(id(so)), copy.deepcopy(out)), {}

    def stop(self) -> DecisionTrace:
        """Detaches from the scheduler (its methods and clocks as before) and returns the
        trace, with the provenance fingerprint of every tenant and version it saw."""
        for name in ENTRY_POINTS:
            vars(self.scheduler).pop(name, None)
        self._install_clock(self._raw_clock)
        if self._allocator_clock is not None:
            self.scheduler.kv_cache.allocator.clock = self._allocator_clock
        seqs = [s for e in self.trace.events if e.name == "add_request" for s in e.args[2]]
        tenants = {s.tenant for s in seqs}
        versions = {self.trace.recipe.weights_version, *self.scheduler.versions,
                    *(s.weights_version for s in seqs if s.weights_version),
                    *(e.args[0] for e in self.trace.events if e.name == "on_weights_update")}
        keys = {(t, v): self._cache_key(t, v) for t in tenants for v in versions}
        self.trace = dataclasses.replace(
            self.trace, recipe=dataclasses.replace(self.trace.recipe, cache_keys=keys))
        return self.trace


# ----------------------------------------------------------------------------- replay


class ReplayMismatch(AssertionError):
    """A replayed scheduler decided otherwise than the recorded one."""


class ReplayDevice:
    """The `KVDevice` of a replayed scheduler: it holds no pool, and accepts the KV
    operations that are plain data (and warm-up records) without running anything."""

    kv = None

    def apply_ops(self, ops: Sequence[KVOp]) -> None:
        for op in ops:
            self._check(op)

    def apply(self, op: KVOp, fn: Callable[[Any], Any]) -> None:
        self._check(op, closure=True)

    def run_op(self, kv: Any, op: KVOp) -> Any:
        self._check(op)
        return kv

    @staticmethod
    def _check(op: KVOp, *, closure: bool = False) -> None:
        """Refuses an op that runs a device program when issued (a closure: a scatter from
        outside, a placement), by its kind."""
        if op.kind is not KVOpKind.WARMUP and (closure or op.kind not in DATA_KINDS):
            raise ValueError(f"KV operation {op.kind.value!r} still runs a device program when "
                             f"issued, so it does not replay; replay covers runs whose KV "
                             f"operations are all data ({sorted(k.value for k in DATA_KINDS)})")


class _NoSwapSpace:
    """The swap space of a replayed scheduler: swaps are data the `ReplayDevice` accepts;
    no host copy is kept, and replayed stats count no swapped bytes. `keeps_windows`: as the
    recorded run's (KIVI windows beside the pages, whose freed slots `allocator` reports)."""

    num_compiles = 0

    def __init__(self, allocator: Any, keeps_windows: bool = False):
        self.allocator = allocator
        self.keeps_windows = keeps_windows

    def page_bytes(self, kv: Any, bits: int = 0) -> int:
        return 0

    def window_bytes(self, kv: Any) -> int:
        return 0

    def take_released_slots(self) -> list[int]:
        """The window slots freed since the last call (see `WindowSwapSpace`)."""
        if not self.keeps_windows:
            return []
        released = list(self.allocator.released_slots)
        self.allocator.released_slots.clear()
        return released

    def drop(self, seq_id: str) -> None:
        pass


class ReplayClock:
    """Gives back the readings a recorded call took, in order; past them, the last one."""

    def __init__(self):
        self._values: list[float] = []
        self._last = 0.0

    def start(self, values: Sequence[float]) -> None:
        self._values = list(values)

    def __call__(self) -> float:
        if self._values:
            self._last = self._values.pop(0)
        return self._last


def build_scheduler(recipe: SchedulerRecipe, *, clock: Callable[[], float] | None = None,
                    stats: dict | None = None) -> Scheduler:
    """A fresh scheduler as `recipe` describes, over a `ReplayDevice` (no model, no device)."""
    clock = ReplayClock() if clock is None else clock
    stats = {} if stats is None else stats
    retention = RetentionManager(make_retention(
        recipe.retention, recipe.retention_budget, recipe.config.page_size,
        **recipe.retention_options))
    allocator = copy.deepcopy(recipe.allocator)
    tiers, swap_space = None, _NoSwapSpace(allocator, recipe.keeps_windows)
    if recipe.tiers is not None:  # the tiers' ledger, its transfers landing as recorded
        tiers = TierManager(recipe.tiers, port=PlannedTierPort(*recipe.tier_pages))
        swap_space = TieredSwapSpace(tiers, swap_space, allocator)
    kv_cache = KVCacheManager(
        ReplayDevice(), allocator, swap_space, retention,
        page_size=recipe.config.page_size, watermark=recipe.watermark,
        scrub_freed_pages=recipe.scrub_freed_pages, stats=stats, clock=clock, tiers=tiers,
        quantized_len=None if recipe.quantized_lens is None else recipe.quantized_lens.__getitem__)

    def cache_key(tenant: str | None, version: str) -> bytes:
        if (tenant, version) not in recipe.cache_keys:
            raise ValueError(f"the trace holds no provenance fingerprint for tenant {tenant!r} "
                             f"and weights version {version!r}")
        return recipe.cache_keys[tenant, version]

    return Scheduler(
        recipe.config, kv_cache, make_policy(recipe.policy), cache_key=cache_key, clock=clock,
        stats=stats, weights_version=recipe.weights_version,
        drafter=make_drafter(recipe.drafter, **recipe.drafter_options),
        reuse_strategies={recipe.context_reuse: make_strategy(
            recipe.context_reuse, **recipe.context_reuse_options)},
        controller=make_controller(recipe.controller, **recipe.controller_options))


@dataclasses.dataclass
class ReplayResult:
    """What a replay produced.

    Attributes:
      outputs: the replayed scheduler's SchedulerOutputs, one per step formed.
      finished: the RequestOutputs of the requests that finished (text None: no tokenizer).
      scheduler: the replayed scheduler, in its final state.
    """

    outputs: list[SchedulerOutput]
    finished: list[RequestOutput]
    scheduler: Scheduler


def replay(trace: DecisionTrace, *, scheduler: Scheduler | None = None,
           counterfactual: bool = False) -> ReplayResult:
    """Feeds a recorded run's calls to a fresh scheduler.

    Args:
      trace: the recording.
      scheduler: the scheduler to replay into; None: `build_scheduler(trace.recipe)`. Its
        clock is replaced by a `ReplayClock`.
      counterfactual: False checks that every step's SchedulerOutput (and the KV operations
        each commit plans) equals the recorded one, feeding the recorded RunnerOutputs.
        True lets the scheduler decide otherwise: sampled tokens come from the recording by
        (sequence, token index), and steps go on until every request finishes.

    Raises:
      ReplayMismatch: (not counterfactual) at the first decision that differs, naming the
        step and the field.
      ValueError: a KV operation that is not data (`ReplayDevice`), or (counterfactual) a
        token the recording does not hold.
    """
    clock = ReplayClock()
    scheduler = build_scheduler(trace.recipe, clock=clock) if scheduler is None else scheduler
    scheduler.clock = clock
    if scheduler.kv_cache.has_prefix_cache:
        scheduler.kv_cache.allocator.clock = clock
    if counterfactual:
        return _replay_counterfactual(trace, scheduler, clock)
    outputs: list[SchedulerOutput] = []
    by_event: dict[int, SchedulerOutput] = {}
    finished: list[RequestOutput] = []
    for index, event in enumerate(trace.events):
        clock.start(event.clock)
        scheduler.stats["step_time_s"] = event.step_time_s
        # Copies: the scheduler changes what it is given (a request's sequences), and the
        # trace may replay again.
        args = copy.deepcopy(event.args) if event.name != "update_from_output" else (
            by_event[event.args[0]], copy.deepcopy(event.args[1]))
        try:
            result = getattr(scheduler, event.name)(*args, **copy.deepcopy(event.kwargs))
        except Exception as e:
            if type(e).__name__ != event.error:
                raise
            continue
        if event.error is not None:
            raise ReplayMismatch(f"event {index} ({event.name}): the recorded call raised "
                                 f"{event.error}, the replayed one returned")
        if event.name == "schedule":
            by_event[index] = result
            outputs.append(result)
            _check_equal(decision(result), decision(event.result),
                         f"step {len(outputs) - 1} (event {index})")
        elif event.name == "update_from_output":
            _check_equal(_plain(tuple(result)), _plain(event.result),
                         f"commit of step event {event.args[0]} (event {index})")
        finished += scheduler.take_finished()
    return ReplayResult(outputs, finished, scheduler)


def _token_table(trace: DecisionTrace) -> dict[tuple[str, int], tuple[int, float]]:
    """(sequence id, index of the token among its generated ones) -> (token, logprob)."""
    table = {}
    for event in trace.events:
        if event.name != "update_from_output":
            continue
        so, out = trace.events[event.args[0]].result, event.args[1]
        for i, row in enumerate(so.rows):
            if row.samples and not row.is_draft and not row.num_drafts:
                table[row.seq_id, row.counter] = (int(out.tokens[i]), float(out.logprobs[i]))
    return table


def _replay_counterfactual(trace: DecisionTrace, scheduler: Scheduler,
                           clock: ReplayClock) -> ReplayResult:
    table = _token_table(trace)
    if scheduler.config.num_draft_tokens:
        raise ValueError("a counterfactual replay takes no speculative decoding: a verify "
                         "step's accepted drafts are not in the recording by token")
    # The calls other than steps, grouped by the number of steps formed before them.
    arrivals: dict[int, list[Event]] = {}
    num_steps = 0
    for event in trace.events:
        if event.name == "schedule":
            num_steps += 1
        elif event.name != "update_from_output" and event.error is None:
            arrivals.setdefault(num_steps, []).append(event)
    last_arrival = max(arrivals, default=0)
    # A schedule that serves every request finishes within this many steps of the recorded one.
    max_steps = last_arrival + 4 * len(trace.outputs) + 16
    outputs, finished = [], []
    for step in range(max_steps):
        if step > last_arrival and not scheduler.has_unfinished():
            break
        for event in arrivals.get(step, []):
            clock.start(event.clock)
            getattr(scheduler, event.name)(*copy.deepcopy(event.args),
                                           **copy.deepcopy(event.kwargs))
        so = scheduler.schedule()
        outputs.append(so)
        scheduler.update_from_output(so, _sampled(so, table))
        finished += scheduler.take_finished()
    else:
        raise ValueError(f"the replayed scheduler left requests unfinished after {max_steps} "
                         f"steps ({len(trace.outputs)} recorded)")
    return ReplayResult(outputs, finished, scheduler)


def _sampled(so: SchedulerOutput, table: dict) -> RunnerOutput:
    tokens, logprobs = [], []
    for row in so.rows:
        if not row.samples:
            tokens.append(0)
            logprobs.append(0.0)
            continue
        if (row.seq_id, row.counter) not in table:
            raise ValueError(f"sequence {row.seq_id!r}: the recording holds no token "
                             f"{row.counter} of it")
        token, logprob = table[row.seq_id, row.counter]
        tokens.append(token)
        logprobs.append(logprob)
    return RunnerOutput(tokens=np.asarray(tokens, np.int32),
                        logprobs=np.asarray(logprobs, np.float32))


# ----------------------------------------------------------------------------- comparison


def decision(so: SchedulerOutput) -> Any:
    """A SchedulerOutput as plain data (arrays as dtype, shape and values), warm-up records
    left out: two outputs decide the same when their decisions are equal."""
    return _plain(dataclasses.replace(
        so, kv_ops=tuple(op for op in so.kv_ops if op.kind is not KVOpKind.WARMUP)))


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"type": type(x).__name__,
                **{f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, np.ndarray):
        return {"dtype": x.dtype.str, "shape": list(x.shape), "values": x.tolist()}
    if isinstance(x, enum.Enum):
        return f"{type(x).__name__}.{x.name}"
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {repr(k): _plain(v) for k, v in x.items()}
    return x


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    if type(a) is not type(b):
        return f"{path}: {a!r:.200} != {b!r:.200}"
    if isinstance(a, dict):
        for key in dict.fromkeys([*a, *b]):
            if key not in a or key not in b:
                return f"{path}.{key}: present in one only"
            found = _first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}: {a!r:.200} != {b!r:.200}"
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            found = _first_difference(u, v, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r:.200} != {b!r:.200}"


def _check_equal(replayed: Any, recorded: Any, where: str) -> None:
    if replayed == recorded:
        return
    found = _first_difference(replayed, recorded, "")
    if found:
        raise ReplayMismatch(f"{where}: replayed != recorded at {found}")
