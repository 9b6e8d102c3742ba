"""The scheduler: which sequences run in the next step, and what their results change.

Pure host code. `schedule()` forms one step: decode rows for the running sequences first
(preempting from the bottom of the policy's ranking when pages run out), then prefill chunks of
partially computed, swapped-out and waiting sequences under a per-step token budget; it returns
the plan as a `SchedulerOutput`. `update_from_output()` commits the step's tokens: prefix-cache
commits, retention decisions, n > 1 forks, stop checks and finished outputs. Memory goes
through the `KVCacheManager`; the scheduler never touches the device pool itself.

The `Scheduler` coordinates components, each behind its own small interface: the
`RequestTable` (queues and request records), `WeightVersions`, the `StepPlanner` (forming a
step) and `StepCommitter` (committing one), `TierAdmission` (prefix lookups, tier loads,
swap-ins), `ChunkReuse` and `CacheKeys` (context reuse and provenance keys), the
`SpeculativePlanner`, the `ControllerAdapter` (a KV controller's snapshot and budgets), the
`PreemptionPolicy` (victim and SWAP / RECOMPUTE), `TenantShares`, `HostPlacement` and the
`RowBuilder` (a step's `ScheduledRow`s).
"""

from __future__ import annotations

from collections.abc import Callable

from kvjax.delegation import delegate
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.memory.ops import KVOp, TierLanded
from kvjax.scheduler.chunks import ChunkReuse
from kvjax.scheduler.commit import StepCommitter
from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.context import ReuseStrategy
from kvjax.scheduler.control import ControllerAdapter
from kvjax.scheduler.controller import ControlState, Decisions, KVController
from kvjax.scheduler.echo import EchoPlanner
from kvjax.scheduler.host_split import HostSplitPolicy, Never
from kvjax.scheduler.keys import CacheKeys
from kvjax.scheduler.output import RunnerOutput, SchedulerOutput
from kvjax.scheduler.placement import HostPlacement
from kvjax.scheduler.planner import StepPlanner
from kvjax.scheduler.policies import LongestPrefixMatch, SchedulingPolicy
from kvjax.scheduler.preemption import PreemptionPolicy
from kvjax.scheduler.probes import ProbeRows
from kvjax.scheduler.request import Sequence, WeightUpdatePolicy
from kvjax.scheduler.requests import RequestTable
from kvjax.scheduler.rows import RowBuilder
from kvjax.scheduler.spec import Drafter
from kvjax.scheduler.speculation import SpeculativePlanner
from kvjax.scheduler.tenants import TenantShares
from kvjax.scheduler.tiered import TierAdmission
from kvjax.scheduler.versions import WeightVersions

__all__ = ["Scheduler", "SchedulerConfig"]


def _queue(name: str) -> property:
    return property(lambda self: getattr(self.requests, name),
                    doc=f"The request table's `{name}` (`RequestTable`).")


class Scheduler:
    """Continuous batching over the sequences of every unfinished request.

    Attributes:
      config: the SchedulerConfig.
      kv_cache: the KVCacheManager memory decisions go through.
      policy: the SchedulingPolicy ranking sequences (admission order, preemption victims).
      requests: the RequestTable; `waiting`, `running`, `swapped`, `paused` are its queues.
      weights_version: the newest weights version; `versions` every version still served.
      stats: the engine's counters (shared dict) this scheduler adds to.
      clock: seconds now (replaceable: a replay installs its own).
      spec: the SpeculativePlanner; `drafter` is where its draft tokens come from
        (`kvjax.scheduler.spec`).
      chunks: the ChunkReuse; `reuse_strategies` are its context-reuse strategies by name
        (`kvjax.scheduler.context`).
      control: the ControllerAdapter consulting `controller` at the start of every
        `schedule()` (`kvjax.scheduler.controller`); its last decisions are `decisions`.
      host_split: how many pages of each decode row live in the host pool
        (`kvjax.scheduler.host_split`), applied by `placement`.
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 policy: SchedulingPolicy, *, cache_key: Callable[[str | None, str], bytes],
                 clock: Callable[[], float], stats: dict, weights_version: str, tokenizer=None,
                 drafter: Drafter | None = None,
                 reuse_strategies: dict[str, ReuseStrategy] | None = None,
                 controller: KVController | None = None,
                 host_split: HostSplitPolicy | None = None):
        self.config = config
        self.kv_cache = kv_cache
        self.policy = policy
        self.clock = clock
        self.stats = stats
        retention = kv_cache.retention.policy
        self.echo = None if retention.echo_prefetch is None else EchoPlanner(
            kv_cache, config.page_size, retention.num_read_pages, retention.echo_prefetch,
            stats, keep_misses=retention.echo_keep_misses)
        self.requests = RequestTable(config, kv_cache, clock=self._now, tokenizer=tokenizer,
                                     default_version=lambda: self.weights_version)
        self.weight_versions = WeightVersions(weights_version, self.requests, stats)
        self.preemption = PreemptionPolicy(config, kv_cache, self.requests, stats)
        self.control = ControllerAdapter(controller, config, kv_cache, self.requests,
                                         self.preemption, clock=self._now)
        self.chunks = ChunkReuse(config, kv_cache, self.requests, stats, cache_key=cache_key,
                                 strategies=reuse_strategies)
        self.stats.update(steps=0, preemptions=0, prefill_tokens=0, decode_tokens=0,
                          preemption_decisions=[], step_time_s=0.0, spec_draft_steps=0,
                          spec_verify_rows=0, spec_proposed=0, spec_accepted=0, demoted_swaps=0,
                          host_offloads=0, controller_to_host=0)
        self.keys = CacheKeys(config, kv_cache, self.requests, self.chunks, cache_key=cache_key)
        if isinstance(policy, LongestPrefixMatch):
            policy.cached_tokens = self.keys.peek_cached_tokens
        self.admission = TierAdmission(config, kv_cache, self.requests, self.keys, policy, stats)
        self.spec = SpeculativePlanner(config, kv_cache, drafter, stats)
        self.rows = RowBuilder(config, kv_cache, stats)
        self.probes = ProbeRows(config, kv_cache, stats)
        self.tenants = TenantShares(config, kv_cache, self.requests, clock=self._now)
        self.host_split = host_split or Never()
        self.committer = StepCommitter(kv_cache, self.requests, keys=self.keys, spec=self.spec,
                                       tenants=self.tenants, policy=policy,
                                       probes=self.probes, stats=stats, clock=self._now)
        self.placement = HostPlacement(self.host_split, kv_cache, config.page_size, stats)
        self.control.placement = self.placement
        self.planner = StepPlanner(
            config, kv_cache, policy, table=self.requests, versions=self.weight_versions,
            control=self.control, preemption=self.preemption, admission=self.admission,
            chunks=self.chunks, spec=self.spec, rows=self.rows, probes=self.probes,
            tenants=self.tenants,
            placement=self.placement, echo=self.echo, stats=stats, clock=self._now)

    def _now(self) -> float:
        return self.clock()

    # The request table's API, as the engine, snapshots and replays call it.
    waiting, running, swapped, paused = (_queue(n) for n in ("waiting", "running", "swapped",
                                                             "paused"))
    tracer = _queue("tracer")
    set_tracer = delegate("requests", RequestTable.set_tracer)
    has_request = delegate("requests", RequestTable.has_request)
    has_unfinished = delegate("requests", RequestTable.has_unfinished)
    sequence = delegate("requests", RequestTable.sequence)
    sequences = delegate("requests", RequestTable.sequences)
    force_last_token = delegate("requests", RequestTable.force_last_token)
    request_ids = delegate("requests", RequestTable.request_ids)
    request_meta = delegate("requests", RequestTable.request_meta)
    next_order = delegate("requests", RequestTable.next_order)
    take_finished = delegate("requests", RequestTable.take_finished)
    add_request = delegate("requests", RequestTable.add_request)
    restore_request = delegate("requests", RequestTable.restore_request)
    restore_sequence = delegate("requests", RequestTable.restore_sequence)
    abort = delegate("requests", RequestTable.abort)
    finish = delegate("requests", RequestTable.finish)
    output = delegate("requests", RequestTable.output)
    snapshot_outputs = delegate("requests", RequestTable.snapshot_outputs)
    pause = delegate("requests", RequestTable.pause)
    resume = delegate("requests", RequestTable.resume)

    @property
    def drafter(self) -> Drafter:
        return self.spec.drafter

    @property
    def reuse_strategies(self) -> dict[str, ReuseStrategy]:
        return self.chunks.reuse_strategies

    @property
    def controller(self) -> KVController:
        return self.control.controller

    @property
    def decisions(self) -> Decisions:
        return self.control.decisions

    @property
    def in_place(self):
        """A mixed-precision pool's in-place demotion (`kvjax.scheduler.inplace`)."""
        return self.control.in_place

    @in_place.setter
    def in_place(self, value) -> None:
        self.control.in_place = value

    def cache_key(self, seq: Sequence) -> bytes:
        """The provenance fingerprint a sequence's pages are cached under (`CacheKeys`)."""
        return self.keys.cache_key(seq)

    def prefix_cache_key(self, tenant: str | None, cache_salt: str | None,
                         weights_version: str) -> bytes:
        """The cache key of a plain prompt's pages (`CacheKeys.prefix_cache_key`)."""
        return self.keys.prefix_cache_key(tenant, cache_salt, weights_version)

    def chunk_cache_key(self, tenant: str | None, weights_version: str) -> bytes:
        """The key the chunk cache keeps a tenant's chunks under (`ChunkReuse`)."""
        return self.chunks.chunk_cache_key(tenant, weights_version)

    def strategy(self, name: str) -> ReuseStrategy:
        """The context-reuse strategy of that name (ValueError if none is registered)."""
        return self.chunks.strategy(name)

    def control_state(self) -> ControlState:
        """The snapshot a KV controller decides from (`ControllerAdapter.state`)."""
        return self.control.state()

    # ----------------------------------------------------------------------------- schedule

    def schedule(self, *, speculate: bool = True) -> SchedulerOutput:
        """Forms the next step (rows may be empty: nothing can run now).

        speculate: with speculative decoding configured, decode rows may draft or verify
        drafts; False plans one token per decode row (steps that return logits, so each
        logits row is the distribution of the one token its row emits).

        The copy-on-write copies, scrubs and chunk loads of forming the step come back as data
        in `SchedulerOutput.kv_plan`, for the runner to apply before the step's model."""
        self.kv_cache.defer_ops()
        try:
            return self.planner.form(speculate)
        finally:
            self.kv_cache.end_plan()  # a step that failed to form leaves no op unapplied

    def check_fresh(self, so: SchedulerOutput) -> None:
        """Raises if a row would read a page written under other weights (debug_provenance)."""
        for row in so.rows:
            kv_len = int(row.cache_positions[-1]) + 1
            self.kv_cache.check_fresh(row.seq_id, kv_len,
                                      self.requests.sequence(row.seq_id).weights_version)

    # ----------------------------------------------------------------------------- update

    def update_from_output(self, so: SchedulerOutput, out: RunnerOutput) -> tuple[KVOp, ...]:
        """Commits a step: tokens, prefix-cache pages, retention, forks, stop checks.

        With asynchronous scheduling the next step may already be dispatched. A sequence that
        finished since (a stop token, an abort) drops the row's results: the token sampled
        after a stop is never emitted. One preempted or restarted since (a newer KV epoch)
        skips the KV bookkeeping but still takes its sampled token, which is valid.

        Returns the KV operations it planned as data (the copies of forked samples, retention
        compactions, scrubs of freed pages), in order, for the runner to apply before anything
        reads the pool again.
        """
        self.kv_cache.defer_ops()
        try:
            self.admission.receive(out.tier_landed)
            if self.echo is not None:
                self.echo.observe(so.decode, out.page_reads)
            self.committer.commit(so, out)
            if len(self.versions) > 1:
                self.drop_unused_versions()
            return self.kv_cache.take_plan()
        finally:
            self.kv_cache.end_plan()

    def receive_tier_landed(self, landed: tuple[TierLanded, ...]) -> None:
        """Reports of tier transfers that landed outside a step's output (the engine core's,
        for a step dispatched with none in flight); the next `schedule` commits them."""
        self.admission.receive(landed)

    # ----------------------------------------------------------------------------- weights

    @property
    def weights_version(self) -> str:
        """The newest weights version (`WeightVersions`)."""
        return self.weight_versions.weights_version

    @property
    def versions(self) -> list[str]:
        """Every weights version still served, oldest first (`WeightVersions`)."""
        return self.weight_versions.versions

    def active_version(self) -> str:
        """The weights version the next step serves: versions in flight take turns by step."""
        return self.weight_versions.active()

    def live_versions(self) -> set[str]:
        """Weights versions some unfinished sequence runs under, and the newest."""
        return self.weight_versions.live()

    def drop_unused_versions(self) -> None:
        self.weight_versions.drop_unused()

    def on_weights_update(self, version: str, in_flight: WeightUpdatePolicy) -> None:
        """New weights serve from the next step; sequences in flight follow `in_flight`."""
        self.weight_versions.update(version, in_flight)

    # ----------------------------------------------------------------------------- metrics

    def kv_sample(self) -> tuple[int, int]:
        """(tokens holding live KV, tokens of pages reserved) right now."""
        live = sum(self.kv_cache.cached_len(s.seq_id, s.num_computed) for s in self.running)
        reserved = self.kv_cache.allocator.num_used_pages() * self.config.page_size
        return min(live, reserved), reserved
