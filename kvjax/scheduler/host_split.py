"""Split policies: how many of each decode row's pages live in the host pool, where its
decode attention reads them (`kvjax.engine.host_rows`).

Each step the scheduler shows the policy its decode rows (`RowPlacement`) and the free pages of
both pools; the policy answers a target host-page count per row (rows it leaves out keep
theirs), and whether rows go to the host instead of being preempted when the device pool is
full. The KV cache manager moves the pages (`to_host`, `to_device`). Registered by name
(`HOST_SPLITS`, `EngineConfig.host_split`):

* `never`: every page on the device (the engine still holds no host pool).
* `when_full`: rows stay on the device until a decode row finds no page; then, instead of
  preempting, the lowest-ranked row's full pages go to the host pool.
* `always`: every full page of every decode row lives in the host pool.
* `random`: a seeded random split each step (every row a random count; tests every path).
* `neo`: NEO's balance, from measured or modelled rates: whole rows go to the host, longest
  first, while the host's attention time stays within the device's time for the rest of the
  step (they run side by side); with `when_full` behaviour on top.

Every policy takes the rates a KV controller prices its "host" action with
(`host_tokens_per_s`, `device_step_s` in `EngineConfig.host_split_options`; measured with
`kvjax.bench.host_attention.measure_attention_rate`, else the modelled ones) and returns them
from `rates()`; `neo` also splits by them.

With a KV controller on, the controller owns the rows it moves to the host pool
(`Decisions.to_host`): a policy's target that would bring such a row back is applied only once
the device's free pages cover the controller's `Decisions.reserve` and the row's pages
(`kvjax.scheduler.placement.HostPlacement`); from then on the row is the policy's again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvjax.registry import Registry

# The modelled rates of a policy that measured none (tokens of KV per second, seconds).
HOST_TOKENS_PER_S, DEVICE_TOKENS_PER_S, DEVICE_STEP_S = 2e8, 4e9, 5e-3


@dataclasses.dataclass(frozen=True)
class RowPlacement:
    """One decode row as a split policy sees it.

    Attributes:
      seq_id: the sequence.
      num_tokens: tokens in its cache after this step.
      num_full_pages: its pages that may live in the host pool (full, not written this step).
      num_host_pages: its pages in the host pool now.
    """

    seq_id: str
    num_tokens: int
    num_full_pages: int
    num_host_pages: int


class HostSplitPolicy(Protocol):
    name: str
    offloads_when_full: bool  # rows go to the host pool instead of being preempted
    uses_host: bool  # the engine needs a host pool

    def targets(self, rows: Sequence[RowPlacement], num_free_device: int,
                num_free_host: int) -> dict[str, int]:
        """seq_id -> host pages wanted (0 .. num_full_pages); rows left out keep theirs."""

    def rates(self) -> tuple[float, float]:
        """(host decode-attention tokens per second, device step seconds) for a controller."""


def _check_rates(name: str, **rates: float) -> None:
    for key, value in rates.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{name} split: {key} must be a number > 0, got {value!r}")


class Never:
    """Args (every policy's): host_tokens_per_s, the host's decode-attention rate (tokens of
    KV one query reads per second); device_step_s, the device's time for a step, which host
    attention runs beside. A KV controller prices a host-resident row with them (`rates`)."""

    name = "never"
    offloads_when_full = False
    uses_host = False

    def __init__(self, host_tokens_per_s: float = HOST_TOKENS_PER_S,
                 device_step_s: float = DEVICE_STEP_S):
        _check_rates(self.name, host_tokens_per_s=host_tokens_per_s,
                     device_step_s=device_step_s)
        self.host_tokens_per_s = host_tokens_per_s
        self.device_step_s = device_step_s

    def targets(self, rows, num_free_device, num_free_host) -> dict[str, int]:
        return {}

    def rates(self) -> tuple[float, float]:
        """(the host's decode-attention tokens per second, the device's step seconds) a KV
        controller prices a host-resident row with."""
        return self.host_tokens_per_s, self.device_step_s


class WhenFull(Never):
    name = "when_full"
    offloads_when_full = True
    uses_host = True


class Always(Never):
    name = "always"
    uses_host = True

    def targets(self, rows, num_free_device, num_free_host) -> dict[str, int]:
        return {r.seq_id: r.num_full_pages for r in rows}


class RandomSplit(Never):
    name = "random"
    uses_host = True

    def __init__(self, seed: int = 0, **rates: float):
        super().__init__(**rates)
        self._rng = np.random.default_rng(seed)

    def targets(self, rows, num_free_device, num_free_host) -> dict[str, int]:
        return {r.seq_id: int(self._rng.integers(0, r.num_full_pages + 1)) for r in rows}


class Neo(Never):
    """NEO's split from rates (tokens of KV one decode query reads per second).

    Args:
      host_tokens_per_s: the host's decode-attention rate (measure it with
        `kvjax.bench.host_attention.measure_attention_rate`).
      device_tokens_per_s: the device's decode-attention rate.
      device_step_s: the device's time for the rest of a step (weights, sampling).
    """

    name = "neo"
    offloads_when_full = True
    uses_host = True

    def __init__(self, host_tokens_per_s: float = HOST_TOKENS_PER_S,
                 device_tokens_per_s: float = DEVICE_TOKENS_PER_S,
                 device_step_s: float = DEVICE_STEP_S):
        super().__init__(host_tokens_per_s, device_step_s)
        _check_rates(self.name, device_tokens_per_s=device_tokens_per_s)
        self.device_tokens_per_s = device_tokens_per_s

    def targets(self, rows, num_free_device, num_free_host) -> dict[str, int]:
        device_s = self.device_step_s + sum(r.num_tokens for r in rows) / \
            self.device_tokens_per_s
        host_s, free, out = 0.0, num_free_host, {}
        for r in sorted(rows, key=lambda r: -r.num_tokens):
            cost = r.num_full_pages and r.num_tokens / self.host_tokens_per_s
            extra = r.num_full_pages - r.num_host_pages
            saved = r.num_tokens / self.device_tokens_per_s
            if cost and host_s + cost <= device_s - saved and extra <= free:
                host_s, device_s, free = host_s + cost, device_s - saved, free - extra
                out[r.seq_id] = r.num_full_pages
            else:
                out[r.seq_id] = 0  # back on the device where it finds room
        return out


HOST_SPLITS = Registry.of("host split policy", Never, WhenFull, Always, RandomSplit, Neo)


def make_host_split(name: str, **options) -> HostSplitPolicy:
    return HOST_SPLITS.make(name, **options)
