"""The scheduler's side of a KV controller (`kvjax.scheduler.controller`): the snapshot it
decides from, and its budgets applied before a step forms."""

from __future__ import annotations

from collections.abc import Callable

from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.controller import (
    INF,
    ControlState,
    Decisions,
    FixedController,
    HostRowRates,
    KVController,
    SeqState,
)
from kvjax.scheduler.inplace import InPlaceDemotion
from kvjax.scheduler.preemption import PreemptionPolicy
from kvjax.scheduler.request import Sequence
from kvjax.scheduler.requests import RequestTable

# A controller's estimate of the swap rate when the engine measured none.
_DEFAULT_SWAP_BYTES_PER_S = 10e9


class ControllerAdapter:
    """Consults the KV controller once per step and keeps its decisions.

    Attributes:
      controller: the KVController.
      decisions: its last decisions (empty until it decides: the configured behaviour).
    """

    def __init__(self, controller: KVController | None, config: SchedulerConfig, kv_cache,
                 table: RequestTable, preemption: PreemptionPolicy, *,
                 clock: Callable[[], float]):
        self.controller = controller or FixedController()
        self.decisions = Decisions()
        self.config = config
        self.kv_cache = kv_cache
        self.table = table
        self.preemption = preemption
        self._clock = clock
        self.in_place = InPlaceDemotion(None)  # a mixed-precision pool's (set by the engine)
        self.placement = None  # the scheduler's HostPlacement (host-resident rows)
        if self.controller.manages_retention and kv_cache.retention.policy.evicts:
            kv_cache.retention.default_budget = None  # exact until the controller decides

    def state(self) -> ControlState:
        """The snapshot a KV controller decides from (see `kvjax.scheduler.controller`)."""
        cfg, now, table = self.config, self._clock(), self.table
        retention = self.kv_cache.retention
        policy = retention.policy
        seqs = []
        for status, queue in (("waiting", table.waiting), ("running", table.running),
                              ("swapped", table.swapped)):
            for s in queue:
                held = (len(self.kv_cache.block_table(s.seq_id))
                        - self.kv_cache.num_host_pages(s.seq_id)  # device pages only
                        if status == "running" and self.kv_cache.has_sequence(s.seq_id) else 0)
                seqs.append(SeqState(
                    seq_id=s.seq_id, request_id=s.request_id, tenant=s.tenant,
                    priority=s.priority, status=status, age_s=now - s.arrival_time,
                    num_tokens=s.num_tokens, num_computed=s.num_computed,
                    cached_tokens=self.kv_cache.cached_len(s.seq_id, s.num_computed)
                    if status != "waiting" else 0,
                    pages_held=held, slack_s=slack(s, now),
                    retention_budget=retention.budget(s.seq_id), kl_spent=s.kl_spent,
                    kl_budget=s.slo.kl_budget, demoted_bits=s.demoted_bits,
                    num_preemptions=s.num_preemptions,
                    **(self.in_place.seq_fields(s) if status == "running" else {})))
        return ControlState(
            now=now, page_size=cfg.page_size, num_pages=self.kv_cache.allocator.capacity,
            free_pages=self.kv_cache.allocator.num_free_pages(), max_num_seqs=cfg.max_num_seqs,
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            swap_bytes_per_s=cfg.swap_bandwidth_bytes_per_s or _DEFAULT_SWAP_BYTES_PER_S,
            recompute_tokens_per_s=self.preemption.recompute_rate(), can_swap=cfg.is_paged,
            demote_ratios=cfg.demote_ratios,
            retention_range=(policy.min_budget, policy.budget) if policy.evicts else None,
            seqs=tuple(seqs), cached=tuple(self.kv_cache.cached_pages()),
            host_room_bytes=self.kv_cache.host_room_bytes(),
            spills_cached=self.kv_cache.tiers is not None,
            inplace_ratios=self.in_place.ratios(), host_rows=self._host_rows())

    def _host_rows(self) -> HostRowRates | None:
        """The host split policy's rates when the engine holds a host pool (else None: the
        controller offers no "host" action)."""
        rates = None if self.placement is None else self.placement.row_rates()
        return None if rates is None else HostRowRates(*rates)

    def decide(self) -> list[str]:
        """Consults the controller and applies its budgets, KL, cached-page keeps, offloads
        (preempted through the `PreemptionPolicy`) and host moves (through the
        `HostPlacement`, which holds those rows on the host against `Decisions.reserve`);
        returns the sequences preempted."""
        if isinstance(self.controller, FixedController):
            return []  # the configured behaviour decides nothing: no snapshot to build
        self.decisions = d = self.controller.decide(self.state())
        for seq_id, budget in d.retention.items():
            self.kv_cache.retention.set_budget(seq_id, budget)
        for seq_id, kl in d.kl.items():
            self.table.sequence(seq_id).kl_spent = kl
        self.kv_cache.keep_cached(d.keep)
        self.in_place.apply(d.demote_in_place,
                            {i: self.table.sequence(i) for i in d.demote_in_place})
        preempted = []
        for seq_id in d.offload:
            seq = self.table.find(seq_id)
            if seq is not None and seq in self.table.running:
                self.table.tracer.emit("offload", "request", f"request/{seq.request_id}",
                                       seq_id=seq_id, controller=self.controller.name)
                self.preemption.preempt(seq, d)
                preempted.append(seq_id)
        for seq_id in d.to_host:  # they keep decoding, their full pages in the host pool
            seq = self.table.find(seq_id)
            if seq is not None and self.placement is not None and self.placement.hold(seq):
                self.placement.stats["controller_to_host"] += 1
                self.table.tracer.emit("to_host", "request", f"request/{seq.request_id}",
                                       seq_id=seq_id, controller=self.controller.name)
        return preempted


def slack(seq: Sequence, now: float) -> float:
    """Seconds to the sequence's next deadline: its TTFT before its first token, then the
    TPOT deadline of its next token (INF without that target, or once the TTFT passed)."""
    slo, times = seq.slo, seq.token_times
    if not times:
        left = INF if slo.ttft_s is None else seq.arrival_time + slo.ttft_s - now
        return left if left >= 0 else INF  # a missed TTFT: nothing left to protect
    return INF if slo.tpot_s is None else times[0] + slo.tpot_s * len(times) - now
