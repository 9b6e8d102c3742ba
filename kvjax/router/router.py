"""A router spreading requests over several in-process engine instances.

`Router(engines, policy)` has the engine's request API (`add_request`, `step`,
`has_unfinished`, `generate`); each request goes to one instance, chosen by a routing policy
(`kvjax.router.policies`) from a snapshot of every instance: the requests the router sent it
that have not finished, and how much of the prompt its prefix cache holds. Instances can be
single-device engines or tensor-parallel engines over disjoint meshes (data parallelism:
`kvjax.parallel.sharding.replica_meshes`).

In one process the instances take turns on the host, so wall-clock latencies of a routed run
add up every instance's work. `replay` estimates what independent instances would do instead:
each engine keeps a `SimClock` that advances only by the time of its own steps, and requests
arrive at their trace times (a discrete-event simulation driven by measured step times).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvjax.engine.engine import Engine
from kvjax.engine.request import RequestOutput, submit_all
from kvjax.router.policies import InstanceState, RouteRequest, RoutingPolicy, make_policy
from kvjax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class _Routed:
    """A request the router sent to an instance and has not seen finish."""

    prompt: np.ndarray  # [S] int32
    tenant: str | None
    num_tokens: int  # (prompt + max new tokens) x n


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if mismatch.size else n


class Router:
    """Spreads requests over engine instances with a routing policy.

    Attributes:
      engines: the instances, indexed as policies see them.
      policy: the `RoutingPolicy`.
      routed_to: request id -> index of the instance it was sent to (every request so far).
    """

    def __init__(self, engines: Sequence[Engine], policy: str | RoutingPolicy = "round_robin"):
        if not engines:
            raise ValueError("a router needs at least one engine")
        page_sizes = {e.config.page_size for e in engines}
        if len(page_sizes) > 1:
            raise ValueError(f"engines must share one page size, got {sorted(page_sizes)}")
        self.engines = list(engines)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.page_size = page_sizes.pop()
        self.routed_to: dict[str, int] = {}
        self._outstanding: list[dict[str, _Routed]] = [{} for _ in self.engines]
        self._ids = itertools.count()

    # ----------------------------------------------------------------------------- routing

    def _prefix_tokens(self, index: int, prompt: np.ndarray, tenant: str | None) -> int:
        """Leading prompt tokens whose KV instance `index` holds or is computing."""
        engine = self.engines[index]
        cached = 0
        peek = getattr(engine.allocator, "peek_cached_tokens", None)
        if peek is not None:
            cached = peek(prompt.tolist(), cache_key=engine.provenance(tenant))
        # A routed, unfinished request's prompt pages become cache hits once it is prefilled.
        shared = max((_common_prefix_len(prompt, r.prompt)
                      for r in self._outstanding[index].values() if r.tenant == tenant),
                     default=0)
        shared = min(shared, len(prompt) - 1) // self.page_size * self.page_size
        return max(cached, shared)

    def instance_states(self, prompt_ids: Sequence[int], tenant: str | None = None
                        ) -> list[InstanceState]:
        """What the policy sees of every instance for a request with this prompt."""
        prompt = np.asarray(prompt_ids, np.int32)
        return [InstanceState(num_seqs=len(routed),
                              num_tokens=sum(r.num_tokens for r in routed.values()),
                              prefix_tokens=self._prefix_tokens(i, prompt, tenant))
                for i, routed in enumerate(self._outstanding)]

    def add_request(self, request_id: str, prompt_ids: Sequence[int],
                    sampling: SamplingParams | None = None, *, tenant: str | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> int:
        """Routes a request to an instance and queues it there; returns the instance index.

        Invalid requests raise ValueError and change nothing.
        """
        if request_id in self.routed_to:
            raise ValueError(f"duplicate request_id {request_id!r}")
        sampling = sampling or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        states = self.instance_states(prompt, tenant)
        index = self.policy.choose(RouteRequest(prompt_len=len(prompt), tenant=tenant), states)
        if not 0 <= index < len(self.engines):
            raise ValueError(f"policy {self.policy.name!r} chose instance {index} of "
                             f"{len(self.engines)}")
        self.engines[index].add_request(request_id, prompt, sampling, tenant=tenant,
                                        priority=priority, arrival_time=arrival_time)
        self.routed_to[request_id] = index
        self._outstanding[index][request_id] = _Routed(
            prompt=np.asarray(prompt, np.int32), tenant=tenant,
            num_tokens=(len(prompt) + sampling.max_new_tokens) * sampling.n)
        return index

    def abort(self, request_id: str) -> None:
        """Stops a request on its instance (it finishes with reason ABORT at the next step)."""
        if request_id not in self.routed_to:
            raise ValueError(f"unknown request_id {request_id!r}")
        self.engines[self.routed_to[request_id]].abort(request_id)

    # ----------------------------------------------------------------------------- stepping

    def step_instance(self, index: int) -> list[RequestOutput]:
        """One iteration of instance `index`; returns the requests that finished in it."""
        finished = self.engines[index].step()
        for out in finished:
            self._outstanding[index].pop(out.request_id, None)
        return finished

    def instance_has_work(self, index: int) -> bool:
        """Whether instance `index` has requests to run or outputs to hand back."""
        return self.engines[index].has_unfinished() or bool(self._outstanding[index])

    def step(self) -> list[RequestOutput]:
        """One iteration of every instance with work; returns the requests that finished."""
        finished = []
        for index in range(len(self.engines)):
            if self.instance_has_work(index):
                finished += self.step_instance(index)
        return finished

    def has_unfinished(self) -> bool:
        return any(self.instance_has_work(i) for i in range(len(self.engines)))

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Runs prompts to completion over the instances; invalid ones come back with `error`."""
        ids, results = submit_all(self.add_request, prompts, sampling,
                                  f"route-{next(self._ids)}", self.engines[0].clock())
        pending = {r for r in ids if r not in results}
        while pending:
            for out in self.step():
                if out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
        return [results[r] for r in ids]

    def prefix_cache_stats(self) -> dict[str, int]:
        """The instances' prefix-cache counters, summed."""
        total = collections.Counter()
        for engine in self.engines:
            total.update(engine.prefix_cache_stats())
        return dict(total)


class SimClock:
    """Simulated time of one instance: it advances by the instance's own measured busy time.

    Call it for the current time (an engine takes it as its `clock`); wrap each step of the
    instance in `busy()`, and move an idle instance forward with `advance_to`. Busy time is
    measured with `timer`: wall time by default; `time.process_time` (CPU seconds of this
    process, all threads) keeps other jobs on a shared machine out of the measurement.
    """

    def __init__(self, start_s: float = 0.0, *,
                 timer: Callable[[], float] = time.perf_counter):
        self._now = start_s
        self._timer = timer
        self._busy_since: float | None = None

    def __call__(self) -> float:
        if self._busy_since is None:
            return self._now
        return self._now + self._timer() - self._busy_since

    def advance_to(self, t: float) -> None:
        """Idles until simulated time t (no-op if already past it)."""
        self._now = max(self._now, t)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Advances the clock by the wall time the block takes."""
        self._busy_since = self._timer()
        try:
            yield
        finally:
            self._now += self._timer() - self._busy_since
            self._busy_since = None


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A request of a replayed trace.

    Attributes:
      request_id, prompt_ids, sampling, tenant: as for `add_request`.
      arrival_time: simulated seconds from the start of the replay.
    """

    request_id: str
    arrival_time: float
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    tenant: str | None = None


def replay(router: Router, arrivals: Sequence[Arrival]) -> list[RequestOutput]:
    """Serves a trace as if every instance ran on its own hardware; returns the outputs.

    Every engine must use a `SimClock`. At each turn the instance whose clock is earliest
    steps, unless a request arrives before it: that request is routed with the instances' state
    at that moment. Idle instances wait for the next arrival. Outputs carry simulated times.
    """
    clocks = [e.clock for e in router.engines]
    if not all(isinstance(c, SimClock) for c in clocks):
        raise ValueError("replay needs every engine to use a SimClock as its clock")
    pending = collections.deque(sorted(arrivals, key=lambda a: a.arrival_time))
    outputs = []
    while pending or router.has_unfinished():
        busy = [i for i in range(len(router.engines)) if router.instance_has_work(i)]
        next_step = min((clocks[i]() for i in busy), default=math.inf)
        if pending and pending[0].arrival_time <= next_step:
            a = pending.popleft()
            for i in range(len(router.engines)):
                if not router.instance_has_work(i):
                    clocks[i].advance_to(a.arrival_time)
            router.add_request(a.request_id, a.prompt_ids, a.sampling, tenant=a.tenant,
                               arrival_time=a.arrival_time)
            continue
        index = min(busy, key=lambda i: clocks[i]())
        with clocks[index].busy():
            outputs += router.step_instance(index)
    return outputs
