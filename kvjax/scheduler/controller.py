"""KV controllers: one policy deciding, each step, what happens to KV under one memory budget.

The scheduler consults the engine's controller (`EngineConfig.controller`) at the start of
every `schedule()` with a `ControlState`, a plain-data snapshot of the pool, the queues, each
sequence's SLO slack and degradation so far, and the cost rates the engine knows; the
controller returns `Decisions`, plain data too, which the scheduler carries out through the
existing mechanisms:

  decision            carried out by
  admit_order         the order queued sequences (waiting, swapped) are admitted in
  offload             preempting running sequences now, each swapped (host memory) or
                      recomputed as `swap` says, to make room for higher-ranked waiting ones
  victims, swap       which running sequence goes first when pages run out mid-step, and how
  retention           a sequence's retention budget (evicting policies: the tokens it keeps)
  demote              a swapped sequence's host copy is stored at fewer bits, int8 or int4
                      (exact -> int8 -> int4: fewer bytes moved and held; its values come back
                      rounded)
  demote_in_place     a running sequence's cold pages (full, unshared, not a reused
                      prefix-cache page, oldest first) are re-encoded on the device at fewer
                      bits, int8 or int4, in a mixed-precision pool (`kvjax.kv.mixed`): the
                      sequence keeps running and the bytes its pages free go to the sequences
                      that need them
  keep                which cached prefix pages stay on the device longest: the prefix cache
                      evicts every other unreferenced page first (to the host tier, when the
                      engine has one), then these in the order given
  prefetch            the order swapped sequences come back in
  to_host             running sequences whose full pages move to the host pool now, where
                      their decode attention runs beside the device's step (host-resident
                      rows, `kvjax.engine.host_rows`): they free device pages without
                      stalling
  reserve             the device pages the queued sequences it protects need to run: a row
                      it moved to the host stays there until the free pages cover these
                      and its own

SLOs and degradation (`SLO`): a request may carry a TTFT and a TPOT target and a KL budget,
the most quality (mean KL per token against exact KV, from the measured tables the controller
is given) it accepts to lose. When the engine cannot meet every SLO, the controller degrades
in a stated order: only a sequence ranked lower than the one that benefits, lowest priority
first, then the most slack (no SLO = infinite slack); and within its KL budget only. A
degraded request is slowed (deferred, preempted, swapped) or made lossy (fewer tokens kept,
a rounded host copy); it is never dropped.

Controllers are registered by name (`CONTROLLERS`, `register_controller`, `make_controller`):

  fixed        no decisions: the engine's configured settings (the baseline)
  admission    SLO-aware admission only: requests that can still meet their TTFT by
               earliest deadline, higher priority first
  preemption   preemption only: lower-ranked running sequences recomputed for higher-ranked
               waiting ones, victims in degradation order
  tiers        the host tier only: lower-ranked running sequences swapped out, brought back
               most urgent first
  retention    retention only: lower-ranked sequences keep fewer tokens (budgets within
               their KL budget)
  codec        codec demotion only: every swapped copy at the fewest bits within the KL
               budget
  inplace      in-place demotion only: lower-ranked running sequences' cold pages at fewer
               bits, within their KL budgets, to make room for higher-ranked waiting ones
  prefix       prefix retention only: reused cached pages kept longest, by expected reuse
  joint        all of the above, each step choosing per victim the action of least
               estimated cost per page freed: time + energy + quality, against the slack of
               the requests that benefit; with `ControlState.host_rows` (the split
               policy's rates) a host-resident row is one more action beside swap and
               recompute

The engine offers host rows to a controller when it holds a host pool (`host_split` other than
'never'): the scheduler's `ControllerAdapter` fills `ControlState.host_rows` from the split
policy's rates and moves each `Decisions.to_host` row's full pages there;
`kvjax.bench.host_attention` prices the choice on a simulated clock. The controller owns
where such a row lives: the split policy (`neo` among them) brings it back only once the
device's free pages cover `Decisions.reserve`, the pages the controller moved it out for, and
its own (`kvjax.scheduler.placement.HostPlacement`); until then the policy's targets for it
are not applied, so a row moved out to make room does not come straight back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from kvjax.memory.prefix_cache import CachedPage
from kvjax.registry import Registry

INF = math.inf


@dataclasses.dataclass(frozen=True)
class SLO:
    """A request's service targets.

    Attributes:
      ttft_s: time to first token, seconds from arrival; None: none.
      tpot_s: time per output token after the first, seconds; None: none.
      kl_budget: the most estimated KL (nats per token, against exact KV) a controller may
        spend on this request; 0: exact KV only; None: unbounded.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    kl_budget: float | None = 0.0

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s", "kl_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value >= 0):
                raise ValueError(f"SLO {name} must be None or a number >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SeqState:
    """What a controller sees of one unfinished sequence.

    Attributes:
      status: "waiting", "running" or "swapped".
      age_s: seconds since its request arrived.
      pages_held: device pages it holds now.
      cached_tokens: tokens whose KV it holds (device or host).
      slack_s: seconds until its next deadline (TTFT before its first token, then the TPOT
        deadline of its next token); negative when behind; INF without an SLO, and once its
        TTFT was missed (its SLO is lost: nothing left to protect).
      retention_budget: tokens it keeps (None: all).
      kl_spent: estimated KL of the degradations applied to it so far.
      kl_budget: its SLO's KL budget (None: unbounded).
      demoted_bits: the fewest bits a host copy of its KV was rounded to (0: exact).
      num_preemptions: times it was preempted so far.
      pages_at: {bits: its full unshared device pages at that class that may be demoted
        (reused prefix-cache pages stay exact)} in a mixed-precision pool (0: exact); empty:
        none can be demoted in place.
      inplace_bits: the coarsest class its pages were demoted to in place (0: none).
    """

    seq_id: str
    request_id: str
    tenant: str | None
    priority: int
    status: str
    age_s: float
    num_tokens: int
    num_computed: int
    cached_tokens: int
    pages_held: int
    slack_s: float
    retention_budget: int | None
    kl_spent: float
    kl_budget: float | None
    demoted_bits: int = 0
    num_preemptions: int = 0
    pages_at: Mapping[int, int] = dataclasses.field(default_factory=dict)
    inplace_bits: int = 0

    @property
    def kl_left(self) -> float:
        return INF if self.kl_budget is None else self.kl_budget - self.kl_spent


@dataclasses.dataclass(frozen=True)
class ControlState:
    """A snapshot of the engine for one step's decisions (plain data).

    Attributes:
      now: the engine's clock.
      page_size, num_pages: the device pool.
      free_pages: pages an allocation can take now (free + cached prefix pages it may evict).
      max_num_seqs: sequences that may run at once.
      kv_bytes_per_token: device bytes per cached token.
      swap_bytes_per_s, recompute_tokens_per_s: transfer and prefill rate estimates.
      can_swap: sequences may be swapped to host memory.
      demote_ratios: {bits: a page's bytes over its copy's} for each precision a swapped
        copy may be stored at (8, 4); empty: no demotion.
      retention_range: (least, most) tokens `Decisions.retention` may set as a sequence's
        budget; None without an evicting retention policy.
      seqs: every unfinished, unpaused sequence.
      cached: the unreferenced prefix-cache pages (reuse count, release time, depth in their
        chain), least recently released first: what an allocation evicts.
      host_room_bytes: bytes the host tier takes before it evicts (inf: host memory
        unbounded, no tier budget).
      spills_cached: an evicted cached page goes to the host tier (else it is lost).
      host_rows: the rates of host-resident rows, which the "host" action needs; None: the
        engine has none.
      inplace_ratios: {bits: a page's bytes at the write class over its bytes at that class}
        for each class a running sequence's pages may be demoted to in place (a
        mixed-precision pool; the write class has ratio 1); empty: no in-place demotion.
        `free_pages` then counts the bytes free in pages of the write class.
    """

    now: float
    page_size: int
    num_pages: int
    free_pages: int
    max_num_seqs: int
    kv_bytes_per_token: float
    swap_bytes_per_s: float
    recompute_tokens_per_s: float
    can_swap: bool
    demote_ratios: Mapping[int, float]
    retention_range: tuple[int, int] | None
    seqs: tuple[SeqState, ...]
    cached: tuple[CachedPage, ...] = ()
    host_room_bytes: float = INF
    spills_cached: bool = False
    host_rows: HostRowRates | None = None
    inplace_ratios: Mapping[int, float] = dataclasses.field(default_factory=dict)

    def with_status(self, status: str) -> list[SeqState]:
        return [s for s in self.seqs if s.status == status]


@dataclasses.dataclass(frozen=True)
class HostRowRates:
    """What moving a running sequence's pages to the host pool costs, from the host split
    policy's rates (`kvjax.scheduler.host_split.Neo`, measured with
    `kvjax.bench.host_attention.measure_attention_rate`).

    Attributes:
      free_host_pages: pages the host pool takes now.
      host_tokens_per_s: tokens of KV the host's decode attention reads per second (one query).
      device_step_s: the device's time for a step, which host attention runs beside.
    """

    free_host_pages: int
    host_tokens_per_s: float
    device_step_s: float


class Demotion(NamedTuple):
    """A swapped copy stored at `bits` (8 or 4), costing `kl` more estimated KL."""

    bits: int
    kl: float


@dataclasses.dataclass(frozen=True)
class Decisions:
    """One step's decisions (see the module docstring); empty: the configured behaviour.

    Attributes:
      admit_order: queued (waiting and swapped) sequences in the order they enter, ranked
        together; else prefetch: swapped ones in the order they come back (before waiting
        ones, as without a controller). Sequences not named follow in the policy's order.
      offload: running sequences preempted now, each as `swap` says.
      victims: the order running sequences are preempted in when pages run out mid-step.
      swap: per sequence, True to swap its KV to host memory when preempted, False to drop
        and recompute it (unnamed: the engine's preemption mode).
      retention: per sequence, its new retention budget (None: keep every token).
      kl: per sequence, the estimated KL it has spent once this step's retention applies.
      demote: per sequence, the precision its host copy is stored at if it is swapped from now
        on, and the KL that adds.
      demote_in_place: per running sequence, the precision its cold pages are re-encoded at
        now (`kl` holds what it has spent once they are).
      keep: cached prefix pages evicted last, least valuable first (empty: plain LRU).
      to_host: running sequences whose full pages move to the host pool now (host-resident
        rows: they keep decoding, their attention over those pages on the host).
      reserve: device pages the queued sequences it makes room for need to run (the same
        count it frees pages against); a `to_host` row comes back from the host pool only
        when the free pages cover these and its own.
      admit_reserve: device pages a new sequence's admission must leave free beside its own:
        the running sequences' next pages that in-place demotion cannot make (0: none).
    """

    admit_order: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    victims: tuple[str, ...] = ()
    swap: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    retention: Mapping[str, int | None] = dataclasses.field(default_factory=dict)
    kl: Mapping[str, float] = dataclasses.field(default_factory=dict)
    demote: Mapping[str, Demotion] = dataclasses.field(default_factory=dict)
    demote_in_place: Mapping[str, int] = dataclasses.field(default_factory=dict)
    keep: tuple[int, ...] = ()
    prefetch: tuple[str, ...] = ()
    to_host: tuple[str, ...] = ()
    reserve: int = 0
    admit_reserve: int = 0


class KVController(Protocol):
    """Decides, once per step, from a ControlState; must not keep references into it.

    manages_retention: sequences start keeping every token and the controller sets their
      budgets (else they keep the engine's configured retention budget).
    """

    name: str
    manages_retention: bool

    def decide(self, state: ControlState) -> Decisions: ...


def degradation_key(seq: SeqState) -> tuple:
    """Who is degraded first (smallest first): lowest priority, then the most slack."""
    return (seq.priority, -seq.slack_s, -seq.age_s)


# ----------------------------------------------------------------------------- the controller


_ACTIONS = frozenset({"admit", "recompute", "swap", "retain", "demote", "demote_in_place",
                      "keep", "host"})


class CostController:
    """The joint controller, and with fewer `actions` each single-behaviour baseline.

    actions: which decisions it may take: "admit" (admission order), "recompute" and "swap"
      (preempt a lower-ranked running sequence, dropping or moving its KV), "retain" (shrink a
      sequence's retention budget), "demote" (int8 / int4 host copies of swapped sequences),
      "demote_in_place" (int8 / int4 re-encoding of running sequences' cold pages in a
      mixed-precision pool), "keep" (which cached prefix pages stay longest), "host" (move a
      running sequence's full pages to the host pool, where its attention runs beside the
      device's step; needs `ControlState.host_rows`).
    retention_kl: {budget: mean KL per token} measured for the engine's retention policy
      (`kvjax.bench.controller.measure_kl_tables`); a budget missing here is never chosen.
    demote_kl: {bits: mean KL per token} of copies of exact KV rounded to int8 / int4 (a
      number: int8's alone); a precision missing here is never chosen. In-place demotion is
      priced with the same table: rounding only a sequence's cold pages costs at most what
      rounding all of its KV does, so the table bounds the KL it spends.
    kl_cost_s: seconds of delay one nat of KL is worth (the quality term of the cost).
    miss_cost_s: seconds a victim's missed deadline is worth: preempting a sequence stalls it
      at least as long as the prefill of the sequence it makes room for (plus its own
      recompute or transfer), so a preemption that would outlast the victim's slack costs
      this much more (retention keeps it running).
    joules_per_byte, joules_per_token, energy_cost_s: the energy term: bytes moved and
      tokens recomputed priced in joules, and seconds one joule is worth.
    max_preemptions: a sequence preempted this often is not offloaded by a decision again
      (only retention may still free its pages; it can still be the victim when pages run
      out mid-step): bounds the TPOT tail of a repeatedly chosen victim. None: no bound.
    keep_horizon_s: with "keep", a cached page's reuses count less the longer it sits idle:
      its value is hits / (1 + idle / keep_horizon_s).
    host_horizon_steps: with "host", the decode steps a host-resident row is priced over:
      each costs the time its host attention runs past the device's step.
    reserve_growth: with "demote_in_place", admissions leave free a page for each running
      sequence's next page beyond what demoting their cold pages frees
      (`Decisions.admit_reserve`): pages kept exact (`SeqState.pages_at` leaves them out)
      free nothing, so a sequence admitted into them would be preempted as they grow.
    """

    def __init__(self, name: str, actions: frozenset[str], *,
                 retention_kl: Mapping[Any, float] | None = None,
                 demote_kl: float | Mapping[Any, float] = 0.0,
                 kl_cost_s: float = 10.0, miss_cost_s: float = 5.0,
                 joules_per_byte: float = 0.0,
                 joules_per_token: float = 0.0, energy_cost_s: float = 0.0,
                 max_preemptions: int | None = None, keep_horizon_s: float = 60.0,
                 host_horizon_steps: int = 32, reserve_growth: bool = False):
        unknown = sorted(set(actions) - _ACTIONS)
        if unknown:
            raise ValueError(f"controller actions {unknown} unknown; known: {sorted(_ACTIONS)}")
        self.name = name
        self.actions = frozenset(actions)
        self.manages_retention = "retain" in self.actions
        self.retention_kl = {int(b): float(k) for b, k in (retention_kl or {}).items()}
        if not isinstance(demote_kl, Mapping):
            demote_kl = {8: demote_kl}
        self.demote_kl = {int(b): float(k) for b, k in demote_kl.items()}
        if max_preemptions is not None and not (isinstance(max_preemptions, int)
                                                and max_preemptions >= 1):
            raise ValueError(f"max_preemptions must be None or an int >= 1, got "
                             f"{max_preemptions!r}")
        if not keep_horizon_s > 0:
            raise ValueError(f"keep_horizon_s must be > 0, got {keep_horizon_s!r}")
        self.max_preemptions = max_preemptions
        self.host_horizon_steps = host_horizon_steps
        self.reserve_growth = bool(reserve_growth)
        self.keep_horizon_s = float(keep_horizon_s)
        self.kl_cost_s = float(kl_cost_s)
        self.miss_cost_s = float(miss_cost_s)
        self.joules_per_byte = float(joules_per_byte)
        self.joules_per_token = float(joules_per_token)
        self.energy_cost_s = float(energy_cost_s)

    # The estimated cost, in seconds, of freeing one victim's pages one way.
    def _cost(self, seconds: float, nbytes: float, tokens: float, kl: float) -> float:
        joules = self.joules_per_byte * nbytes + self.joules_per_token * tokens
        return seconds + self.energy_cost_s * joules + self.kl_cost_s * kl

    def _options(self, s: SeqState, state: ControlState, stall_s: float = 0.0, *,
                 may_stall: bool = True) -> list[tuple[float, int, str, Any]]:
        """(cost per page freed, pages freed, action, argument) for each way to free a victim's
        pages; a preempted victim waits about `stall_s` before it runs again (only retention
        when not `may_stall`)."""
        held = max(s.pages_held, 1)
        kv_bytes = s.cached_tokens * state.kv_bytes_per_token

        def preempt_cost(seconds: float, nbytes: float, tokens: float, kl: float) -> float:
            delay = stall_s + seconds
            miss = self.miss_cost_s if s.slack_s < delay else 0.0
            return (self._cost(delay, nbytes, tokens, kl) + miss) / held

        out = []
        if "recompute" in self.actions and may_stall:
            t = s.num_computed / state.recompute_tokens_per_s
            out.append((preempt_cost(t, 0, s.num_computed, 0.0), s.pages_held, "recompute",
                        None))
        if "swap" in self.actions and state.can_swap and may_stall:
            t = 2 * kv_bytes / state.swap_bytes_per_s
            out.append((preempt_cost(t, 2 * kv_bytes, 0, 0.0), s.pages_held, "swap", None))
            for demotion in self._demotions(s, state):
                moved = 2 * kv_bytes / state.demote_ratios[demotion.bits]
                out.append((preempt_cost(moved / state.swap_bytes_per_s, moved, 0,
                                         demotion.kl), s.pages_held, "swap", demotion))
        host = self._host_option(s, state, held, kv_bytes)
        if host is not None:
            out.append(host)
        if "retain" in self.actions and state.retention_range is not None:
            low, high = state.retention_range
            for b in sorted(b for b in self.retention_kl if low <= b <= high):
                extra = self.retention_kl[b] - self.retention_kl.get(s.retention_budget, 0.0)
                freed = s.pages_held - -(-(b + state.page_size) // state.page_size)
                if (s.retention_budget is None or b < s.retention_budget) and freed > 0 \
                        and extra <= s.kl_left:
                    out.append((self._cost(0.0, 0, 0, extra) / freed, freed, "retain", b))
        out.extend(self._in_place(s, state))
        return sorted(out, key=lambda o: o[0])

    def _host_option(self, s: SeqState, state: ControlState, held: int, kv_bytes: float
                     ) -> tuple[float, int, str, Any] | None:
        """A host-resident row: its full pages cross the link once, and it keeps decoding,
        each step slowed by the time its host attention runs past the device's step (priced
        over `host_horizon_steps`; a slowdown past its slack misses its deadline)."""
        rates = state.host_rows
        freed = s.pages_held - 1  # the page being written stays on the device
        if "host" not in self.actions or rates is None or not 0 < freed <= \
                rates.free_host_pages:
            return None
        moved = kv_bytes * freed / held
        excess = max(s.cached_tokens / rates.host_tokens_per_s - rates.device_step_s, 0.0)
        seconds = moved / state.swap_bytes_per_s + excess * self.host_horizon_steps
        miss = self.miss_cost_s if s.slack_s < excess else 0.0
        return (self._cost(seconds, moved, 0, 0.0) + miss) / held, freed, "host", None

    def _in_place(self, s: SeqState, state: ControlState) -> list[tuple[float, int, str, Any]]:
        """In-place demotion of a running sequence's cold pages to each class its KL budget
        allows: pages freed (in pages of the write class, rounded down) and the KL it adds;
        the sequence keeps running, so only quality is paid."""
        if "demote_in_place" not in self.actions or s.status != "running":
            return []
        ratios = dict(state.inplace_ratios)
        out = []
        for bits in (b for b in self.demote_kl if b in ratios and b):
            extra = max(self.demote_kl[bits] - self.demote_kl.get(s.inplace_bits, 0.0), 0.0)
            gain = sum(n * max(1 / ratios.get(c, 1.0) - 1 / ratios[bits], 0.0)
                       for c, n in s.pages_at.items())
            freed = int(gain)
            if freed > 0 and extra <= s.kl_left:
                out.append((self._cost(0.0, 0, 0, extra) / freed, freed, "demote_in_place",
                            bits))
        return out

    def _demotions(self, s: SeqState, state: ControlState) -> list[Demotion]:
        """The precisions its swapped copy may take within its KL budget, each with the KL it
        adds (a copy no finer than one it already went through adds none)."""
        if "demote" not in self.actions:
            return []
        spent = self.demote_kl.get(s.demoted_bits, 0.0)
        out = [Demotion(bits, max(kl - spent, 0.0)) for bits, kl in self.demote_kl.items()
               if bits in state.demote_ratios]
        return sorted((d for d in out if d.kl <= s.kl_left), key=lambda d: -d.bits)

    def _keep(self, state: ControlState) -> tuple[int, ...]:
        """The cached pages reused so far, least valuable first: a page is worth its reuses,
        discounted the longer it sits idle (every page's miss costs the same: its tokens
        recomputed, or reloaded from the host tier); among equals the deeper page goes first,
        since evicting a page strands the rest of its chain. Pages never reused are not kept:
        they go first, least recently released first."""
        if "keep" not in self.actions:
            return ()

        def value(c: CachedPage) -> float:
            return c.hits / (1.0 + max(state.now - c.released_at, 0.0) / self.keep_horizon_s)

        reused = sorted((c for c in state.cached if c.hits > 0),
                        key=lambda c: (value(c), -c.depth))
        return tuple(c.page for c in reused)

    @staticmethod
    def _pages_to_run(s: SeqState, page_size: int) -> int:
        """Pages a queued sequence needs to run its next step."""
        tokens = s.cached_tokens if s.status == "swapped" else s.num_tokens - s.num_computed
        return -(-(tokens + 1) // page_size)

    def _queue_order(self, queued: list[SeqState], state: ControlState) -> list[SeqState]:
        """With "admit": higher priority first; among equals those that can still meet their
        deadline, earliest deadline first, then the rest oldest first. Else priority, then
        age."""
        def key(s: SeqState) -> tuple:
            if "admit" not in self.actions:
                return (-s.priority, -s.age_s)
            prefill_s = (s.num_tokens - s.num_computed) / state.recompute_tokens_per_s
            meetable = prefill_s <= s.slack_s < INF
            return (-s.priority, not meetable, s.slack_s if meetable else -s.age_s)
        return sorted(queued, key=key)

    def _room_to_grow(self, running: list[SeqState], victims: list[SeqState],
                      state: ControlState, room: int, in_place: dict, kl: dict,
                      offload: list) -> None:
        """Running sequences whose next token starts a page need pages too (`room`: the free
        pages and those freed for the queued ones so far), else one is preempted mid-step:
        in-place demotion (it stalls nobody) makes that room from the lowest-ranked running
        sequences' cold pages, cheapest first, within their KL budgets."""
        if "demote_in_place" not in self.actions or not state.inplace_ratios:
            return
        growth = sum(max(-(-s.num_tokens // state.page_size) - s.pages_held, 0)
                     for s in running)
        short = growth - room
        for s in victims:
            if short <= 0:
                break
            if s.seq_id in in_place or s.seq_id in offload:
                continue
            options = self._in_place(s, state)
            if not options:
                continue
            _, freed, _, bits = min(options, key=lambda o: o[0])
            in_place[s.seq_id] = bits
            kl[s.seq_id] = s.kl_spent + max(
                self.demote_kl[bits] - self.demote_kl.get(s.inplace_bits, 0.0), 0.0)
            short -= freed

    def _admit_reserve(self, running: list[SeqState], state: ControlState,
                       in_place: Mapping[str, int]) -> int:
        """With `reserve_growth`: a page for each running sequence's next page, less the
        pages demoting its cold pages still frees (none once this step demotes it)."""
        if not self.reserve_growth or not state.inplace_ratios:
            return 0
        freeable = sum(max((o[1] for o in self._in_place(s, state)), default=0)
                       for s in running if s.seq_id not in in_place)
        return max(len(running) - freeable, 0)

    def decide(self, state: ControlState) -> Decisions:
        running = state.with_status("running")
        queued = self._queue_order(state.with_status("waiting") + state.with_status("swapped"),
                                   state)
        victims = sorted(running, key=degradation_key)
        # How a sequence preempted mid-step (pages ran out) leaves: the cheapest way.
        swap, demote = {}, {}
        for s in victims:
            options = [o for o in self._options(s, state) if o[2] in ("swap", "recompute")]
            if options and {"swap", "recompute"} <= self.actions:
                swap[s.seq_id] = options[0][2] == "swap"
                if options[0][3]:
                    demote[s.seq_id] = options[0][3]
            demotions = self._demotions(s, state)
            if self.actions == {"demote"} and demotions:
                demote[s.seq_id] = demotions[-1]  # the fewest bits the budget allows
        # Pages the queued sequences that can still meet a deadline need beyond the free ones;
        # they are freed from lower-ranked running sequences, cheapest way first.
        offload, retention, kl, to_host, in_place = [], {}, {}, [], {}
        deficit, beneficiary, stall_s = -state.free_pages, None, 0.0
        for s in queued[:max(state.max_num_seqs - len(running), 0)]:
            if not 0 <= s.slack_s < INF:
                continue  # no deadline to protect (none, or already missed)
            deficit += self._pages_to_run(s, state.page_size)
            stall_s += (s.num_tokens - s.num_computed) / state.recompute_tokens_per_s
            beneficiary = beneficiary or s
        needed = deficit + state.free_pages  # by the queued sequences
        for s in victims if deficit > 0 and beneficiary is not None else ():
            if deficit <= 0 or degradation_key(s) >= degradation_key(beneficiary):
                break
            # A victim of the beneficiary's priority is only stalled if it can afford to, and
            # none is offloaded again once preempted max_preemptions times.
            may_stall = ((s.priority < beneficiary.priority or s.slack_s >= stall_s)
                         and (self.max_preemptions is None
                              or s.num_preemptions < self.max_preemptions))
            options = self._options(s, state, stall_s, may_stall=may_stall)
            if not options:
                continue
            _, freed, action, arg = options[0]
            if action == "host":
                to_host.append(s.seq_id)
            elif action == "retain":
                retention[s.seq_id] = arg
                kl[s.seq_id] = s.kl_spent + self.retention_kl[arg] - self.retention_kl.get(
                    s.retention_budget, 0.0)
            elif action == "demote_in_place":
                in_place[s.seq_id] = arg
                kl[s.seq_id] = s.kl_spent + max(
                    self.demote_kl[arg] - self.demote_kl.get(s.inplace_bits, 0.0), 0.0)
            else:
                offload.append(s.seq_id)
                swap[s.seq_id] = action == "swap"
                if arg:
                    demote[s.seq_id] = arg
            deficit -= freed
        self._room_to_grow(running, victims, state, needed - deficit,  # free + freed
                           in_place, kl, offload)
        # A controller that preempts ranks the queue itself: a victim must not come back
        # before the sequence it made room for (swapped ones otherwise go first).
        ranks = self.actions & {"admit", "swap", "recompute"}
        return Decisions(
            admit_order=tuple(s.seq_id for s in queued) if ranks else (),
            offload=tuple(offload),
            victims=tuple(s.seq_id for s in victims)
            if self.actions - {"admit", "demote", "demote_in_place", "keep"} else (),
            swap=swap, retention=retention, kl=kl, demote=demote, demote_in_place=in_place,
            keep=self._keep(state), to_host=tuple(to_host), reserve=needed,
            admit_reserve=self._admit_reserve(running, state, in_place))


class FixedController:
    """No decisions: the engine's configured behaviour (today's fixed settings)."""

    name = "fixed"
    manages_retention = False

    def decide(self, state: ControlState) -> Decisions:
        return Decisions()


_BEHAVIOURS = {
    "admission": {"admit"},
    "preemption": {"recompute"},
    "tiers": {"swap"},
    "retention": {"retain"},
    "codec": {"demote"},
    "inplace": {"demote_in_place"},
    "prefix": {"keep"},
    "joint": set(_ACTIONS),
}

CONTROLLERS = Registry("controller", {"fixed": lambda **options: FixedController()})
CONTROLLERS.update({name: functools.partial(CostController, name, frozenset(actions))
                    for name, actions in _BEHAVIOURS.items()})


def register_controller(name: str, factory: Callable[..., KVController]) -> None:
    """Makes `factory(**options) -> KVController` constructible by `name`."""
    CONTROLLERS.register(name, factory)


def make_controller(name: str, **options: Any) -> KVController:
    """The registered controller `name` made with `options`."""
    return CONTROLLERS.make(name, **options)
