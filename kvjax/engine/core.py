"""The engine core: one step is schedule -> execute -> update, and nothing else."""

from __future__ import annotations

import time

from kvjax.engine.runner import ModelRunner
from kvjax.engine.step import LogitsMode
from kvjax.scheduler.request import RequestOutput
from kvjax.scheduler.scheduler import Scheduler


class EngineCore:
    """Drives the scheduler and the model runner, one step at a time.

    Attributes:
      scheduler: decides each step (host only).
      runner: runs it (owns the device KV pool and params).
      debug_provenance: check before each step that no row reads a page of other weights.
      last_logits: the logits the last step returned (per its LogitsMode), or None.
      kv_samples: per step, (time, bytes holding live tokens, bytes reserved by sequences).
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *, stats: dict,
                 debug_provenance: bool = False):
        self.scheduler = scheduler
        self.runner = runner
        self.stats = stats
        self.debug_provenance = debug_provenance
        self.last_logits = None
        self.kv_samples: list[tuple[float, int, int]] = []
        self.stats.update(host_time_s=0.0, step_time_s=0.0)

    def step(self, logits_mode: LogitsMode = LogitsMode.NONE) -> list[RequestOutput]:
        """One scheduling iteration; returns the outputs of requests that finished in it."""
        t_start = time.perf_counter()
        so = self.scheduler.schedule()
        if not so.is_empty:
            if self.debug_provenance:
                self.scheduler.check_fresh(so)
            t_dispatch = time.perf_counter()
            out = self.runner.execute(so, logits_mode)
            t_done = time.perf_counter()
            self.last_logits = out.logits
            self.scheduler.update_from_output(so, out)
            self.runner.keep_params(self.scheduler.versions)
            self.stats["step_time_s"] += t_done - t_dispatch
            self.stats["host_time_s"] += (t_dispatch - t_start) + (time.perf_counter() - t_done)
            self._sample_kv()
        return self.scheduler.take_finished()

    def _sample_kv(self) -> None:
        live, reserved = self.scheduler.kv_sample()
        per_token = self.scheduler.config.kv_bytes_per_token
        self.kv_samples.append((self.scheduler.clock(), int(live * per_token),
                                int(reserved * per_token)))
