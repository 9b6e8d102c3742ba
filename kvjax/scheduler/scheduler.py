"""The scheduler: which sequences run in the next step, and what their results change.

Pure host code. `schedule()` forms one step: decode rows for the running sequences first
(preempting from the bottom of the policy's ranking when pages run out), then prefill chunks of
partially computed, swapped-out and waiting sequences under a per-step token budget; it returns
the plan as a `SchedulerOutput`. `update_from_output()` commits the step's tokens: prefix-cache
commits, retention decisions, n > 1 forks, stop checks and finished outputs. Memory goes
through the `KVCacheManager`; the scheduler never touches the device pool itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from kvjax import grammar as grammar_lib
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.memory.ops import KVOp
from kvjax.memory.prefix_cache import HitLedger, page_hash_chain
from kvjax.sampling_params import SamplingParams
from kvjax.scheduler import host_split as host_split_lib
from kvjax.scheduler.chunks import ChunkReuse
from kvjax.scheduler.context import ReuseStrategy
from kvjax.scheduler.controller import (
    INF,
    ControlState,
    Decisions,
    FixedController,
    KVController,
    SeqState,
)
from kvjax.scheduler.echo import EchoPlanner
from kvjax.scheduler.host_split import HostSplitPolicy, RowPlacement
from kvjax.scheduler.inplace import InPlaceDemotion
from kvjax.scheduler.output import RunnerOutput, ScheduledRow, SchedulerOutput
from kvjax.scheduler.policies import LongestPrefixMatch, SchedulingPolicy
from kvjax.scheduler.preemption import PreemptionMode, decide_preemption
from kvjax.scheduler.request import FinishReason, SeqStatus, Sequence, WeightUpdatePolicy
from kvjax.scheduler.requests import RequestRegistry
from kvjax.scheduler.spec import Drafter, NoDrafts
from kvjax.scheduler.tenants import TenantActivity
from kvjax.scheduler.tiered import TierAdmission
from kvjax.shapes import pages_for


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The limits and modes the scheduler works under (from the engine's `EngineConfig`).

    Attributes:
      max_num_seqs, max_num_batched_tokens, max_prefill_chunk, max_prefill_seqs, page_size:
        as in EngineConfig.
      max_model_len: the context limit (page-rounded).
      is_paged: the pool is paged (swapping and page-level admission apply).
      preemption_mode: RECOMPUTE, SWAP or AUTO.
      kv_bytes_per_token: device bytes one cached token takes (the swap cost model's input).
      kv_bytes_held: bytes a sequence of n cached tokens holds (`KVCacheSpec.bytes_held`: a
        sliding-window layer keeps only its window), which the swap cost model prices; None:
        n * kv_bytes_per_token.
      swap_bandwidth_bytes_per_s: measured or configured device<->host rate (AUTO).
      recompute_tokens_per_s: configured recompute rate (AUTO); None: measured from the steps.
      max_inflight_loads: tier loads in flight at once.
      eos_token_ids: tokens that stop a sequence unless it ignores EOS.
      max_pages_held: pages a sequence of n tokens holds at most (a retention policy bounds it).
      prefill_buckets: the padded prefill-token totals of a step (the runner's buckets).
      prefill_padding_limit: as in EngineConfig (cut chunks to end on a bucket); None: off.
      num_draft_tokens: gamma, the most draft tokens a sequence verifies in one step
        (`kvjax.scheduler.spec`); 0: no speculative decoding.
      adaptive_drafts: a sequence's draft length follows its last verify step
        (`SpecConfig.adaptive`).
      demote_ratios: {bits: a page's bytes over its copy's at bits} for each precision a
        swapped copy may be demoted to (float pages, the plain swap space); empty: none.
      max_tenant_page_share: as in EngineConfig.
      contended_prefill_chunk, contention_window_s: as in EngineConfig (`TenantActivity`).
      hide_shared_hits: as EngineConfig.hide_shared_prefix_hits (a `HitLedger` caps what a
        tenant hits under a shared cache salt).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_chunk: int
    max_prefill_seqs: int
    page_size: int
    max_model_len: int
    is_paged: bool
    preemption_mode: PreemptionMode
    kv_bytes_per_token: float
    kv_bytes_held: Callable[[int], float] | None = None
    swap_bandwidth_bytes_per_s: float | None = None
    recompute_tokens_per_s: float | None = None
    max_inflight_loads: int = 1
    eos_token_ids: tuple[int, ...] = ()
    prefill_buckets: tuple[int, ...] = ()
    prefill_padding_limit: float | None = None
    num_draft_tokens: int = 0
    adaptive_drafts: bool = False
    demote_ratios: Mapping[int, float] = dataclasses.field(default_factory=dict)
    max_tenant_page_share: float | None = None
    contended_prefill_chunk: int | None = None
    contention_window_s: float = 15.0
    hide_shared_hits: bool = False


# A controller's estimate of the swap rate when the engine measured none.
_DEFAULT_SWAP_BYTES_PER_S = 10e9

# Draft rows propose the draft's argmax: verification handles deterministic drafts.
_GREEDY_DRAFT = SamplingParams(max_new_tokens=1)


class Scheduler(RequestRegistry, TierAdmission, ChunkReuse):
    """Continuous batching over the sequences of every unfinished request.

    Attributes:
      config: the SchedulerConfig.
      kv_cache: the KVCacheManager memory decisions go through.
      policy: the SchedulingPolicy ranking sequences (admission order, preemption victims).
      waiting, running, swapped: the queues.
      weights_version: the newest weights version; `versions` every version still served.
      stats: the engine's counters (shared dict) this scheduler adds to.
      drafter: where speculative draft tokens come from (`kvjax.scheduler.spec`).
      reuse_strategies: context-reuse strategies by name (`kvjax.scheduler.context`); a
        name not in it is made with its default options.
      controller: the KV controller consulted at the start of every `schedule()`
        (`kvjax.scheduler.controller`); its last decisions are `decisions`.
      host_split: how many pages of each decode row live in the host pool
        (`kvjax.scheduler.host_split`).
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 policy: SchedulingPolicy, *, cache_key: Callable[[str | None, str], bytes],
                 clock: Callable[[], float], stats: dict, weights_version: str, tokenizer=None,
                 drafter: Drafter | None = None,
                 reuse_strategies: dict[str, ReuseStrategy] | None = None,
                 controller: KVController | None = None,
                 host_split: HostSplitPolicy | None = None):
        self.config = config
        self.host_split = host_split or host_split_lib.Never()
        retention = kv_cache.retention.policy
        self.echo = None if retention.echo_prefetch is None else EchoPlanner(
            kv_cache, config.page_size, retention.num_read_pages, retention.echo_prefetch,
            stats)
        self.kv_cache = kv_cache
        self.policy = policy
        self._cache_key = cache_key
        self._ledger = HitLedger() if config.hide_shared_hits else None
        self._activity = (None if config.contended_prefill_chunk is None
                          else TenantActivity(config.contention_window_s))
        self.clock = clock
        self.stats = stats
        self.tokenizer = tokenizer
        self.weights_version = weights_version
        self.versions = [weights_version]
        self.drafter = drafter or NoDrafts()
        self.controller = controller or FixedController()
        self.decisions = Decisions()
        self.in_place = InPlaceDemotion(None)  # a mixed-precision pool's (set by the engine)
        if self.controller.manages_retention and kv_cache.retention.policy.evicts:
            kv_cache.retention.default_budget = None  # exact until the controller decides
        self._init_chunks(reuse_strategies)
        self.stats.update(steps=0, preemptions=0, prefill_tokens=0, decode_tokens=0,
                          preemption_decisions=[], step_time_s=0.0, spec_draft_steps=0,
                          spec_verify_rows=0, spec_proposed=0, spec_accepted=0, demoted_swaps=0,
                          host_offloads=0)
        if isinstance(policy, LongestPrefixMatch):
            policy.cached_tokens = self._peek_cached_tokens
        self._init_registry()
        self._init_tiers()

    def cache_key(self, seq: Sequence) -> bytes:
        """The provenance fingerprint a sequence's pages are cached under.

        A chunk fill's pages are chunk-cache entries (the chunk marker); a sequence that copies
        chunks in holds KV that depends on the strategy and the spans, which its key names."""
        if seq.is_chunk_fill:
            return self._chunk_key(seq)
        key = self.prefix_cache_key(seq.tenant, self._cache_salt(seq), seq.weights_version)
        strategy = self.strategy(seq.context_reuse)
        if seq.chunk_spans and strategy.reuses:
            spans = ",".join(f"{a}-{b}" for a, b in seq.chunk_spans)
            key += f"|reuse={strategy.fingerprint}|spans={spans}".encode()
        return key

    def prefix_cache_key(self, tenant: str | None, cache_salt: str | None,
                         weights_version: str) -> bytes:
        """The cache key of a plain prompt's pages: its tenant's provenance, or under a shared
        `cache_salt`, the default tenant's with the salt (shared by every tenant naming it)."""
        if cache_salt is None:
            return self._cache_key(tenant, weights_version)
        return self._cache_key(None, weights_version) + b"|salt=" + cache_salt.encode()

    def _cache_salt(self, seq: Sequence) -> str | None:
        meta = self._request_meta.get(seq.request_id)
        return None if meta is None else meta.get("cache_salt")

    def _hit_cap(self, seq: Sequence, key: bytes) -> int | None:
        """At most how many leading tokens the sequence may hit (None: any): under a shared
        salt with `hide_shared_hits`, the pages its tenant has paid for (`HitLedger`)."""
        if self._ledger is None or self._cache_salt(seq) is None:
            return None
        hashes = page_hash_chain(seq.tokens[:-1], key, self.config.page_size)
        return self._ledger.allowed_pages(seq.tenant, hashes) * self.config.page_size

    def _pay_for_pages(self, seq: Sequence) -> None:
        """Records the full prompt pages a sequence computed as paid for by its tenant."""
        if self._ledger is None or seq.is_chunk_fill or self._cache_salt(seq) is None:
            return
        # Each chunk hashes only its new full pages: the chain so far is kept on the sequence
        # (until its cache key changes with the weights).
        key, (paid_key, known) = self.cache_key(seq), seq.paid_chain
        known = known if paid_key == key else []
        done = seq.tokens[:min(seq.num_computed, seq.num_prompt_tokens)]
        hashes = page_hash_chain(done, key, self.config.page_size, known)
        self._ledger.record(seq.tenant, hashes[len(known):])
        seq.paid_chain = (key, hashes)

    def _peek_cached_tokens(self, seq: Sequence) -> int:
        if seq.status is not SeqStatus.WAITING:
            return 0
        key = self.cache_key(seq)
        return self.kv_cache.peek_cached_tokens(seq.tokens, key, self._hit_cap(seq, key))

    def _ranked(self, seqs: list[Sequence], first: tuple[str, ...] = ()) -> list[Sequence]:
        """The policy's order; sequences named in `first` (a controller's order) before it."""
        ranked = sorted(seqs, key=self.policy.priority_key)
        if not first:
            return ranked
        where = {seq_id: i for i, seq_id in enumerate(first)}
        return sorted(ranked, key=lambda s: where.get(s.seq_id, len(where)))

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """The running sequence preempted next: the controller's first victim among the
        candidates, else the lowest ranked."""
        by_id = {s.seq_id: s for s in candidates}
        for seq_id in self.decisions.victims:
            if seq_id in by_id:
                return by_id[seq_id]
        return self._ranked(candidates)[-1]

    def _tenant_pages(self, tenant: str | None) -> int:
        """Distinct device pages the tenant's running sequences hold (a shared prefix once)."""
        return len(set().union(*(self.kv_cache.block_table(s.seq_id) for s in self.running
                                 if s.tenant == tenant)))

    def _over_tenant_share(self, seq: Sequence) -> bool:
        """Whether a waiting sequence's tenant already holds its share of the pool
        (`max_tenant_page_share`) while another tenant waits: then it waits too. Alone, a
        tenant may take the whole pool (the limit never idles pages)."""
        share = self.config.max_tenant_page_share
        if share is None or all(s.tenant == seq.tenant for s in self.waiting):
            return False
        return self._tenant_pages(seq.tenant) >= share * self.kv_cache.num_pages

    def _reclaim_share(self) -> list[str]:
        """Preempts one running sequence of a tenant over its share (`max_tenant_page_share`)
        when the first waiting sequence of a tenant under it finds no room for its first
        chunk: the lowest ranked such sequence, so the pages it frees admit the waiting one.
        Returns the preempted ids (none without a share)."""
        share = self.config.max_tenant_page_share
        if share is None:
            return []
        limit = share * self.kv_cache.num_pages
        held = {t: self._tenant_pages(t)
                for t in {s.tenant for s in self.running + self.waiting}}
        under = next((s for s in self._ranked(self.waiting) if held[s.tenant] < limit), None)
        if under is None:
            return []
        first_chunk = min(under.num_pending, self.config.max_prefill_chunk)
        if self.kv_cache.can_admit(pages_for(first_chunk, self.config.page_size)):
            return []
        candidates = [s for s in self.running if s.tenant != under.tenant
                      and held[s.tenant] > limit and not self._awaits_step_in_flight(s)]
        if not candidates:
            return []
        hog = self._victim(candidates)
        self._preempt(hog)
        return [hog.seq_id]

    def _chunk_limit(self, seq: Sequence, now: float) -> int:
        """The longest prefill chunk the sequence may run in this step: `max_prefill_chunk`,
        or `contended_prefill_chunk` while its tenant has been served more than another
        tenant active now or within the contention window (`TenantActivity`)."""
        if self._activity is not None and self._activity.is_over_share(seq.tenant, now):
            return self.config.contended_prefill_chunk
        return self.config.max_prefill_chunk

    def _cached_len(self, seq: Sequence) -> int:
        return self.kv_cache.cached_len(seq.seq_id, seq.num_computed)

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
            return self._form_step(speculate)
        finally:
            self.kv_cache.end_plan()  # a step that failed to form leaves no op unapplied

    def _form_step(self, speculate: bool) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        self.fills_requested = False
        self._poll_tiers()
        decode: list[tuple[Sequence, int]] = []
        prefill: list[tuple[Sequence, int]] = []
        preempted = self._control() + self._reclaim_share()
        offloaded = set(preempted)
        now = 0.0  # read only by the contended-chunk rule
        if self._activity is not None:
            now = self.clock()
            self._activity.observe({s.tenant for s in self.running + self.waiting + self.swapped},
                                   now)
        scheduled: set[str] = set()
        active = self.active_version()
        drafting: set[str] = set()
        speculate = speculate and cfg.num_draft_tokens > 0
        decoding = [s for s in self._ranked(self.running)
                    if s.status is SeqStatus.RUNNING and s.num_pending == 1
                    and s.weights_version == active and not self._is_done(s)]
        is_draft_step = speculate and self.drafter.runs_draft_steps and any(
            len(s.draft_tokens) < self._max_drafts(s) for s in decoding)
        verifies = speculate and not is_draft_step
        # 1. Decode rows for running sequences, highest ranked first; preempt from the bottom.
        # With speculation a row drafts one token (a draft step) or verifies its drafts.
        for seq in decoding:
            if seq.status is not SeqStatus.RUNNING:  # preempted for a higher-ranked row
                continue
            if len(decode) >= cfg.max_num_seqs or budget < 1:
                break
            if is_draft_step and len(seq.draft_tokens) >= self._max_drafts(seq):
                continue  # its drafts are ready: it waits for the verify step
            if verifies:
                self._propose(seq, budget - 1)
            offset = len(seq.draft_tokens) if is_draft_step else 0
            width = 1 + len(seq.draft_tokens) if verifies else 1
            while True:
                cached = self._cached_len(seq) + offset
                if self.kv_cache.allocate(seq.seq_id, cached, cached + width):
                    decode.append((seq, width))
                    scheduled.add(seq.seq_id)
                    if is_draft_step:
                        drafting.add(seq.seq_id)
                    budget -= width
                    break
                if self.host_split.offloads_when_full and self._offload_a_row():
                    continue  # its pages went to the host pool instead of a preemption
                victim = self._victim([s for s in self.running if s.seq_id not in scheduled])
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
        self._place_rows([s for s, _ in decode])
        if self.echo is not None:
            self.echo.place([(s.seq_id, self._cached_len(s)) for s, _ in decode], self._seqs)
        # 2. Prefill chunks: running partial prefills, then swapped, then waiting sequences.
        partial = [s for s in self._ranked(self.running)
                   if s.num_pending > 1 and s.seq_id not in scheduled]
        if self.decisions.admit_order:  # The controller ranks swapped and waiting together.
            queued = self._ranked(self.swapped + self.waiting, self.decisions.admit_order)
        else:
            queued = (self._ranked(self.swapped, self.decisions.prefetch)
                      + self._ranked(self.waiting))
        # A sequence the controller offloaded this step does not come straight back.
        candidates = partial + [s for s in queued if s.seq_id not in offloaded]
        if self.policy.ranks_prefills_together and not self.decisions.admit_order:
            candidates = self._ranked(candidates)
        for seq in candidates:
            # A token still in flight joins only as its own decode row (above).
            if seq.weights_version != active or seq.num_unresolved:
                continue
            if budget <= 0 or len(prefill) >= cfg.max_prefill_seqs:
                break
            if seq.status is SeqStatus.SWAPPED:
                need = pages_for(self._cached_len(seq), cfg.page_size)
                if len(self.running) >= cfg.max_num_seqs or not self.kv_cache.can_admit(need):
                    break
                if not self._swap_in(seq):
                    break
                self.swapped.remove(seq)
                self.running.append(seq)
                if seq.num_pending == 1:
                    cached = self._cached_len(seq)
                    if (len(decode) < cfg.max_num_seqs
                            and self.kv_cache.allocate(seq.seq_id, cached, cached + 1)):
                        decode.append((seq, 1))
                        scheduled.add(seq.seq_id)
                        budget -= 1
                    continue
                # Swapped mid-prefill, or its tier copy came back short: the rest of its KV is
                # computed as prefill chunks, starting now (else "nothing fits" would swap it
                # straight out again).
            is_new = seq.status is SeqStatus.WAITING
            if is_new:
                if len(self.running) >= cfg.max_num_seqs:
                    break
                if self._over_tenant_share(seq) or not self._admit(seq):
                    continue
            limit = self._reuse_chunks(seq)
            if not limit:  # Its next chunk is being filled, or its copy finds no room.
                if is_new:
                    self.kv_cache.unregister(seq.seq_id)
                    seq.num_computed = 0
                continue
            chunk = self._fit_to_bucket(sum(n for _, n in prefill),
                                        min(seq.num_pending, budget,
                                            self._chunk_limit(seq, now), limit))
            cached = self._cached_len(seq)
            need = self.kv_cache.pages_needed(seq.seq_id, cached + chunk)
            ok = not is_new or self.kv_cache.can_admit(need)
            if ok:
                ok = self.kv_cache.allocate(seq.seq_id, cached, cached + chunk)
            if not ok:
                if is_new:
                    self.kv_cache.unregister(seq.seq_id)
                    seq.num_computed = 0
                break
            if is_new:
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                self.tracer.emit("schedule", "request", f"request/{seq.request_id}",
                                 seq_id=seq.seq_id, cached_tokens=cached)
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = self.clock()
            prefill.append((seq, chunk))
            scheduled.add(seq.seq_id)
            budget -= chunk
        if (not decode and not prefill and self.running and not self.fills_requested
                and not any(self._awaits_step_in_flight(s) for s in self.running)):
            # Nothing fits: free the lowest-ranked running sequence so the rest can progress
            # (unless chunk fills were just queued: they run next, and their waiters after).
            victim = self._victim(self.running)
            self._preempt(victim)
            preempted.append(victim.seq_id)
        self._prefetch_from_tiers(idle=not decode and not prefill)
        self.kv_cache.spill_evictions()  # Before the step writes to pages evicted above.
        if drafting:
            self.stats["spec_draft_steps"] += 1
        # A decode row's tokens past the first are its drafts in a verify step (a row swapped
        # in during it has none); prefill rows hold prompt tokens only.
        num_drafts = {s.seq_id: n - 1 if verifies else 0 for s, n in decode}
        masks = self._grammar_masks([(s, n, num_drafts.get(s.seq_id, 0))
                                     for s, n in decode + prefill if s.seq_id not in drafting])
        rows = [self._draft_row(s, i) if s.seq_id in drafting
                else self._row(s, n, i, num_drafts[s.seq_id], masks.get(s.seq_id))
                for i, (s, n) in enumerate(decode)]
        if self.echo is not None:
            rows = [dataclasses.replace(r, host_table=self.echo.host_table(r.seq_id),
                                        host_len=0) for r in rows]
        rows += [self._row(s, n, len(decode) + i, masks=masks.get(s.seq_id))
                 for i, (s, n) in enumerate(prefill)]
        return SchedulerOutput(decode=tuple(rows[:len(decode)]), prefill=tuple(rows[len(decode):]),
                               preempted=tuple(preempted), kv_plan=self.kv_cache.take_plan(),
                               kv_ops=self.kv_cache.take_ops(), weights_version=active,
                               blends=self._take_blends())

    def _placement(self, seq: Sequence) -> RowPlacement:
        cached = self._cached_len(seq)  # the position the row writes: its page stays
        return RowPlacement(seq.seq_id, cached + 1, cached // self.config.page_size,
                            self.kv_cache.num_host_pages(seq.seq_id))

    def _place_rows(self, decoding: list[Sequence]) -> None:
        """Moves pages between the pools to the split policy's targets for this step's
        decode rows (a move that finds no room leaves the row as it is)."""
        if not self.host_split.uses_host or not decoding:
            return
        rows = [self._placement(s) for s in decoding]
        targets = self.host_split.targets(rows, self.kv_cache.allocator.num_free_pages(),
                                          self.kv_cache.num_free_host_pages())
        for row in rows:
            if row.seq_id not in targets:
                continue
            target = min(max(targets[row.seq_id], 0), row.num_full_pages)
            if target > row.num_host_pages:
                self.kv_cache.to_host(row.seq_id, target - row.num_host_pages)
            elif target < row.num_host_pages:
                self.kv_cache.to_device(row.seq_id, row.num_host_pages - target)

    def _offload_a_row(self) -> bool:
        """The device pool is full: moves the full device pages of the lowest-ranked decoding
        sequence that has some, and room in the host pool, there; False if none does."""
        for seq in reversed(self._ranked(self.running)):
            if seq.status is not SeqStatus.RUNNING or seq.num_pending != 1:
                continue  # prefill rows read device pages only
            row = self._placement(seq)
            extra = row.num_full_pages - row.num_host_pages
            if extra > 0 and self.kv_cache.to_host(seq.seq_id, extra):
                self.stats["host_offloads"] += 1
                return True
        return False

    def _max_drafts(self, seq: Sequence) -> int:
        """Draft tokens the sequence may verify next: gamma, less near its length limits (the
        verify step emits one token beyond its drafts) and before a retention decision or a
        KIVI key group's aging. Under a grammar, the row ships a mask per draft
        (`GrammarMatcher.masks`)."""
        left = min(seq.sampling.max_new_tokens - len(seq.output_ids),
                   self.config.max_model_len - seq.num_tokens)
        gamma = self.config.num_draft_tokens
        if self.config.adaptive_drafts and seq.draft_len:
            gamma = min(gamma, seq.draft_len)
        num = max(0, min(gamma, left - 1))
        # A verify row reads what plain decoding would only while retention and KIVI's key
        # groups decide nothing before its last token (`KVCacheManager.max_verify_tokens`).
        return num and self.kv_cache.max_verify_tokens(seq.seq_id, seq.num_computed,
                                                       num + 1) - 1

    def _propose(self, seq: Sequence, budget: int) -> None:
        """The drafts a verify row checks: a host drafter's proposals, or the draft steps'."""
        num = min(self._max_drafts(seq), budget)
        if not self.drafter.runs_draft_steps:
            seq.draft_tokens = self.drafter.propose(seq.tokens, num)
        del seq.draft_tokens[num:]

    def _draft_row(self, seq: Sequence, index: int) -> ScheduledRow:
        """A draft step's row: the sequence's next unverified token at its position, reading
        the page subset the drafter chooses (every page under KIVI, whose exact window and key
        groups are addressed by cache position); it counts nothing as computed."""
        table = np.asarray(self.kv_cache.block_table(seq.seq_id), np.int32)
        evicted = self.kv_cache.retention.num_evicted(seq.seq_id)
        start = seq.num_computed + len(seq.draft_tokens)
        token = (seq.tokens + seq.draft_tokens)[start]
        cache_pos = start - evicted
        self.kv_cache.mark_written({int(table[cache_pos // self.config.page_size])},
                                   seq.weights_version)
        reads, read_len = self.drafter.draft_reads(table, cache_pos + 1, self.config.page_size)
        if self.kv_cache.keeps_windows:  # KIVI addresses its window and groups by position
            reads, read_len = table, cache_pos + 1
        return ScheduledRow(
            seq_id=seq.seq_id, token_ids=np.asarray([token], np.int32), start=start,
            num_evicted=evicted, block_table=table, score_weights=np.zeros(1, np.float32),
            sampling=_GREEDY_DRAFT, seed=seq.seed, counter=0,
            seq_slot=self.kv_cache.seq_slot(seq.seq_id),
            kv_floor=self.kv_cache.kv_floor(seq.seq_id), samples=False, kv_epoch=seq.kv_epoch,
            is_draft=True, read_table=np.asarray(reads, np.int32), read_len=int(read_len))

    def _fit_to_bucket(self, total: int, chunk: int) -> int:
        """`chunk` tokens more after `total` prefill tokens, cut to end on a prefill bucket
        inside the chunk when padding up to the next bucket would exceed the configured
        fraction of it."""
        limit, buckets = self.config.prefill_padding_limit, self.config.prefill_buckets
        end = total + chunk
        up = min((b for b in buckets if b >= end), default=end)
        if limit is None or up - end <= limit * up:
            return chunk
        down = max((b for b in buckets if total < b <= end), default=end)
        return down - total

    @staticmethod
    def _awaits_step_in_flight(seq: Sequence) -> bool:
        """Its next move comes from a dispatched step's results (a sampled token, or the end
        of a shared prompt's prefill), not from new pages."""
        return seq.num_unresolved > 0 or seq.num_pending == 0

    def _is_done(self, seq: Sequence) -> bool:
        """Whether the token in flight is the sequence's last (by its length limits)."""
        return seq.num_unresolved > 0 and (
            seq.num_tokens - seq.num_prompt_tokens >= seq.sampling.max_new_tokens
            or seq.num_tokens >= self.config.max_model_len)

    @staticmethod
    def _grammar_masks(rows: list[tuple[Sequence, int, int]]) -> dict[str, np.ndarray]:
        """The token masks of the step's rows that sample under a grammar, by sequence id:
        (sequence, tokens, drafts) per row, filled together (`kvjax.grammar.fill_masks`: in
        parallel when several rows are constrained), each before and after its drafts."""
        wanted = [(seq, seq.draft_tokens[:num_drafts]) for seq, n, num_drafts in rows
                  if seq.grammar is not None and n - num_drafts == seq.num_pending]
        filled = grammar_lib.fill_masks([(seq.grammar, drafts) for seq, drafts in wanted])
        return {seq.seq_id: m for (seq, _), m in zip(wanted, filled, strict=True)}

    def _row(self, seq: Sequence, n: int, index: int, num_drafts: int = 0,
             masks: np.ndarray | None = None) -> ScheduledRow:
        """The row's snapshot; the sequence counts its tokens as computed from now on, and its
        pages are recorded as written by its weights version. A verify row's last
        `num_drafts` tokens are the sequence's draft tokens; `masks`, a sampling row's
        grammar masks before and after them (`_grammar_masks`)."""
        table, group_tables = self.kv_cache.row_tables(seq.seq_id)
        evicted = self.kv_cache.retention.num_evicted(seq.seq_id)
        start = seq.num_computed
        pos = np.arange(start, start + n, dtype=np.int32)
        written = table[(pos - evicted) // self.config.page_size]
        group_evicted = self.kv_cache.retention.group_evicted(seq.seq_id)
        if group_tables is not None:
            gpos = pos[None] - np.asarray(group_evicted or (evicted,) * len(group_tables),
                                          np.int32)[:, None]  # [G-1, n]
            written = np.concatenate([written, np.take_along_axis(
                group_tables, gpos // self.config.page_size, axis=1).ravel()])
        self.kv_cache.mark_written(set(written.tolist()), seq.weights_version)
        if seq.num_unresolved:  # Its one token comes from the previous step, on the device.
            token_ids, feed_index = np.zeros(n, np.int32), seq.inflight_index
        else:
            token_ids = np.asarray(seq.tokens[start:start + n - num_drafts]
                                   + seq.draft_tokens[:num_drafts], np.int32)
            feed_index = -1
        samples = n - num_drafts == seq.num_pending
        host_table = self.kv_cache.host_table(seq.seq_id)
        row = ScheduledRow(
            seq_id=seq.seq_id, token_ids=token_ids, start=start, num_evicted=evicted,
            host_table=host_table if len(host_table) else None,
            host_len=len(host_table) * self.config.page_size,
            block_table=table, group_tables=group_tables, group_evicted=group_evicted,
            score_weights=self.kv_cache.retention.verify_score_weights(seq.seq_id, pos)
            if num_drafts else self.kv_cache.retention.score_weights(seq.seq_id, pos,
                                                                     seq.num_tokens),
            sampling=seq.sampling, seed=seq.seed, counter=seq.num_tokens - seq.num_prompt_tokens,
            seq_slot=self.kv_cache.seq_slot(seq.seq_id),
            kv_floor=self.kv_cache.kv_floor(seq.seq_id), samples=samples,
            kv_epoch=seq.kv_epoch, feed_index=feed_index, num_drafts=num_drafts,
            history=np.asarray(seq.tokens[:start], np.int32)
            if seq.sampling.reads_history else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            stop_ids=seq.sampling.stop_ids(self.config.eos_token_ids)
            if seq.sampling.min_tokens else (),
            token_mask=None if masks is None else masks[0],
            draft_masks=masks[1:] if masks is not None and num_drafts else None)
        seq.draft_tokens = []  # Checked by this row (verified or not, they are spent).
        seq.num_computed += n
        if num_drafts:
            self.stats["spec_verify_rows"] += 1
            self.stats["spec_proposed"] += num_drafts
        # Counted when dispatched: the device computes them whatever happens to the sequence.
        is_decode = n - num_drafts == 1 and samples and start >= seq.num_prompt_tokens
        self.stats["decode_tokens" if is_decode else "prefill_tokens"] += n
        if seq.is_chunk_fill:
            self.stats["chunk_fill_tokens"] += n
        if samples and not seq.is_prefill_only:
            seq.num_unresolved += 1
            seq.inflight_index = index
        return row

    def check_fresh(self, so: SchedulerOutput) -> None:
        """Raises if a row would read a page written under other weights (debug_provenance)."""
        for row in so.rows:
            kv_len = int(row.cache_positions[-1]) + 1
            self.kv_cache.check_fresh(row.seq_id, kv_len, self._seqs[row.seq_id].weights_version)

    def _admit(self, seq: Sequence, *, is_due: bool = True) -> bool:
        """Registers a waiting sequence with the KV cache (prefix-cache lookup).

        With tiers on, the hash chain continues in the host and disk tiers; False while pages
        found there are loading (the sequence is scheduled only once they are committed).
        `is_due`: the scheduler wants to run it this step (False: a prefetch).
        """
        if self._tiers is not None and self.kv_cache.has_sequence(seq.seq_id):
            return not self._tiers.is_loading(seq.seq_id)
        key = self.cache_key(seq)
        cached = self.kv_cache.lookup(seq.seq_id, seq.tokens, key,
                                      max_hit=self._hit_cap(seq, key))
        seq.num_computed = cached
        if self.kv_cache.has_prefix_cache:
            self.tracer.emit("prefix_hit" if cached else "prefix_miss", "page",
                             f"request/{seq.request_id}", seq_id=seq.seq_id,
                             tenant=str(self._request_meta[seq.request_id]["tenant"]),
                             tokens=len(seq.tokens), hit_tokens=cached)
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
        return self._load_from_tiers(seq, is_due=is_due)

    def _swap_in(self, seq: Sequence) -> bool:
        if self._tiers is not None:
            return self._swap_in_from_tiers(seq)
        if not self.kv_cache.swap_in(seq.seq_id, seq.tokens, seq.num_computed,
                                     self.cache_key(seq), seq.weights_version):
            return False
        seq.status = SeqStatus.RUNNING
        self.tracer.emit("resume", "request", f"request/{seq.request_id}", seq_id=seq.seq_id)
        return True

    # ----------------------------------------------------------------------------- pausing

    def pause(self, request_id: str, *, to_host: bool = False) -> None:
        """Takes a request out of scheduling until `resume`: no step computes or preempts it.

        Its running sequences keep their device pages, or with `to_host` swap them to host
        memory (the preemption swap path; paged layout); waiting and swapped ones keep their
        state. Call between steps (the engine drains first).
        """
        if not self.has_request(request_id) or request_id in self.paused:
            raise ValueError(f"request {request_id!r} is not an unfinished, unpaused request")
        if to_host and not self.config.is_paged:
            raise ValueError(f"request {request_id!r}: pausing to host memory needs the paged "
                             f"layout (the swap space holds pages)")
        seqs = [s for s in self.sequences(request_id) if s.status is not SeqStatus.FINISHED]
        for seq in seqs:
            for queue in (self.running, self.waiting, self.swapped):
                if seq in queue:
                    queue.remove(seq)
            if to_host and seq.status is SeqStatus.RUNNING and seq.num_computed > 0:
                seq.kv_epoch += 1
                seq.draft_tokens = []
                self.kv_cache.swap_out(seq.seq_id, seq.num_computed)
                seq.status = SeqStatus.SWAPPED
        self.paused[request_id] = seqs

    def resume(self, request_id: str) -> None:
        """Puts a paused request back in its queues: device-resident sequences run on, swapped
        ones swap in when pages allow."""
        if request_id not in self.paused:
            raise ValueError(f"request {request_id!r} is not paused")
        queues = {SeqStatus.RUNNING: self.running, SeqStatus.WAITING: self.waiting,
                  SeqStatus.SWAPPED: self.swapped}
        for seq in self.paused.pop(request_id):
            queues[seq.status].append(seq)

    # ----------------------------------------------------------------------------- control

    def control_state(self) -> ControlState:
        """The snapshot a KV controller decides from (see `kvjax.scheduler.controller`)."""
        cfg, now = self.config, self.clock()
        retention = self.kv_cache.retention
        policy = retention.policy
        seqs = []
        for status, queue in (("waiting", self.waiting), ("running", self.running),
                              ("swapped", self.swapped)):
            for s in queue:
                held = (len(self.kv_cache.block_table(s.seq_id))
                        if status == "running" and self.kv_cache.has_sequence(s.seq_id) else 0)
                seqs.append(SeqState(
                    seq_id=s.seq_id, request_id=s.request_id, tenant=s.tenant,
                    priority=s.priority, status=status, age_s=now - s.arrival_time,
                    num_tokens=s.num_tokens, num_computed=s.num_computed,
                    cached_tokens=self._cached_len(s) if status != "waiting" else 0,
                    pages_held=held, slack_s=self._slack(s, now),
                    retention_budget=retention.budget(s.seq_id), kl_spent=s.kl_spent,
                    kl_budget=s.slo.kl_budget, demoted_bits=s.demoted_bits,
                    num_preemptions=s.num_preemptions,
                    **(self.in_place.seq_fields(s) if status == "running" else {})))
        return ControlState(
            now=now, page_size=cfg.page_size, num_pages=self.kv_cache.allocator.capacity,
            free_pages=self.kv_cache.allocator.num_free_pages(), max_num_seqs=cfg.max_num_seqs,
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            swap_bytes_per_s=cfg.swap_bandwidth_bytes_per_s or _DEFAULT_SWAP_BYTES_PER_S,
            recompute_tokens_per_s=self._recompute_rate(), can_swap=cfg.is_paged,
            demote_ratios=cfg.demote_ratios,
            retention_range=(policy.min_budget, policy.budget) if policy.evicts else None,
            seqs=tuple(seqs), cached=tuple(self.kv_cache.cached_pages()),
            host_room_bytes=self.kv_cache.host_room_bytes(),
            spills_cached=self.kv_cache.tiers is not None,
            inplace_ratios=self.in_place.ratios())

    @staticmethod
    def _slack(seq: Sequence, now: float) -> float:
        """Seconds to the sequence's next deadline: its TTFT before its first token, then the
        TPOT deadline of its next token (INF without that target, or once the TTFT passed)."""
        slo, times = seq.slo, seq.token_times
        if not times:
            slack = INF if slo.ttft_s is None else seq.arrival_time + slo.ttft_s - now
            return slack if slack >= 0 else INF  # a missed TTFT: nothing left to protect
        return INF if slo.tpot_s is None else times[0] + slo.tpot_s * len(times) - now

    def _control(self) -> list[str]:
        """Consults the controller and applies its budgets and offloads; returns the
        sequences preempted."""
        if isinstance(self.controller, FixedController):
            return []  # the configured behaviour decides nothing: no snapshot to build
        self.decisions = d = self.controller.decide(self.control_state())
        for seq_id, budget in d.retention.items():
            self.kv_cache.retention.set_budget(seq_id, budget)
        for seq_id, kl in d.kl.items():
            self._seqs[seq_id].kl_spent = kl
        self.kv_cache.keep_cached(d.keep)
        self.in_place.apply(d.demote_in_place, self._seqs)
        preempted = []
        for seq_id in d.offload:
            seq = self._seqs.get(seq_id)
            if seq is not None and seq in self.running:
                self.tracer.emit("offload", "request", f"request/{seq.request_id}",
                                 seq_id=seq_id, controller=self.controller.name)
                self._preempt(seq)
                preempted.append(seq_id)
        return preempted

    def _recompute_rate(self) -> float:
        """Tokens per second a recompute is estimated to run at: configured, else measured."""
        rate = self.config.recompute_tokens_per_s or (
            (self.stats["prefill_tokens"] + self.stats["decode_tokens"])
            / max(self.stats["step_time_s"], 1e-9))
        return max(rate, 1e-9)

    # ----------------------------------------------------------------------------- preemption

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.kv_epoch += 1
        seq.draft_tokens = []
        seq.num_preemptions += 1
        self.stats["preemptions"] += 1
        is_swap = seq.num_computed > 0 and self.config.is_paged and self._swap_on_preempt(seq)
        demotion = self.decisions.demote.get(seq.seq_id) if is_swap else None
        if demotion is not None and demotion.bits not in self.config.demote_ratios:
            demotion = None
        self.tracer.emit("preempt", "request", f"request/{seq.request_id}", seq_id=seq.seq_id,
                         mode="swap" if is_swap else "recompute", num_computed=seq.num_computed,
                         demote_bits=0 if demotion is None else demotion.bits)
        if is_swap:
            if demotion is not None:
                seq.kl_spent += demotion.kl
                seq.demoted_bits = min(demotion.bits, seq.demoted_bits or demotion.bits)
                self.stats["demoted_swaps"] += 1
            self.kv_cache.swap_out(seq.seq_id, seq.num_computed,
                                   demote_bits=0 if demotion is None else demotion.bits)
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
            return
        self.kv_cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def _swap_on_preempt(self, seq: Sequence) -> bool:
        """The controller's choice for this sequence if it made one; else SWAP or RECOMPUTE as
        configured; under AUTO, the cost model decides (and is logged)."""
        if seq.seq_id in self.decisions.swap:
            return self.decisions.swap[seq.seq_id]
        mode = self.config.preemption_mode
        if mode is not PreemptionMode.AUTO:
            return mode is PreemptionMode.SWAP
        n, held = seq.num_computed, self.config.kv_bytes_held
        decision = decide_preemption(seq.seq_id, n,
                                     bytes_per_token=held(n) / n if held and n
                                     else self.config.kv_bytes_per_token,
                                     bandwidth_bytes_per_s=self.config.swap_bandwidth_bytes_per_s,
                                     recompute_tokens_per_s=self._recompute_rate())
        self.stats["preemption_decisions"].append(dataclasses.asdict(decision))
        return decision.choice is PreemptionMode.SWAP

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
            if self.echo is not None:
                self.echo.observe(so.decode, out.page_reads)
            self._commit_step(so, out)
            return self.kv_cache.take_plan()
        finally:
            self.kv_cache.end_plan()

    def _commit_step(self, so: SchedulerOutput, out: RunnerOutput) -> None:
        now = self.clock()
        for i, row in enumerate(so.rows):
            seq = self._seqs.get(row.seq_id)
            if seq is None or seq.status is SeqStatus.FINISHED:
                continue
            is_current = row.kv_epoch == seq.kv_epoch and seq.status is SeqStatus.RUNNING
            if row.is_draft:
                if is_current:
                    seq.draft_tokens.append(int(out.tokens[i]))
                continue
            if row.num_drafts:
                self._commit_verified(seq, row, out, i, now, is_current, so.weights_version)
                continue
            if is_current:
                self._commit_kv(seq, row, None if out.key_scores is None else out.key_scores[i])
            if not row.samples:
                continue
            if seq.is_group_prefill:
                if is_current:
                    self._fork_group(seq)
                continue
            if seq.is_chunk_fill:  # Its pages are in the chunk cache now: it is done.
                if is_current:
                    self.finish(seq, FinishReason.STOP)
                continue
            seq.num_unresolved -= 1
            seq.tokens.append(int(out.tokens[i]))
            seq.token_versions.append(so.weights_version)
            seq.logprobs.append(float(out.logprobs[i]))
            seq.token_times.append(now)
            self._check_stop(seq)
        for request_id in {self._request_of(row.seq_id) for row in so.rows}:
            if request_id in self._requests:
                self._maybe_emit(request_id)
        self.stats["steps"] += 1
        if len(self.versions) > 1:
            self.drop_unused_versions()

    def _commit_verified(self, seq: Sequence, row: ScheduledRow, out: RunnerOutput, i: int,
                         now: float, is_current: bool, version: str) -> None:
        """A verify row: its kept drafts and the model's next token are output; the rejected
        drafts' cache positions are rolled back (pages past them freed) before anything of
        the row reaches the prefix cache."""
        k = 0 if out.num_accepted is None else int(out.num_accepted[i])
        kept = [int(t) for t in row.token_ids[1:1 + k]]
        logprobs = ([float(out.logprobs[i])] if out.spec_logprobs is None
                    else [float(x) for x in out.spec_logprobs[i, :k + 1]])
        self.stats["spec_accepted"] += k
        m = row.num_drafts
        seq.draft_len = min(m + 1, self.config.num_draft_tokens) if k == m else k + 1
        if is_current:
            seq.num_computed = row.start + 1 + k
            self.kv_cache.truncate(seq.seq_id, self._cached_len(seq))
            self._commit_kv(seq, row, None, tokens=seq.tokens + kept, num_new=1 + k,
                            query_scores=None if out.query_key_scores is None
                            else out.query_key_scores[i])
        seq.num_unresolved -= 1
        for token, logprob in zip([*kept, int(out.tokens[i])], logprobs, strict=True):
            seq.tokens.append(token)
            seq.token_versions.append(version)
            seq.logprobs.append(logprob)
            seq.token_times.append(now)
            self._check_stop(seq)
            if seq.status is SeqStatus.FINISHED:
                break

    def _commit_kv(self, seq: Sequence, row: ScheduledRow, key_scores: np.ndarray | None, *,
                   tokens: list[int] | None = None, num_new: int | None = None,
                   query_scores: np.ndarray | None = None) -> None:
        """A row's tokens are computed: full pages to the prefix cache, retention decisions.

        tokens: the sequence's tokens the KV holds (default seq.tokens); num_new: tokens of
        the row that stay computed (default all of them); query_scores: a verify row's
        [1 + gamma, W*P] key scores of each of its queries alone (`retain_verified`)."""
        n = row.num_tokens if num_new is None else num_new
        tokens = seq.tokens if tokens is None else tokens
        self.kv_cache.commit(seq.seq_id, tokens[:min(seq.num_computed, len(tokens))])
        if row.start < seq.num_prompt_tokens:  # a prefill chunk
            self._pay_for_pages(seq)
        self.policy.on_tokens(seq, n)
        if self._activity is not None:
            self._activity.on_tokens(seq.tenant, n, self.clock())
        if row.num_drafts:
            self.kv_cache.retain_verified(seq.seq_id, row.start, n, query_scores,
                                          version=seq.weights_version)
            return
        self.kv_cache.retain(seq.seq_id, row.start, n, key_scores, is_prefill_done=row.samples,
                             version=seq.weights_version)

    @staticmethod
    def _request_of(seq_id: str) -> str:
        return seq_id.rsplit("#", 1)[0]

    def _fork_group(self, parent: Sequence) -> None:
        meta = self._request_meta[parent.request_id]
        prompt = meta["prompt"]
        self.running.remove(parent)
        parent.status = SeqStatus.FINISHED
        self._requests[parent.request_id].remove(parent.seq_id)
        for i in range(meta["n"]):
            child = Sequence(
                seq_id=f"{parent.request_id}#{i}", request_id=parent.request_id,
                tokens=list(prompt), num_prompt_tokens=len(prompt), sampling=parent.sampling,
                seed=parent.seed + i, arrival_time=parent.arrival_time, order=parent.order,
                tenant=parent.tenant, priority=parent.priority, sample_index=i,
                num_cached_prompt_tokens=parent.num_cached_prompt_tokens,
                first_scheduled_time=parent.first_scheduled_time,
                weights_version=parent.weights_version, chunk_spans=parent.chunk_spans,
                context_reuse=parent.context_reuse,
                grammar=None if parent.grammar is None else parent.grammar.fork())
            if not self.kv_cache.fork(parent.seq_id, child.seq_id):
                self._register(child)  # No room to share (contiguous slots): prefill afresh.
                continue
            child.num_computed = parent.num_computed
            child.status = SeqStatus.RUNNING
            self._seqs[child.seq_id] = child
            self._requests[child.request_id].append(child.seq_id)
            self.running.append(child)
        self.kv_cache.free(parent.seq_id)
        del self._seqs[parent.seq_id]

    def _check_stop(self, seq: Sequence) -> None:
        p = seq.sampling
        token = seq.tokens[-1]
        eos = () if p.ignore_eos else self.config.eos_token_ids
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if (token in eos or token in p.stop_token_ids
                or (seq.grammar is not None and seq.grammar.is_finished)):
            self.finish(seq, FinishReason.STOP)
        elif (len(seq.output_ids) >= p.max_new_tokens
              or len(seq.tokens) >= self.config.max_model_len):
            self.finish(seq, FinishReason.LENGTH)

    # ----------------------------------------------------------------------------- weights

    def active_version(self) -> str:
        """The weights version the next step serves: versions in flight take turns by step."""
        live = {s.weights_version for s in self.running + self.swapped + self.waiting}
        versions = [v for v in self.versions if v in live] or [self.weights_version]
        return versions[self.stats["steps"] % len(versions)]

    def live_versions(self) -> set[str]:
        """Weights versions some unfinished sequence runs under, and the newest."""
        live = {s.weights_version for s in self.running + self.swapped + self.waiting}
        return live | {self.weights_version}

    def drop_unused_versions(self) -> None:
        live = self.live_versions()
        self.versions = [v for v in self.versions if v in live]

    def on_weights_update(self, version: str, in_flight: WeightUpdatePolicy) -> None:
        """New weights serve from the next step; sequences in flight follow `in_flight`."""
        self.weights_version = version
        self.versions.append(version)
        # Every cached page of older weights stops matching here (its provenance differs).
        self.tracer.emit("weights_update", "page", "pages/device", version=version,
                         in_flight=in_flight.value)
        for seq in list(self.running + self.swapped + self.waiting):
            started = seq.num_computed > 0 or seq.status is not SeqStatus.WAITING or \
                len(seq.tokens) > seq.num_prompt_tokens
            if seq.is_chunk_fill and in_flight is not WeightUpdatePolicy.FINISH_OLD:
                # A chunk under old weights serves no request now: a new one is filled on need.
                self.finish(seq, FinishReason.ABORT)
                self._maybe_emit(seq.request_id)
            elif not started or in_flight is WeightUpdatePolicy.RECOMPUTE:
                if started:
                    self.tracer.emit("invalidate", "request", f"request/{seq.request_id}",
                                     seq_id=seq.seq_id, version=version)
                self._restart(seq)
                seq.weights_version = version
            elif in_flight is WeightUpdatePolicy.ABORT:
                self.finish(seq, FinishReason.ABORT)
                self._maybe_emit(seq.request_id)
        self.drop_unused_versions()

    def _restart(self, seq: Sequence) -> None:
        """Drops a sequence's KV (device pages or host copy); it re-prefills its tokens later."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.swapped:
            self.swapped.remove(seq)
        if self.kv_cache.has_sequence(seq.seq_id):
            self.kv_cache.free(seq.seq_id)
        self.kv_cache.drop_swapped(seq.seq_id)
        seq.num_computed = 0
        seq.kv_epoch += 1
        seq.draft_tokens = []
        if seq.status is not SeqStatus.WAITING:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    # ----------------------------------------------------------------------------- metrics

    def kv_sample(self) -> tuple[int, int]:
        """(tokens holding live KV, tokens of pages reserved) right now."""
        live = sum(self._cached_len(s) for s in self.running)
        reserved = self.kv_cache.allocator.num_used_pages() * self.config.page_size
        return min(live, reserved), reserved
