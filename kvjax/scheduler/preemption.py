"""Preemption: what happens to a running sequence's KV when pages run out, and the cost model
that picks swap or recompute per sequence under `PreemptionMode.AUTO`."""

from __future__ import annotations

import dataclasses
import enum


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
        swap_cost_s: estimated seconds to move its KV out and back.
        recompute_cost_s: estimated seconds to prefill those tokens again.
        choice: PreemptionMode.SWAP or PreemptionMode.RECOMPUTE (a str enum, so the decision
            serializes to JSON as 'swap' or 'recompute').
    """

    seq_id: str
    num_tokens: int
    swap_cost_s: float
    recompute_cost_s: float
    choice: PreemptionMode


def decide_preemption(seq_id: str, num_tokens: int, *, bytes_per_token: float,
                      bandwidth_bytes_per_s: float, recompute_tokens_per_s: float
                      ) -> PreemptionDecision:
    """Swap when moving the KV out and back is estimated cheaper than prefilling it again."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not bandwidth_bytes_per_s > 0 or not recompute_tokens_per_s > 0:
        raise ValueError(f"rates must be > 0, got bandwidth={bandwidth_bytes_per_s!r}, "
                         f"recompute={recompute_tokens_per_s!r}")
    swap = 2 * num_tokens * bytes_per_token / bandwidth_bytes_per_s
    recompute = num_tokens / recompute_tokens_per_s
    choice = PreemptionMode.SWAP if swap < recompute else PreemptionMode.RECOMPUTE
    return PreemptionDecision(seq_id=seq_id, num_tokens=num_tokens, swap_cost_s=swap,
                              recompute_cost_s=recompute, choice=choice)
