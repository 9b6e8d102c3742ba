"""The engine core: one step is schedule -> execute -> update, and nothing else.

With asynchronous scheduling the three overlap across steps: the host schedules step t+1 and
dispatches it while the device still runs step t, then reads step t's tokens and updates the
scheduler from them. Tokens sampled by step t reach step t+1 on the device (the runner's token
feed); the host learns them one step later. `drain()` finishes the step in flight, for
anything that needs the state settled (aborts, weight updates, snapshots, logits).

A step with a row under a grammar (`kvjax.grammar`) is finished before the next one is
scheduled: that row's next mask depends on the token it samples, which only the host's
matcher can turn into a mask. Steps without such rows keep overlapping.
"""

from __future__ import annotations

import time

from kvjax.engine.runner import InFlightStep, ModelRunner
from kvjax.engine.step import LogitsMode
from kvjax.scheduler.request import RequestOutput
from kvjax.scheduler.scheduler import Scheduler
from kvjax.trace import NULL_TRACER, Tracer


class EngineCore:
    """Drives the scheduler and the model runner, one step at a time.

    Attributes:
      scheduler: decides each step (host only).
      runner: runs it (owns the device KV pool and params).
      async_scheduling: overlap the host's scheduling of step t+1 with the device's step t.
      debug_provenance: check before each step that no row reads a page of other weights.
      last_logits: the logits the last step returned (per its LogitsMode), or None.
      last_sampled_rows: (sequence id, row of last_logits) of each row of the last step
        that sampled its sequence's next token.
      kv_samples: per step, (time, bytes holding live tokens, bytes reserved by sequences).
      tracer: where step spans and per-tier page counters go (NULL_TRACER: nowhere).
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *, stats: dict,
                 async_scheduling: bool = False, debug_provenance: bool = False,
                 tracer: Tracer = NULL_TRACER):
        self.scheduler = scheduler
        self.runner = runner
        self.stats = stats
        self.async_scheduling = async_scheduling
        self.debug_provenance = debug_provenance
        self.last_logits = None
        self.last_sampled_rows: tuple[tuple[str, int], ...] = ()
        self.kv_samples: list[tuple[float, int, int]] = []
        self._in_flight: InFlightStep | None = None
        self.tracer = tracer
        self.stats.update(host_time_s=0.0, step_time_s=0.0)

    @property
    def has_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def step(self, logits_mode: LogitsMode = LogitsMode.NONE) -> list[RequestOutput]:
        """One scheduling iteration; returns the outputs of requests that finished in it."""
        is_sync = not self.async_scheduling or logits_mode is not LogitsMode.NONE
        if is_sync or (self._in_flight is not None and self._in_flight.so.is_constrained):
            self.drain()
        t_start = time.perf_counter()
        # Steps that return logits emit one token per row (no speculative verification).
        so = self.scheduler.schedule(speculate=logits_mode is LogitsMode.NONE)
        dispatched = None
        if not so.is_empty:
            if self.debug_provenance:
                self.scheduler.check_fresh(so)
            t_dispatch = time.perf_counter()
            dispatched = self.runner.dispatch(so, logits_mode)
            if not is_sync and self._in_flight is None and self.runner.num_tier_transfers:
                # No step's output comes before the next step is planned: the tier transfers
                # of this step's plan (dispatched ahead of its model) are reported now, so
                # they commit at the next schedule as they would synchronously.
                self.scheduler.receive_tier_landed(self.runner.tier_landed(wait=True))
            self.stats["step_time_s"] += time.perf_counter() - t_dispatch
            t_host = t_dispatch - t_start
        else:
            self.runner.apply_ops(so.kv_plan)  # no step to dispatch: e.g. a preemption's scrub
            if self._in_flight is None and self.runner.num_tier_transfers:
                # Nothing runs until tier transfers land: wait for them, and commit what landed.
                self.runner.apply_ops(self.scheduler.update_from_output(
                    so, self.runner.idle_output()))
            t_host = time.perf_counter() - t_start
        if self._in_flight is not None:
            self._resolve(self._in_flight)
        self._in_flight = dispatched
        if is_sync:
            self.drain()
        self.stats["host_time_s"] += t_host
        if self.tracer.enabled and dispatched is not None:
            self._trace_step(dispatched, t_start, t_host, logits_mode)
        return self.scheduler.take_finished()

    def _trace_step(self, step: InFlightStep, t_start: float, t_host: float,
                    logits_mode: LogitsMode) -> None:
        """A span for the step (start to now: host scheduling, dispatch, any wait) and the
        pages each tier holds after it."""
        so = step.so
        shape = self.runner.buckets.shape_for(so, logits_mode) if so.rows else None
        t_end = time.perf_counter()
        self.tracer.span("step", "step", "step", t_start, t_end - t_start,
                         rows=len(so.rows), tokens=sum(r.num_tokens for r in so.rows),
                         padded_rows=shape.num_rows if shape else 0,
                         padded_tokens=shape.num_tokens if shape else 0,
                         host_s=t_host, device_s=t_end - t_start - t_host,
                         preempted=len(so.preempted))
        self.tracer.counter("pages", **self.scheduler.kv_cache.pages_in_use())

    def drain(self) -> None:
        """Finishes the step in flight, if any: its tokens reach the scheduler."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._resolve(step)

    def _resolve(self, step: InFlightStep) -> None:
        t0 = time.perf_counter()
        out = self.runner.fetch(step)
        t1 = time.perf_counter()
        self.last_logits = out.logits
        self.last_sampled_rows = tuple((row.seq_id, index) for row, index in
                                       zip(step.so.rows, step.row_index, strict=True)
                                       if row.samples)
        self.runner.apply_ops(self.scheduler.update_from_output(step.so, out))
        self.runner.keep_params(self.scheduler.versions)
        # Step time: dispatching and waiting for the device; host time: the host's own work.
        self.stats["step_time_s"] += t1 - t0
        self.stats["host_time_s"] += time.perf_counter() - t1
        self._sample_kv()

    def _sample_kv(self) -> None:
        live, reserved = self.scheduler.kv_sample()
        per_token = self.scheduler.config.kv_bytes_per_token
        self.kv_samples.append((self.scheduler.clock(), int(live * per_token),
                                int(reserved * per_token)))
