"""The weights versions a scheduler serves: the newest, those sequences in flight still run
under, which one each step serves, and what a weights update does to sequences in flight."""

from __future__ import annotations

from kvjax.scheduler.request import FinishReason, SeqStatus, WeightUpdatePolicy
from kvjax.scheduler.requests import RequestTable


class WeightVersions:
    """The scheduler's weights versions.

    Attributes:
      weights_version: the newest weights version.
      versions: every version still served, oldest first.
      table: the RequestTable whose sequences run under them.
      stats: the engine's counters (`steps` picks the version a step serves).
    """

    def __init__(self, weights_version: str, table: RequestTable, stats: dict):
        self.weights_version = weights_version
        self.versions = [weights_version]
        self.table = table
        self.stats = stats

    def active(self) -> str:
        """The weights version the next step serves: versions in flight take turns by step."""
        t = self.table
        live = {s.weights_version for s in t.running + t.swapped + t.waiting}
        versions = [v for v in self.versions if v in live] or [self.weights_version]
        return versions[self.stats["steps"] % len(versions)]

    def live(self) -> set[str]:
        """Weights versions some unfinished sequence runs under, and the newest."""
        t = self.table
        live = {s.weights_version for s in t.running + t.swapped + t.waiting}
        return live | {self.weights_version}

    def drop_unused(self) -> None:
        """Forgets the versions no unfinished sequence runs under (the newest stays)."""
        live = self.live()
        self.versions = [v for v in self.versions if v in live]

    def update(self, version: str, in_flight: WeightUpdatePolicy) -> None:
        """New weights serve from the next step; sequences in flight follow `in_flight`."""
        t = self.table
        self.weights_version = version
        self.versions.append(version)
        # Every cached page of older weights stops matching here (its provenance differs).
        t.tracer.emit("weights_update", "page", "pages/device", version=version,
                      in_flight=in_flight.value)
        for seq in list(t.running + t.swapped + t.waiting):
            started = seq.num_computed > 0 or seq.status is not SeqStatus.WAITING or \
                len(seq.tokens) > seq.num_prompt_tokens
            if seq.is_chunk_fill and in_flight is not WeightUpdatePolicy.FINISH_OLD:
                # A chunk under old weights serves no request now: a new one is filled on need.
                t.finish(seq, FinishReason.ABORT)
                t.maybe_emit(seq.request_id)
            elif not started or in_flight is WeightUpdatePolicy.RECOMPUTE:
                if started:
                    t.tracer.emit("invalidate", "request", f"request/{seq.request_id}",
                                  seq_id=seq.seq_id, version=version)
                t.restart(seq)
                seq.weights_version = version
            elif in_flight is WeightUpdatePolicy.ABORT:
                t.finish(seq, FinishReason.ABORT)
                t.maybe_emit(seq.request_id)
        self.drop_unused()
