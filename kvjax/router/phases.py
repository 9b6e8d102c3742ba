"""Phase alternation over replicas (EcoServe's temporal disaggregation, at the router).

Instead of dedicating replicas to prefill or to decode (and moving each prompt's KV pages
between them), every replica takes turns: time is cut into periods of `period_s`, and each
period into one window per replica, in the configured order. New requests go only to the
replica whose window it is (its prefill phase: it receives every prompt that arrives then and
prefills them as one burst); in the other windows it receives none and only decodes what it
holds, undisturbed by new prompts. No KV moves between replicas.

What this does not do: inside its window a replica's scheduler still runs its earlier
requests' decode rows beside the new prompts' chunks (it does not pause decoding), as a
colocated engine does; the alternation is of admissions, not of the engine's steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

_T = TypeVar("_T")


class PhaseSchedule:
    """Which replica is in its prefill phase at a given time.

    Attributes:
      period_s: seconds of one cycle over every replica's window.
      num_replicas: windows per period (one per configured replica).
      clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, period_s: float, num_replicas: int, *,
                 clock: Callable[[], float] = time.monotonic):
        if not period_s > 0:
            raise ValueError(f"phase period_s must be > 0, got {period_s!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas!r}")
        self.period_s = period_s
        self.num_replicas = num_replicas
        self.clock = clock

    def prefilling(self, now: float | None = None) -> int:
        """The index (in the configured order) of the replica in its prefill phase."""
        now = self.clock() if now is None else now
        return min(int((now % self.period_s) / self.period_s * self.num_replicas),
                   self.num_replicas - 1)

    def admitting(self, candidates: Sequence[_T], order: Sequence[_T]) -> list[_T]:
        """The candidates that may take a new request now: the one in its prefill phase; all
        of them when it is not among them (down, or already tried), so a dead replica's
        window stalls no arrival."""
        current = order[self.prefilling()]
        return [current] if current in candidates else list(candidates)
