"""Preemption: what happens to a running sequence's KV when pages run out, and the cost model
that picks swap or recompute per sequence under `PreemptionMode.AUTO`."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from kvjax.scheduler.request import SeqStatus

if TYPE_CHECKING:
    from kvjax.scheduler.config import SchedulerConfig
    from kvjax.scheduler.controller import Decisions, Demotion
    from kvjax.scheduler.policies import SchedulingPolicy
    from kvjax.scheduler.request import Sequence
    from kvjax.scheduler.requests import RequestTable


class PreemptionMode(enum.StrEnum):
    """What happens to a running sequence's KV when pages run out."""

    RECOMPUTE = "recompute"  # drop its pages; re-prefill prompt + generated tokens later.
    SWAP = "swap"  # copy its pages to host memory; copy them back later.
    AUTO = "auto"  # per sequence, whichever `decide_preemption` estimates cheaper.


@dataclasses.dataclass(frozen=True)
class PreemptionDecision:
    """Why a preempted sequence was swapped or recomputed.

    Attributes:
        seq_id: the preempted sequence.
        num_tokens: tokens whose KV it held (prompt + generated so far).
        swap_bytes: bytes a swap moves each way: the pages it holds in every block table
            (`KVCacheManager.swap_out_bytes`), fewer than its tokens' where retention freed some.
        swap_cost_s: estimated seconds to move those bytes out and back.
        recompute_cost_s: estimated seconds to prefill those tokens again.
        choice: PreemptionMode.SWAP or PreemptionMode.RECOMPUTE (a str enum, so the decision
            serializes to JSON as 'swap' or 'recompute').
    """

    seq_id: str
    num_tokens: int
    swap_bytes: int
    swap_cost_s: float
    recompute_cost_s: float
    choice: PreemptionMode


def decide_preemption(seq_id: str, num_tokens: int, *, swap_bytes: int,
                      bandwidth_bytes_per_s: float, recompute_tokens_per_s: float
                      ) -> PreemptionDecision:
    """Swap when moving the KV's `swap_bytes` out and back is estimated cheaper than
    prefilling its `num_tokens` tokens again."""
    if num_tokens < 0 or swap_bytes < 0:
        raise ValueError(f"num_tokens and swap_bytes must be >= 0, got {num_tokens}, "
                         f"{swap_bytes}")
    if not bandwidth_bytes_per_s > 0 or not recompute_tokens_per_s > 0:
        raise ValueError(f"rates must be > 0, got bandwidth={bandwidth_bytes_per_s!r}, "
                         f"recompute={recompute_tokens_per_s!r}")
    swap = 2 * swap_bytes / bandwidth_bytes_per_s
    recompute = num_tokens / recompute_tokens_per_s
    choice = PreemptionMode.SWAP if swap < recompute else PreemptionMode.RECOMPUTE
    return PreemptionDecision(seq_id=seq_id, num_tokens=num_tokens, swap_bytes=swap_bytes,
                              swap_cost_s=swap, recompute_cost_s=recompute, choice=choice)


class PreemptionPolicy:
    """Whom to preempt when pages run out, and what happens to its KV.

    Attributes:
      config: the SchedulerConfig (preemption mode, the swap cost model's inputs).
      kv_cache: the KVCacheManager that frees or swaps out a preempted sequence's pages.
      table: the RequestTable whose queues a preempted sequence moves between.
      stats: the engine's counters; AUTO's decisions are appended to
        `stats["preemption_decisions"]`.
    """

    def __init__(self, config: SchedulerConfig, kv_cache, table: RequestTable, stats: dict):
        self.config = config
        self.kv_cache = kv_cache
        self.table = table
        self.stats = stats

    def victim(self, candidates: list[Sequence], decisions: Decisions,
               policy: SchedulingPolicy) -> Sequence:
        """The running sequence preempted next: the controller's first victim among the
        candidates, else the policy's lowest ranked."""
        by_id = {s.seq_id: s for s in candidates}
        for seq_id in decisions.victims:
            if seq_id in by_id:
                return by_id[seq_id]
        return sorted(candidates, key=policy.priority_key)[-1]

    def mode(self, seq: Sequence, decisions: Decisions) -> PreemptionMode:
        """SWAP or RECOMPUTE for this sequence: RECOMPUTE when it holds no KV or the pool is
        not paged; else the controller's choice if it made one; else as configured; under
        AUTO, the cost model decides (and is logged), pricing a swap at the bytes of the pages
        the sequence holds now."""
        if not (seq.num_computed > 0 and self.config.is_paged):
            return PreemptionMode.RECOMPUTE
        if seq.seq_id in decisions.swap:
            return PreemptionMode.SWAP if decisions.swap[seq.seq_id] else PreemptionMode.RECOMPUTE
        mode = self.config.preemption_mode
        if mode is not PreemptionMode.AUTO:
            return mode
        n = seq.num_computed
        decision = decide_preemption(seq.seq_id, n,
                                     swap_bytes=self.kv_cache.swap_out_bytes(seq.seq_id, n),
                                     bandwidth_bytes_per_s=self.config.swap_bandwidth_bytes_per_s,
                                     recompute_tokens_per_s=self.recompute_rate())
        self.stats["preemption_decisions"].append(dataclasses.asdict(decision))
        return decision.choice

    def demotion(self, seq: Sequence, decisions: Decisions) -> Demotion | None:
        """The precision a swapped sequence's copy is demoted to (the controller's, where the
        swap space has that precision), else None."""
        demotion = decisions.demote.get(seq.seq_id)
        if demotion is not None and demotion.bits not in self.config.demote_ratios:
            return None
        return demotion

    def recompute_rate(self) -> float:
        """Tokens per second a recompute is estimated to run at: configured, else measured."""
        rate = self.config.recompute_tokens_per_s or (
            (self.stats["prefill_tokens"] + self.stats["decode_tokens"])
            / max(self.stats["step_time_s"], 1e-9))
        return max(rate, 1e-9)

    def preempt(self, seq: Sequence, decisions: Decisions) -> None:
        """Takes a running sequence off the device: its KV is swapped out (possibly demoted)
        or dropped for a recompute, as `mode` says; it queues as swapped or waiting."""
        self.table.running.remove(seq)
        seq.kv_epoch += 1
        seq.draft_tokens = []
        seq.num_preemptions += 1
        self.stats["preemptions"] += 1
        is_swap = self.mode(seq, decisions) is PreemptionMode.SWAP
        demotion = self.demotion(seq, decisions) if is_swap else None
        self.table.tracer.emit("preempt", "request", f"request/{seq.request_id}",
                               seq_id=seq.seq_id, mode="swap" if is_swap else "recompute",
                               num_computed=seq.num_computed,
                               demote_bits=0 if demotion is None else demotion.bits)
        if is_swap:
            if demotion is not None:
                seq.kl_spent += demotion.kl
                seq.demoted_bits = min(demotion.bits, seq.demoted_bits or demotion.bits)
                self.stats["demoted_swaps"] += 1
            self.kv_cache.swap_out(seq.seq_id, seq.num_computed,
                                   demote_bits=0 if demotion is None else demotion.bits)
            seq.status = SeqStatus.SWAPPED
            self.table.swapped.append(seq)
            return
        if seq.num_unresolved:
            # Under async scheduling the step in flight writes this sequence's last computed
            # tokens, and its commit (which publishes their full pages) comes after this step
            # is planned: publish them now, as that commit would first, so recomputing starts
            # where a synchronous preemption would (the device runs that step before this
            # one, so no reader of these pages runs ahead of their writes).
            self.kv_cache.commit(seq.seq_id, seq.tokens[:min(seq.num_computed, len(seq.tokens))])
        self.kv_cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.table.waiting.append(seq)
