"""Forming one step: decode rows for the running sequences first (preempting from the bottom
of the policy's ranking when pages run out), then prefill chunks of partially computed,
swapped-out and waiting sequences under the step's token budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvjax.scheduler.chunks import ChunkReuse
from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.control import ControllerAdapter
from kvjax.scheduler.echo import EchoPlanner
from kvjax.scheduler.output import SchedulerOutput
from kvjax.scheduler.placement import HostPlacement
from kvjax.scheduler.policies import SchedulingPolicy, rank
from kvjax.scheduler.preemption import PreemptionPolicy
from kvjax.scheduler.probes import ProbeRows
from kvjax.scheduler.request import SeqStatus, Sequence
from kvjax.scheduler.requests import RequestTable
from kvjax.scheduler.rows import RowBuilder
from kvjax.scheduler.speculation import SpeculativePlanner
from kvjax.scheduler.tenants import TenantShares
from kvjax.scheduler.tiered import TierAdmission
from kvjax.scheduler.versions import WeightVersions
from kvjax.shapes import pages_for


@dataclasses.dataclass
class _Step:
    """A step being formed: its rows so far, and what it may still take."""

    budget: int  # tokens left
    active: str  # the weights version it serves
    now: float  # the clock, for the contended-chunk rule
    preempted: list[str]
    offloaded: set[str]  # preempted by the controller: they do not come straight back
    is_draft_step: bool = False
    verifies: bool = False
    decode: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    probes: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    scheduled: set[str] = dataclasses.field(default_factory=set)
    drafting: set[str] = dataclasses.field(default_factory=set)


class StepPlanner:
    """Forms the scheduler's steps from its components' answers.

    Which sequences run is decided here; what each component contributes goes through its
    interface: the `ControllerAdapter`'s decisions and offloads, the `PreemptionPolicy`'s
    victims, `TierAdmission`'s admissions and swap-ins, `ChunkReuse`'s copies, the
    `SpeculativePlanner`'s drafts, `TenantShares`' limits, `HostPlacement`'s moves, and the
    `RowBuilder`'s rows, `ProbeRows`' probe rows.
    """

    def __init__(self, config: SchedulerConfig, kv_cache, policy: SchedulingPolicy, *,
                 table: RequestTable, versions: WeightVersions, control: ControllerAdapter,
                 preemption: PreemptionPolicy, admission: TierAdmission, chunks: ChunkReuse,
                 spec: SpeculativePlanner, rows: RowBuilder, probes: ProbeRows,
                 tenants: TenantShares,
                 placement: HostPlacement, echo: EchoPlanner | None, stats: dict,
                 clock: Callable[[], float]):
        self.config = config
        self.kv_cache = kv_cache
        self.policy = policy
        self.table = table
        self.versions = versions
        self.control = control
        self.preemption = preemption
        self.admission = admission
        self.chunks = chunks
        self.spec = spec
        self.rows = rows
        self.probes = probes
        self.tenants = tenants
        self.placement = placement
        self.echo = echo
        self.stats = stats
        self._clock = clock

    def _ranked(self, seqs: list[Sequence], first: tuple[str, ...] = ()) -> list[Sequence]:
        return rank(self.policy, seqs, first)

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        return self.preemption.victim(candidates, self.control.decisions, self.policy)

    def _cached_len(self, seq: Sequence) -> int:
        return self.kv_cache.cached_len(seq.seq_id, seq.num_computed)

    def form(self, speculate: bool) -> SchedulerOutput:
        """The next step's rows, with the KV operations of forming it (see
        `Scheduler.schedule`, which wraps this in the KV cache manager's plan)."""
        self.chunks.fills_requested = False
        self.admission.poll()
        preempted = self.control.decide() + self._reclaim_share()
        step = _Step(budget=self.config.max_num_batched_tokens, now=self.tenants.observe(),
                     active=self.versions.active(), preempted=preempted,
                     offloaded=set(preempted))
        decoding = [s for s in self._ranked(self.table.running)
                    if s.status is SeqStatus.RUNNING and s.num_pending == 1
                    and s.weights_version == step.active and not self._is_done(s)
                    and s.probing is None]
        step.is_draft_step, step.verifies = self.spec.step_kind(decoding, speculate)
        # 1. Decode rows for running sequences, highest ranked first; preempt from the bottom.
        # With speculation a row drafts one token (a draft step) or verifies its drafts.
        self._schedule_decodes(step, decoding)
        self.placement.place_rows([s for s, _ in step.decode], self.control.decisions.reserve)
        if self.echo is not None:
            self.echo.place([(s.seq_id, self._cached_len(s)) for s, _ in step.decode],
                            [s.seq_id for s in self.table.sequences()])
        # 2. Probe rows of sequences whose prefill is done, then prefill chunks: running
        # partial prefills, then swapped, then waiting sequences.
        self._schedule_probes(step)
        self._schedule_prefills(step)
        if (not step.decode and not step.prefill and not step.probes and self.table.running
                and not self.chunks.fills_requested
                and not any(s.awaits_step_in_flight for s in self.table.running)):
            # Nothing fits: free the lowest-ranked running sequence so the rest can progress
            # (unless chunk fills were just queued: they run next, and their waiters after).
            victim = self._victim(self.table.running)
            self._preempt(victim)
            step.preempted.append(victim.seq_id)
        self.admission.prefetch(idle=not step.decode and not step.prefill)
        self.kv_cache.spill_evictions()  # Before the step writes to pages evicted above.
        return self._output(step)

    def _schedule_decodes(self, step: _Step, decoding: list[Sequence]) -> None:
        cfg = self.config
        for seq in decoding:
            if seq.status is not SeqStatus.RUNNING:  # preempted for a higher-ranked row
                continue
            if len(step.decode) >= cfg.max_num_seqs or step.budget < 1:
                break
            if step.is_draft_step and len(seq.draft_tokens) >= self.spec.max_drafts(seq):
                continue  # its drafts are ready: it waits for the verify step
            if step.verifies:
                self.spec.propose(seq, step.budget - 1)
            offset = len(seq.draft_tokens) if step.is_draft_step else 0
            width = 1 + len(seq.draft_tokens) if step.verifies else 1
            while True:
                cached = self._cached_len(seq) + offset
                if self.kv_cache.allocate(seq.seq_id, cached, cached + width):
                    step.decode.append((seq, width))
                    step.scheduled.add(seq.seq_id)
                    if seq.num_computed < seq.num_prompt_tokens:  # a forked sample's first
                        self.probes.start(seq, seq.num_tokens)
                    if step.is_draft_step:
                        step.drafting.add(seq.seq_id)
                    step.budget -= width
                    break
                if (self.placement.policy.offloads_when_full
                        and self.placement.offload_a_row(self._ranked(self.table.running))):
                    continue  # its pages went to the host pool instead of a preemption
                victim = self._victim([s for s in self.table.running
                                       if s.seq_id not in step.scheduled])
                self._preempt(victim)
                step.preempted.append(victim.seq_id)
                if victim is seq:
                    break

    def _schedule_probes(self, step: _Step) -> None:
        """One probe row per probing sequence, highest ranked first
        (`kvjax.scheduler.probes`)."""
        for seq in self._ranked(self.table.running):
            if (seq.probing is None or seq.seq_id in step.scheduled
                    or seq.weights_version != step.active):
                continue
            if len(step.prefill) + len(step.probes) >= self.config.max_prefill_seqs:
                break
            n = self.probes.next_row(seq, step.budget)
            if n:
                step.probes.append((seq, n))
                step.scheduled.add(seq.seq_id)
                step.budget -= n

    def _schedule_prefills(self, step: _Step) -> None:
        cfg, d = self.config, self.control.decisions
        partial = [s for s in self._ranked(self.table.running)
                   if s.num_pending > 1 and s.seq_id not in step.scheduled]
        if d.admit_order:  # The controller ranks swapped and waiting together.
            queued = self._ranked(self.table.swapped + self.table.waiting, d.admit_order)
        else:
            queued = self._ranked(self.table.swapped, d.prefetch) + self._ranked(self.table.waiting)
        # A sequence the controller offloaded this step does not come straight back.
        candidates = partial + [s for s in queued if s.seq_id not in step.offloaded]
        if self.policy.ranks_prefills_together and not d.admit_order:
            candidates = self._ranked(candidates)
        for seq in candidates:
            # A token still in flight joins only as its own decode row (above).
            if seq.weights_version != step.active or seq.num_unresolved:
                continue
            if step.budget <= 0 or len(step.prefill) + len(step.probes) >= cfg.max_prefill_seqs:
                break
            if seq.status is SeqStatus.SWAPPED:
                need = pages_for(self._cached_len(seq), cfg.page_size)
                if len(self.table.running) >= cfg.max_num_seqs or not self.kv_cache.can_admit(
                        need, reserve=bool(self.table.running)):
                    break
                if not self.admission.swap_in(seq):
                    break
                self.table.swapped.remove(seq)
                self.table.running.append(seq)
                if seq.probing is not None:  # its probes run again from the next step
                    continue
                if seq.num_pending == 1:
                    cached = self._cached_len(seq)
                    if (len(step.decode) < cfg.max_num_seqs
                            and self.kv_cache.allocate(seq.seq_id, cached, cached + 1)):
                        step.decode.append((seq, 1))
                        step.scheduled.add(seq.seq_id)
                        step.budget -= 1
                    continue
                # Swapped mid-prefill, or its tier copy came back short: the rest of its KV is
                # computed as prefill chunks, starting now (else "nothing fits" would swap it
                # straight out again).
            is_new = seq.status is SeqStatus.WAITING
            if is_new:
                if len(self.table.running) >= cfg.max_num_seqs:
                    break
                if (self.tenants.is_over_share(seq) or self.admission.prefix_in_flight(seq)
                        or not self.admission.admit(seq)):
                    continue
            limit = self.chunks.reuse_chunks(seq)
            if not limit:  # Its next chunk is being filled, or its copy finds no room.
                if is_new:
                    self.kv_cache.unregister(seq.seq_id)
                    seq.num_computed = 0
                continue
            chunk = self.rows.fit_to_bucket(sum(n for _, n in step.prefill),
                                            min(seq.num_pending, step.budget,
                                                self.tenants.chunk_limit(seq, step.now), limit))
            cached = self._cached_len(seq)
            need = self.kv_cache.pages_needed(seq.seq_id, cached + chunk)
            # With nothing running, the watermark's reserve keeps room for no one: a prompt
            # that needs the whole pool is admitted rather than waiting forever.
            ok = not is_new or self.kv_cache.can_admit(need + d.admit_reserve,
                                                       reserve=bool(self.table.running))
            if ok:
                ok = self.kv_cache.allocate(seq.seq_id, cached, cached + chunk)
            if not ok:
                if is_new:
                    self.kv_cache.unregister(seq.seq_id)
                    seq.num_computed = 0
                break
            if is_new:
                self.table.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.table.running.append(seq)
                self.table.tracer.emit("schedule", "request", f"request/{seq.request_id}",
                                 seq_id=seq.seq_id, cached_tokens=cached)
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = self._clock()
            step.prefill.append((seq, chunk))
            step.scheduled.add(seq.seq_id)
            step.budget -= chunk
            if chunk == seq.num_pending and not seq.is_prefill_only:
                self.probes.start(seq, seq.num_tokens)

    def _output(self, step: _Step) -> SchedulerOutput:
        """The formed step's rows as data, with the KV operations forming it planned."""
        decode, prefill, drafting = step.decode, step.prefill, step.drafting
        if drafting:
            self.stats["spec_draft_steps"] += 1
        # A decode row's tokens past the first are its drafts in a verify step (a row swapped
        # in during it has none); prefill rows hold prompt tokens only.
        num_drafts = {s.seq_id: n - 1 if step.verifies else 0 for s, n in decode}
        masks = self.rows.grammar_masks([(s, n, num_drafts.get(s.seq_id, 0))
                                         for s, n in decode + prefill
                                         if s.seq_id not in drafting])
        rows = [self.spec.draft_row(s, i) if s.seq_id in drafting
                else self.rows.row(s, n, i, num_drafts[s.seq_id], masks.get(s.seq_id))
                for i, (s, n) in enumerate(decode)]
        if self.echo is not None:
            rows = [dataclasses.replace(r, **self.echo.row_fields(r.seq_id, r.feed_index),
                                        host_len=0) for r in rows]
        rows += [self.rows.row(s, n, len(decode) + i, masks=masks.get(s.seq_id))
                 for i, (s, n) in enumerate(prefill)]
        rows += [self.rows.probe_row(s, self.probes.dispatched(s)) for s, _ in step.probes]
        return SchedulerOutput(decode=tuple(rows[:len(decode)]), prefill=tuple(rows[len(decode):]),
                               preempted=tuple(step.preempted), kv_plan=self.kv_cache.take_plan(),
                               kv_ops=self.kv_cache.take_ops(), weights_version=step.active,
                               blends=self.chunks.take_blends())

    def _is_done(self, seq: Sequence) -> bool:
        """Whether the token in flight is the sequence's last (by its length limits)."""
        return seq.num_unresolved > 0 and (
            seq.num_tokens - seq.num_prompt_tokens >= seq.sampling.max_new_tokens
            or seq.num_tokens >= self.config.max_model_len)

    def _reclaim_share(self) -> list[str]:
        """Preempts one running sequence of a tenant over its share (`max_tenant_page_share`)
        when the first waiting sequence of a tenant under it finds no room for its first
        chunk: the lowest ranked such sequence, so the pages it frees admit the waiting one.
        Returns the preempted ids (none without a share)."""
        if self.config.max_tenant_page_share is None:
            return []
        candidates = self.tenants.reclaim_candidates(self._ranked(self.table.waiting))
        if not candidates:
            return []
        hog = self._victim(candidates)
        self._preempt(hog)
        return [hog.seq_id]

    def _preempt(self, seq: Sequence) -> None:
        self.preemption.preempt(seq, self.control.decisions)
