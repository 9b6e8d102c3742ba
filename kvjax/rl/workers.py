"""Rollouts over several engines: rollout workers in this process or as Ray actors.

    pool = RayRolloutPool(2, functools.partial(kvjax.load_model, None, "float32"), config)
    pool.start(prompts, sampling, group_size=4, seed=0)
    while not pool.step():
        if time_to_update:
            pool.update_weights(trainer.params, "v1")
    batch = pool.result()

A `RolloutWorker` holds one engine and runs its part of a rollout: one request per slice of a
prompt's samples, each sample seeded as in one engine's `Rollout` (sample i of prompt p with
`seed + p * group_size + i`), so where a sample runs does not change it. `SamplePlacement` says
which worker runs which samples: GROUP keeps a prompt's samples together (its prompt prefilled
once, its pages shared), SPREAD deals them out locality-blind. A pool steps its workers in
lockstep (one engine step each per `step()`), so a weight update lands on every worker between
the same two steps; `update_weights` ships the params once (on Ray: one `ray.put`, every actor
reads the same object) and each engine tags the tokens it samples afterwards with the new
version. `result()` merges the samples, prompt-major, into one `RolloutBatch`.

`move_pages(tokens, source, target)` copies the pages of a conversation that one worker's prefix
cache holds into another's (host-staged, provenance checked), so a trajectory can change worker
without recomputing its prompt (`kvjax.rl.agentic`, `TurnPlacement.MIGRATE`).

`LocalRolloutPool` keeps its workers in this process (taking turns on the host);
`RayRolloutPool` makes each a Ray actor with one CPU. Ray is an optional extra
(`pip install 'kvjax[ray]'`), imported only when a `RayRolloutPool` is built.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from kvjax.engine import kv_transfer
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason, RequestOutput, WeightUpdatePolicy
from kvjax.models.model import Model
from kvjax.rl.rollout import RolloutBatch, check_groups, pad_batch
from kvjax.sampling import SamplingParams

_COUNTED_STATS = ("steps", "weight_updates", "stale_kv_reads")


class SamplePlacement(enum.Enum):
    """Which worker runs which samples of a rollout.

    GROUP: a prompt's samples stay together on one worker, as one request of `group_size`
      samples sharing the prompt's KV pages (contiguous shards of prompts): each prompt is
      prefilled once.
    SPREAD: locality-blind, sample b of the rollout (prompt-major) on worker
      `b % num_workers`, one request each: a prompt is prefilled on every worker holding one
      of its samples, and its samples on one worker share its pages only through the prefix
      cache.
    """

    GROUP = "group"
    SPREAD = "spread"


@dataclasses.dataclass(frozen=True)
class SampleSlice:
    """Samples [first, first + n) of prompt `prompt_index`: one engine request."""

    prompt_index: int
    prompt_ids: list[int]
    first: int
    n: int


@dataclasses.dataclass(frozen=True)
class Sample:
    """One finished sample, as a worker hands it back.

    Attributes:
      prompt_index, sample_index: which prompt, which of its `group_size` samples.
      completion_ids, logprobs, token_versions, finish_reason, text: as in `RolloutBatch`.
    """

    prompt_index: int
    sample_index: int
    completion_ids: list[int]
    logprobs: np.ndarray
    token_versions: list[str]
    finish_reason: FinishReason
    text: str | None


def place_samples(num_prompts: int, group_size: int, num_workers: int,
                  placement: SamplePlacement) -> list[list[tuple[int, int, int]]]:
    """Per worker, its (prompt index, first sample, number of samples) requests."""
    workers: list[list[tuple[int, int, int]]] = [[] for _ in range(num_workers)]
    if placement is SamplePlacement.GROUP:
        for w, (a, b) in enumerate(shard_bounds(num_prompts, num_workers)):
            workers[w] = [(p, 0, group_size) for p in range(a, b)]
    else:
        for b in range(num_prompts * group_size):
            workers[b % num_workers].append((b // group_size, b % group_size, 1))
    return workers


class RolloutWorker:
    """One engine running its part of each rollout.

    Sample i of prompt p is sampled with seed `seed + p * group_size + i` (mod 2**32)
    whichever worker runs it and however its prompt's samples are split into requests (the
    engine seeds sample i of a request with the request's seed + i), so placement does not
    change a sample.

    Attributes:
      engine: the worker's engine.
    """

    def __init__(self, model_factory: Callable[[], Model],
                 engine_config: EngineConfig | None = None):
        self.engine = Engine(model_factory(), engine_config)
        self._slices: dict[str, SampleSlice] = {}
        self._outputs: dict[str, RequestOutput] = {}
        self._importer: kv_transfer.PageImporter | None = None
        self._exporter: kv_transfer.PageExporter | None = None
        self._pins = itertools.count()
        self._busy_s = 0.0

    def start(self, slices: Sequence[SampleSlice], sampling: SamplingParams, *,
              group_size: int, seed: int, name: str) -> None:
        """Queues one request per slice (all or none: each is validated first)."""
        self._slices = {f"{name}/{s.prompt_index}.{s.first}": s for s in slices}
        self._outputs = {}
        requests = [(rid, s.prompt_ids, dataclasses.replace(
            sampling, n=s.n, seed=(seed + s.prompt_index * group_size + s.first) % 2**32))
            for rid, s in self._slices.items()]
        for request in requests:
            self.engine.validate_request(*request)
        for request in requests:
            self.engine.add_request(*request)

    @property
    def done(self) -> bool:
        return len(self._outputs) == len(self._slices)

    def step(self) -> bool:
        """One engine step unless its part is done; returns whether it is done."""
        if not self.done:
            start = time.perf_counter()
            for out in self.engine.step():
                if out.request_id in self._slices:
                    self._outputs[out.request_id] = out
            self._busy_s += time.perf_counter() - start
        return self.done

    def warm_migration(self) -> None:
        """Compiles the page export and import for every padded page count, once per worker;
        the KV is unchanged. Raises ValueError unless the engine is paged with a prefix cache."""
        if self._importer is None:
            self._importer = kv_transfer.PageImporter(self.engine)
            self._importer.warmup()
            self._exporter = kv_transfer.PageExporter(self.engine)
            self._exporter.warmup()

    def export_pages(self, tokens: Sequence[int]) -> tuple[list[np.ndarray], int, bytes]:
        """The full pages of `tokens`' longest prefix in this worker's prefix cache.

        Returns host arrays (`[L, n, ...]` per page leaf, n padded to a power of 2; none when
        nothing is cached), the number of valid pages and the provenance they were made under.
        """
        if self._exporter is None:
            self._exporter = kv_transfer.PageExporter(self.engine)
        staged, num = self._exporter.export_prefix(tokens, None)
        host = [] if staged is None else [np.asarray(x) for x in jax.device_get(staged)]
        return host, num, self.engine.provenance()

    def import_pages(self, tokens: Sequence[int], staged: Sequence[np.ndarray], num_staged: int,
                     provenance: bytes) -> kv_transfer.ImportResult:
        """Commits exported pages of `tokens` to this worker's prefix cache, unpinned.

        Pages it holds already are kept. Raises ValueError when the pages were made under
        another provenance (other weights, codec or page size): they would be read as this
        worker's own.
        """
        if provenance != self.engine.provenance():
            raise ValueError("the pages were computed under another KV provenance than this "
                             "worker's (weights version, codec or page size differ)")
        self.warm_migration()
        pin = f"migrated/{next(self._pins)}"
        result = self._importer.import_prefix(pin, list(tokens), list(staged) or None,
                                              num_staged, None, record_stats=False)
        # Unpinned, the pages wait in the prefix cache (LRU) for the trajectory's next turn.
        self._importer.release(pin)
        return result

    def num_compiles(self) -> int:
        """Programs compiled: the engine's, the page import's and the page export's."""
        moves = sum(x.num_compiles for x in (self._importer, self._exporter) if x is not None)
        return self.engine.num_compiles + moves

    def update_weights(self, params: Any, version: str, in_flight: WeightUpdatePolicy) -> None:
        """Swaps in `params` (host arrays, as shipped) under `version`."""
        self.engine.update_weights(jax.device_put(params), version, in_flight=in_flight)

    def num_in_flight(self) -> int:
        """Samples that have generated tokens but not finished."""
        return sum(1 for out in self.engine.snapshot_outputs() for s in out.outputs
                   if s.token_ids and s.finish_reason is None)

    def result(self) -> list[Sample]:
        """The finished samples of this worker's part."""
        if not self.done:
            raise ValueError(f"{len(self._slices) - len(self._outputs)} requests of the "
                             "rollout are unfinished; step until done")
        samples = []
        for rid, out in self._outputs.items():
            if out.error:
                raise ValueError(f"request {rid!r} failed: {out.error}")
            first = self._slices[rid].first
            samples += [Sample(self._slices[rid].prompt_index, first + s.index,
                               list(s.token_ids), np.asarray(s.logprobs, np.float32),
                               list(s.weights_versions), s.finish_reason, s.text)
                        for s in out.outputs]
        return samples

    def stats(self) -> dict[str, int]:
        """Engine steps, weight updates, stale KV reads, milliseconds spent stepping, prefill
        and prefix-hit tokens."""
        stats = {k: int(self.engine.stats[k]) for k in _COUNTED_STATS}
        stats["busy_ms"] = int(self._busy_s * 1000)
        return dict(stats, **{k: int(v) for k, v in self.engine.metrics().items()
                              if k in ("prefill_tokens", "prefix_hit_tokens")})


def shard_bounds(num_prompts: int, num_workers: int) -> list[tuple[int, int]]:
    """[start, end) of each non-empty contiguous shard, sizes differing by at most one."""
    edges = np.linspace(0, num_prompts, num_workers + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def assemble_batch(prompts: Sequence[Sequence[int]], group_size: int, samples: list[Sample],
                   *, pad_to: int | None = None, pad_multiple: int = 16) -> RolloutBatch:
    """Workers' samples as one prompt-major `RolloutBatch`."""
    samples = sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))
    keys = [(s.prompt_index, s.sample_index) for s in samples]
    if keys != [(b // group_size, b % group_size) for b in range(len(prompts) * group_size)]:
        raise ValueError(f"the samples do not cover {len(prompts)} prompts x {group_size} "
                         "samples once each")
    rows = [list(prompts[s.prompt_index]) for s in samples]
    completions = [s.completion_ids for s in samples]
    logprobs = [s.logprobs for s in samples]
    reasons = [s.finish_reason for s in samples]
    tokens, loss_mask, old_logprobs = pad_batch(rows, completions, logprobs, reasons,
                                                pad_to=pad_to, pad_multiple=pad_multiple)
    return RolloutBatch(prompt_ids=[list(p) for p in prompts], group_size=group_size,
                        completion_ids=completions, logprobs=logprobs,
                        token_versions=[s.token_versions for s in samples],
                        finish_reasons=reasons, texts=[s.text for s in samples], tokens=tokens,
                        loss_mask=loss_mask, old_logprobs=old_logprobs)


class RolloutPool(Protocol):
    """Workers driven in lockstep through one rollout at a time."""

    num_workers: int
    placement: SamplePlacement

    def start(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
              group_size: int, seed: int = 0, name: str = "rollout") -> None: ...

    def step(self) -> bool: ...

    def update_weights(self, params: Any, version: str, *,
                       in_flight: WeightUpdatePolicy = WeightUpdatePolicy.RECOMPUTE) -> None: ...

    def num_in_flight(self) -> int: ...

    def start_slices(self, parts: Sequence[Sequence[SampleSlice]], sampling: SamplingParams,
                     *, group_size: int, seed: int, name: str) -> None: ...

    def samples(self) -> list[Sample]: ...

    def result(self, *, pad_to: int | None = None) -> RolloutBatch: ...

    def stats(self) -> dict[str, int]: ...

    def worker_stats(self) -> list[dict[str, int]]: ...

    def warm_migration(self) -> None: ...

    def move_pages(self, tokens: Sequence[int], source: int,
                   target: int) -> kv_transfer.ImportResult: ...

    def num_compiles(self) -> list[int]: ...


class _Pool(abc.ABC):
    """What both pools share; `_call` is where they differ."""

    def __init__(self, num_workers: int, placement: SamplePlacement):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        self.num_workers = num_workers
        self.placement = SamplePlacement(placement)
        self._active: list[int] = []

    @abc.abstractmethod
    def _call(self, method: str, calls: dict[int, tuple]) -> list:
        """Runs `method` on the workers `calls` names, with their (args, kwargs), all at once
        where they are actors; returns the results in `calls` order."""

    def _ship(self, params: Any) -> Any:
        return jax.device_get(params)

    def start(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
              group_size: int, seed: int = 0, name: str = "rollout") -> None:
        """Queues `group_size` samples of every prompt on the workers, as `placement` says.

        `sampling`'s `n` (1 or `group_size`) and `seed` are replaced: sample i of prompt p
        gets seed `seed + p * group_size + i`, as in one engine's `Rollout`.
        """
        check_groups(prompts, sampling, group_size)
        self._prompts = [[int(t) for t in p] for p in prompts]
        self._group_size = group_size
        placed = place_samples(len(prompts), group_size, self.num_workers, self.placement)
        self.start_slices([[SampleSlice(p, self._prompts[p], first, n) for p, first, n in part]
                           for part in placed], sampling, group_size=group_size, seed=seed,
                          name=name)

    def start_slices(self, parts: Sequence[Sequence[SampleSlice]], sampling: SamplingParams, *,
                     group_size: int, seed: int, name: str) -> None:
        """Queues each worker's slices (`parts[w]`, placed by the caller), seeded as `start`
        says; `samples()` then gives their samples."""
        if len(parts) != self.num_workers:
            raise ValueError(f"{len(parts)} parts of slices for {self.num_workers} workers")
        self._active = [w for w, part in enumerate(parts) if part]
        self._call("start", {w: ((list(parts[w]), sampling),
                                 dict(group_size=group_size, seed=seed, name=name))
                             for w in self._active})
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

    def samples(self) -> list[Sample]:
        """The finished samples of every worker, worker by worker."""
        parts = self._call("result", {w: ((), {}) for w in self._active})
        return [s for part in parts for s in part]

    def result(self, *, pad_to: int | None = None) -> RolloutBatch:
        """The finished rollout, the workers' samples merged prompt-major."""
        return assemble_batch(self._prompts, self._group_size, self.samples(), pad_to=pad_to)

    def stats(self) -> dict[str, int]:
        """Every worker's counters summed."""
        per_worker = self.worker_stats()
        return {k: sum(s[k] for s in per_worker) for k in per_worker[0]}

    def worker_stats(self) -> list[dict[str, int]]:
        """Each worker's counters (`RolloutWorker.stats`)."""
        return self._call("stats", {w: ((), {}) for w in range(self.num_workers)})

    def warm_migration(self) -> None:
        """Every worker compiles its page export and import (`RolloutWorker.warm_migration`)."""
        self._call("warm_migration", {w: ((), {}) for w in range(self.num_workers)})

    def move_pages(self, tokens: Sequence[int], source: int,
                   target: int) -> kv_transfer.ImportResult:
        """Copies the pages of `tokens`' longest prefix cached on worker `source` into worker
        `target`'s prefix cache, through host memory; `source` keeps its copy."""
        if source == target or not (0 <= source < self.num_workers
                                    and 0 <= target < self.num_workers):
            raise ValueError(f"cannot move pages from worker {source!r} to {target!r} of "
                             f"{self.num_workers}")
        tokens = [int(t) for t in tokens]
        (staged, num, provenance), = self._call("export_pages", {source: ((tokens,), {})})
        (result,) = self._call("import_pages", {target: ((tokens, staged, num, provenance), {})})
        return result

    def num_compiles(self) -> list[int]:
        """Each worker's compiled programs (`RolloutWorker.num_compiles`)."""
        return self._call("num_compiles", {w: ((), {}) for w in range(self.num_workers)})


class LocalRolloutPool(_Pool):
    """Rollout workers in this process, stepped one after another."""

    def __init__(self, num_workers: int, model_factory: Callable[[], Model],
                 engine_config: EngineConfig | None = None, *,
                 placement: SamplePlacement = SamplePlacement.GROUP):
        super().__init__(num_workers, placement)
        self.workers = [RolloutWorker(model_factory, engine_config) for _ in range(num_workers)]

    def _call(self, method: str, calls: dict[int, tuple]) -> list:
        return [getattr(self.workers[w], method)(*args, **kwargs)
                for w, (args, kwargs) in calls.items()]


class RayRolloutPool(_Pool):
    """Rollout workers as Ray actors (one CPU each), each building its model with
    `model_factory` (a picklable callable); weights travel through the object store once per
    update."""

    def __init__(self, num_workers: int, model_factory: Callable[[], Model],
                 engine_config: EngineConfig | None = None, *,
                 placement: SamplePlacement = SamplePlacement.GROUP):
        super().__init__(num_workers, placement)
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
