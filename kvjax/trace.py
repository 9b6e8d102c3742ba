"""KV-semantic tracing: request, page, transfer and step events as a Perfetto trace.

The engine hands one tracer down to the scheduler, the KV cache manager, the allocator and
the tiers; each emits plain events into it. Tracing is off by default: every component then
holds `NULL_TRACER`, whose methods return at once, so a disabled trace costs one call.

Tracks are strings, grouped by the part before the first '/': `request/<id>` (lifecycle),
`pages/device` (allocations, frees, evictions, releases into the prefix cache, KV ops),
`tier/<kind>` (transfer states), `step` (step spans), `counters` (pages used per tier).
`to_chrome` writes the Trace Event Format (Chrome's "Trace Event Format" document),
which ui.perfetto.dev opens: one process per group, one thread per track.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, NamedTuple


class TraceEvent(NamedTuple):
    """One event.

    Attributes:
      name: what happened (`allocate`, `preempt`, `step`, ...).
      cat: the layer that emitted it (`request`, `page`, `transfer`, `step`, `counter`).
      ts_us: when, in microseconds of the tracer's clock.
      track: the track it belongs to (see the module docstring).
      ph: the Trace Event phase: 'i' instant, 'X' complete span, 'C' counter.
      dur_us: a span's length in microseconds (0 otherwise).
      args: event data (a counter's series: name -> number).
    """

    name: str
    cat: str
    ts_us: float
    track: str
    ph: str = "i"
    dur_us: float = 0.0
    args: dict | None = None


class Tracer:
    """Records events in memory; `export` writes them as Chrome/Perfetto trace JSON.

    Attributes:
      enabled: True (emitters may skip work that only feeds the trace when False).
      events: the events, in emission order.
    """

    enabled = True

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.events: list[TraceEvent] = []

    def now_us(self) -> float:
        return self.clock() * 1e6

    def emit(self, name: str, cat: str, track: str, **args: Any) -> None:
        """An instant event now."""
        self.events.append(TraceEvent(name, cat, self.now_us(), track, "i", 0.0, args))

    def span(self, name: str, cat: str, track: str, start_s: float, dur_s: float,
             **args: Any) -> None:
        """A complete span from `start_s` (tracer clock, seconds) lasting `dur_s` seconds."""
        self.events.append(TraceEvent(name, cat, start_s * 1e6, track, "X", dur_s * 1e6, args))

    def counter(self, name: str, **values: float) -> None:
        """Counter samples now (name -> number), drawn as one counter track per name."""
        self.events.append(TraceEvent(name, "counter", self.now_us(), "counters", "C", 0.0,
                                      values))

    def count(self, name: str) -> int:
        """How many events named `name` were recorded."""
        return sum(e.name == name for e in self.events)

    def to_chrome(self) -> dict:
        """The events in the Trace Event Format (JSON object form)."""
        return to_chrome(self.events)

    def export(self, path: str | os.PathLike) -> None:
        """Writes the trace JSON to `path`."""
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)


class NullTracer(Tracer):
    """Tracing off: records nothing."""

    enabled = False

    def __init__(self):
        super().__init__()

    def emit(self, name: str, cat: str, track: str, **args: Any) -> None:
        pass

    def span(self, name: str, cat: str, track: str, start_s: float, dur_s: float,
             **args: Any) -> None:
        pass

    def counter(self, name: str, **values: float) -> None:
        pass


NULL_TRACER = NullTracer()

_GROUPS = ("step", "request", "pages", "tier", "counters")


def _ids(track: str, tids: dict[str, int]) -> tuple[int, int]:
    """(pid, tid) of a track: one process per group, one thread per track."""
    group = track.split("/", 1)[0]
    pid = _GROUPS.index(group) + 1 if group in _GROUPS else len(_GROUPS) + 1
    return pid, tids.setdefault(track, len(tids) + 1)


def to_chrome(events: list[TraceEvent]) -> dict:
    """Trace Event Format JSON: events (ts, dur in microseconds) plus track-name metadata."""
    tids: dict[str, int] = {}
    out = []
    for e in events:
        pid, tid = _ids(e.track, tids)
        record = dict(name=e.name, cat=e.cat, ph=e.ph, ts=e.ts_us, pid=pid, tid=tid,
                      args=e.args or {})
        if e.ph == "X":
            record["dur"] = e.dur_us
        elif e.ph == "i":
            record["s"] = "t"
        out.append(record)
    meta = []
    for track, tid in tids.items():
        pid = _ids(track, tids)[0]
        meta.append(dict(name="thread_name", ph="M", pid=pid, tid=tid, args=dict(name=track)))
    for pid, group in enumerate(_GROUPS, start=1):
        meta.append(dict(name="process_name", ph="M", pid=pid, tid=0, args=dict(name=group)))
    return dict(traceEvents=meta + out, displayTimeUnit="ms")
