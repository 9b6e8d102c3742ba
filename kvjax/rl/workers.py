"""Rollouts over several engines: rollout workers in this process or as Ray actors.

    pool = RayRolloutPool(2, functools.partial(kvjax.load_model, None, "float32"), config)
    pool.start(prompts, sampling, group_size=4, seed=0)
    while not pool.step():
        if time_to_update:
            pool.update_weights(trainer.params, "v1")
    batch = pool.result()

A `RolloutWorker` holds one engine and runs a contiguous shard of the rollout's prompts as a
`Rollout` whose seeds continue the whole rollout's: prompt p keeps seed `seed + p * group_size`
whichever worker runs it. A pool steps its workers in lockstep (one engine step each per
`step()`), so a weight update lands on every worker between the same two steps;
`update_weights` ships the params once (on Ray: one `ray.put`, every actor reads the same
object) and each engine tags the tokens it samples afterwards with the new version. `result()`
merges the shards, prompt-major, into one `RolloutBatch`, as one engine's `Rollout` orders it.

`LocalRolloutPool` keeps its workers in this process (taking turns on the host);
`RayRolloutPool` makes each a Ray actor with one CPU. Ray is an optional extra
(`pip install 'kvjax[ray]'`), imported only when a `RayRolloutPool` is built.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.request import WeightUpdatePolicy
from kvjax.models.model import Model
from kvjax.rl.rollout import Rollout, RolloutBatch, pad_batch
from kvjax.sampling import SamplingParams

_COUNTED_STATS = ("steps", "weight_updates", "stale_kv_reads")


class RolloutWorker:
    """One engine running one shard of each rollout.

    Attributes:
      engine: the worker's engine.
    """

    def __init__(self, model_factory: Callable[[], Model],
                 engine_config: EngineConfig | None = None):
        self.engine = Engine(model_factory(), engine_config)
        self._rollout: Rollout | None = None

    def start(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
              group_size: int, seed: int, name: str) -> None:
        """Queues a shard: its prompts' seeds start at `seed` (see `Rollout`)."""
        self._rollout = Rollout(self.engine, prompts, sampling, group_size=group_size,
                                seed=seed, name=name)

    def step(self) -> bool:
        """One engine step unless the shard is done; returns whether it is done."""
        if not self._rollout.done:
            self._rollout.step()
        return self._rollout.done

    def update_weights(self, params: Any, version: str, in_flight: WeightUpdatePolicy) -> None:
        """Swaps in `params` (host arrays, as shipped) under `version`."""
        self.engine.update_weights(jax.device_put(params), version, in_flight=in_flight)

    def num_in_flight(self) -> int:
        """Samples that have generated tokens but not finished."""
        return sum(1 for out in self.engine.snapshot_outputs() for s in out.outputs
                   if s.token_ids and s.finish_reason is None)

    def result(self) -> RolloutBatch:
        return self._rollout.result()

    def stats(self) -> dict[str, int]:
        """Engine steps, weight updates, stale KV reads and prefix-cache hit tokens."""
        stats = {k: int(self.engine.stats[k]) for k in _COUNTED_STATS}
        return dict(stats, **{k: int(v) for k, v in self.engine.metrics().items()
                              if k in ("prefill_tokens", "prefix_hit_tokens")})


def shard_bounds(num_prompts: int, num_workers: int) -> list[tuple[int, int]]:
    """[start, end) of each non-empty contiguous shard, sizes differing by at most one."""
    edges = np.linspace(0, num_prompts, num_workers + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def merge_batches(batches: Sequence[RolloutBatch], *, pad_to: int | None = None,
                  pad_multiple: int = 16) -> RolloutBatch:
    """Shards' batches (in prompt order) as one prompt-major `RolloutBatch`."""
    group_sizes = {b.group_size for b in batches}
    if len(group_sizes) != 1:
        raise ValueError(f"shards have different group sizes {sorted(group_sizes)}")
    prompts = [p for b in batches for p in b.prompt_ids]
    fields = {name: [x for b in batches for x in getattr(b, name)]
              for name in ("completion_ids", "logprobs", "token_versions", "finish_reasons",
                           "texts")}
    group_size = group_sizes.pop()
    tokens, loss_mask, old_logprobs = pad_batch(
        [prompts[i // group_size] for i in range(len(fields["completion_ids"]))],
        fields["completion_ids"], fields["logprobs"], fields["finish_reasons"],
        pad_to=pad_to, pad_multiple=pad_multiple)
    return RolloutBatch(prompt_ids=prompts, group_size=group_size, tokens=tokens,
                        loss_mask=loss_mask, old_logprobs=old_logprobs, **fields)


class RolloutPool(Protocol):
    """Workers driven in lockstep through one rollout at a time."""

    num_workers: int

    def start(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
              group_size: int, seed: int = 0, name: str = "rollout") -> None: ...

    def step(self) -> bool: ...

    def update_weights(self, params: Any, version: str, *,
                       in_flight: WeightUpdatePolicy = WeightUpdatePolicy.RECOMPUTE) -> None: ...

    def num_in_flight(self) -> int: ...

    def result(self, *, pad_to: int | None = None) -> RolloutBatch: ...

    def stats(self) -> dict[str, int]: ...


class _Pool(abc.ABC):
    """What both pools share; `_call` is where they differ."""

    def __init__(self, num_workers: int):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        self.num_workers = num_workers
        self._active: list[int] = []

    @abc.abstractmethod
    def _call(self, method: str, calls: dict[int, tuple]) -> list:
        """Runs `method` on the workers `calls` names, with their (args, kwargs), all at once
        where they are actors; returns the results in `calls` order."""

    def _ship(self, params: Any) -> Any:
        return jax.device_get(params)

    def start(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
              group_size: int, seed: int = 0, name: str = "rollout") -> None:
        """Splits `prompts` into contiguous shards, one per worker (fewer if there are fewer
        prompts), each seeded as its prompts would be in one engine's `Rollout`."""
        if not prompts:
            raise ValueError("prompts is empty")
        bounds = shard_bounds(len(prompts), self.num_workers)
        self._active = list(range(len(bounds)))
        self._call("start", {w: ((prompts[a:b], sampling),
                                 dict(group_size=group_size, seed=seed + a * group_size,
                                      name=f"{name}/w{w}"))
                             for w, (a, b) in enumerate(bounds)})
        self._done = dict.fromkeys(self._active, False)

    def step(self) -> bool:
        """One engine step on every unfinished worker; returns whether all are done."""
        running = [w for w in self._active if not self._done[w]]
        for w, done in zip(running, self._call("step", {w: ((), {}) for w in running}),
                           strict=True):
            self._done[w] = done
        return all(self._done.values())

    def update_weights(self, params: Any, version: str, *,
                       in_flight: WeightUpdatePolicy = WeightUpdatePolicy.RECOMPUTE) -> None:
        """Every worker swaps in `params` under `version` before its next step."""
        shipped = self._ship(params)
        self._call("update_weights", {w: ((shipped, version, WeightUpdatePolicy(in_flight)), {})
                                      for w in range(self.num_workers)})

    def num_in_flight(self) -> int:
        return sum(self._call("num_in_flight", {w: ((), {}) for w in self._active}))

    def result(self, *, pad_to: int | None = None) -> RolloutBatch:
        """The finished rollout, merged over the shards (prompt-major)."""
        return merge_batches(self._call("result", {w: ((), {}) for w in self._active}),
                             pad_to=pad_to)

    def stats(self) -> dict[str, int]:
        """Every worker's counters summed."""
        per_worker = self._call("stats", {w: ((), {}) for w in range(self.num_workers)})
        return {k: sum(s[k] for s in per_worker) for k in per_worker[0]}


class LocalRolloutPool(_Pool):
    """Rollout workers in this process, stepped one after another."""

    def __init__(self, num_workers: int, model_factory: Callable[[], Model],
                 engine_config: EngineConfig | None = None):
        super().__init__(num_workers)
        self.workers = [RolloutWorker(model_factory, engine_config) for _ in range(num_workers)]

    def _call(self, method: str, calls: dict[int, tuple]) -> list:
        return [getattr(self.workers[w], method)(*args, **kwargs)
                for w, (args, kwargs) in calls.items()]


class RayRolloutPool(_Pool):
    """Rollout workers as Ray actors (one CPU each), each building its model with
    `model_factory` (a picklable callable); weights travel through the object store once per
    update."""

    def __init__(self, num_workers: int, model_factory: Callable[[], Model],
                 engine_config: EngineConfig | None = None):
        super().__init__(num_workers)
        import ray  # An optional extra: imported only when actors are made.

        self._ray = ray
        actor = ray.remote(num_cpus=1)(RolloutWorker)
        self.actors = [actor.remote(model_factory, engine_config) for _ in range(num_workers)]

    def _ship(self, params: Any) -> Any:
        return self._ray.put(jax.device_get(params))

    def _call(self, method: str, calls: dict[int, tuple]) -> list:
        return self._ray.get([getattr(self.actors[w], method).remote(*args, **kwargs)
                              for w, (args, kwargs) in calls.items()])

    def shutdown(self) -> None:
        """Ends the actors."""
        for actor in self.actors:
            self._ray.kill(actor)
