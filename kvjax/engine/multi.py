"""Several models serving from one device budget: one arena of KV frames, weights that move.

    mm = MultiModelEngine({"a": ModelSpec(model_a), "b": ModelSpec(model_b, config_b)},
                          PoolConfig(budget_bytes=256 << 20, policy="elastic"))
    mm.add_request("r1", prompt_ids, SamplingParams(max_new_tokens=16), model="a")
    while mm.has_unfinished():
        for out in mm.step(): ...

Each model runs in its own `Engine` (scheduler, prefix cache, provenance, step programs) whose
pages are frames of one shared arena (`kvjax.kv.arena`): its block manager takes and returns
frames through the `kvjax.memory.frames.FramePool` ledger, which keeps KV frames in use plus
resident weights within the budget at every step. A page is only ever read by the model that
wrote it: each model's block tables hold only frames its own allocator took.

With the `elastic` policy a model's weights move to host memory (memory kind `pinned_host`)
when another model needs the room and it has nothing in flight, and back when a request for
it arrives; requests wait (never dropped) until their model's weights fit. With `static` every
model keeps its weights and a fixed share of frames.

JAX cannot resize or alias a live device buffer, so the arena is allocated once at its largest
size (budget / frame bytes frames); the budget is enforced by the ledger, which hands out
frames only while frames in use + resident weights fit.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.pool import KVPool, allocator_options, arena_layout, arena_words_per_page
from kvjax.engine.request import RequestOutput, submit_all
from kvjax.engine.step import LogitsMode
from kvjax.engine.swap import HostSwapSpace
from kvjax.kv import arena
from kvjax.memory.block_manager import BlockManager
from kvjax.memory.frames import FramePool, make_pool_policy
from kvjax.models.model import Model
from kvjax.sampling import SamplingParams
from kvjax.trace import Tracer
from kvjax.validation import check_identity


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model of the pool: the model and its engine settings (page_size and the KV
    budget fields are set by the pool: a page is one frame)."""

    model: Model
    config: EngineConfig = EngineConfig()


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """The shared device budget.

    Attributes:
      budget_bytes: device bytes for every model's KV frames and resident weights.
      policy: a `kvjax.memory.frames` pool policy: 'elastic' or 'static'.
      frame_bytes: bytes of one frame; None: `page_tokens` tokens of the model with the most
        bytes per token (smaller models fit more tokens in a frame).
      page_tokens: see frame_bytes.
    """

    budget_bytes: int
    policy: str = "elastic"
    frame_bytes: int | None = None
    page_tokens: int = 16


class _Arena:
    """The shared device arena buffer, replaced by each step that donates it."""

    def __init__(self, num_frames: int, frame_words: int):
        self.buffer = arena.init_arena(num_frames, frame_words)


@dataclasses.dataclass
class _ArenaStore:
    """A runner's `KVStore` over the shared arena: its view is rebuilt around the arena's
    current buffer, and whatever it writes becomes the arena's buffer."""

    box: _Arena
    view: arena.ArenaKV

    def get(self) -> arena.ArenaKV:
        return self.view.replace(arena=self.box.buffer)

    def set(self, kv: arena.ArenaKV) -> None:
        self.box.buffer = kv.arena


@dataclasses.dataclass
class _SharedPool:
    """The `KVPoolSource` of one model: its view of the arena, frames from the ledger."""

    box: _Arena
    frames: FramePool
    name: str
    frame_words: int
    view: arena.ArenaKV | None = None

    def build(self, mc, config: EngineConfig, *, max_model_len: int, kv_dtype) -> KVPool:
        layout, k_codec, v_codec = arena_layout(mc, config, kv_dtype, self.frame_words)
        self.view = arena.ArenaKV(self.box.buffer, layout, k_codec, v_codec)
        allocator = BlockManager(self.frames.num_frames, layout.page_size,
                                 **allocator_options(config),
                                 pages=self.frames.pages(self.name))
        owner = self.frames.owners[self.name]
        owner.evictable = allocator.num_givable_pages
        owner.give_back = allocator.give_back_cached
        return KVPool(self.view, allocator, HostSwapSpace(),
                      arena.arena_cache_spec(mc, layout, k_codec, v_codec))

    def store(self) -> _ArenaStore:
        return _ArenaStore(self.box, self.view)


class MultiModelEngine:
    """Engines of several models over one shared KV arena and weight budget.

    Attributes:
      engines: model name -> its `Engine`.
      frames: the `FramePool` ledger (frames, resident weights, the policy).
      stats: weight_bytes_to_host, weight_bytes_to_device, weight_offloads, weight_loads,
        max_used_bytes (the most KV + resident weight bytes seen), waiting (requests waiting
        for their model's weights).
    """

    def __init__(self, models: dict[str, ModelSpec], pool: PoolConfig, *,
                 clock: Callable[[], float] = time.perf_counter):
        if not models:
            raise ValueError("a MultiModelEngine needs at least one model")
        self._device = jax.devices()[0]
        self._on_device = jax.sharding.SingleDeviceSharding(self._device)
        self._on_host = jax.sharding.SingleDeviceSharding(self._device,
                                                          memory_kind="pinned_host")
        kv_dtypes = {name: spec.config.kv_dtype or spec.model.dtype
                     for name, spec in models.items()}
        frame_words = self._frame_words(models, kv_dtypes, pool)
        self.frames = FramePool(pool.budget_bytes, frame_words * arena.WORD,
                                make_pool_policy(pool.policy))
        self.frames.reclaim = self._reclaim
        self._box = _Arena(self.frames.num_frames, frame_words)
        self.stats = dict(weight_bytes_to_host=0, weight_bytes_to_device=0, weight_offloads=0,
                          weight_loads=0, max_used_bytes=0, waiting=0)
        self._waiting: collections.deque = collections.deque()  # (model, id, prompt, ...)
        self._done: list[RequestOutput] = []  # finished outside an engine, for the next step
        self._model_of: dict[str, str] = {}  # live request id -> model
        self._sampled: list = []  # (sampled rows, logits) of each model in the last step
        self._generations = itertools.count()
        self.clock = clock
        self.engines: dict[str, Engine] = {}
        for name, spec in models.items():
            self._add_model(name, spec, frame_words, kv_dtypes[name], clock)
        if not self.frames.policy.is_elastic and self.frames.free_bytes < 0:
            raise ValueError(f"the weights of {sorted(models)} do not fit a budget of "
                             f"{pool.budget_bytes} bytes")
        for name in models:
            self._check_holds_a_sequence(name)

    def _check_holds_a_sequence(self, name: str) -> None:
        """ValueError unless `name` can hold one sequence of max_model_len tokens (else such a
        request would wait forever)."""
        engine = self.engines[name]
        most = self.frames.capacity_for(self.frames.owners[name])
        need = -(-engine.max_model_len // engine.config.page_size)
        if most < need:
            raise ValueError(f"model {name!r}: the pool gives it at most {most} frames of "
                             f"{engine.config.page_size} tokens, fewer than the {need} one "
                             f"sequence of max_model_len={engine.max_model_len} tokens needs")

    @staticmethod
    def _frame_words(models: dict[str, ModelSpec], kv_dtypes: dict, pool: PoolConfig) -> int:
        if pool.frame_bytes is not None:
            return pool.frame_bytes // arena.WORD
        return max(arena_words_per_page(spec.model.config, spec.config, kv_dtypes[name],
                                        pool.page_tokens) for name, spec in models.items())

    def _add_model(self, name: str, spec: ModelSpec, frame_words: int, kv_dtype, clock) -> None:
        layout, _, _ = arena_layout(spec.model.config, spec.config, kv_dtype, frame_words)
        config = dataclasses.replace(spec.config, kv_arena=True, page_size=layout.page_size,
                                     num_pages=None, kv_budget_bytes=None)
        # Committed params: jit caches committed and uncommitted inputs apart, and params
        # come back from the host committed.
        model = dataclasses.replace(spec.model,
                                    params=jax.device_put(spec.model.params, self._on_device))
        owner = self.frames.add_owner(name, model.nbytes)
        source = _SharedPool(self._box, self.frames, name, frame_words)
        engine = self.engines[name] = Engine(model, config, clock=clock, kv_pool=source)
        owner.is_idle = lambda: not engine.has_unfinished()
        if self.frames.policy.is_elastic and owner.weight_bytes > self.frames.free_bytes:
            self._move_weights(name, to_device=False)
        else:
            self.frames.set_weights_resident(name, True)

    # ----------------------------------------------------------------------------- weights

    def weights_resident(self, name: str) -> bool:
        return self.frames.owners[name].weights_resident

    def _move_weights(self, name: str, *, to_device: bool) -> None:
        if to_device:
            self.frames.set_weights_resident(name, True)  # ValueError if it does not fit
        moved = self.engines[name].runner.move_params(
            self._on_device if to_device else self._on_host)
        if not to_device:
            self.frames.set_weights_resident(name, False)
        key = "device" if to_device else "host"
        self.stats[f"weight_bytes_to_{key}"] += moved
        self.stats["weight_loads" if to_device else "weight_offloads"] += 1

    def warmup(self) -> None:
        """Compiles every model's step shapes with its weights on the device (loading them in
        turn where they are on the host), then leaves the weights as they were."""
        for name, engine in self.engines.items():
            was_resident = self.weights_resident(name)
            if not was_resident:
                for other in self.engines:
                    if other != name and self.frames.owners[name].weight_bytes > \
                            self.frames.free_bytes:
                        self.offload_weights(other)
                self._move_weights(name, to_device=True)
            engine.warmup()
            if not was_resident:
                self._move_weights(name, to_device=False)

    def offload_weights(self, name: str) -> None:
        """Moves an idle model's weights to host memory (ValueError if it has work)."""
        if self.engines[name].has_unfinished():
            raise ValueError(f"model {name!r} has requests in flight; its weights stay")
        if self.weights_resident(name):
            self._move_weights(name, to_device=False)

    def _reclaim(self, requester: str, num_frames: int) -> int:
        """Makes room for `num_frames` frames of `requester` (the FramePool's hook): other
        models' cached pages first, then idle models' weights, in the policy's order."""
        need = num_frames * self.frames.frame_bytes
        freed = self.frames.give_way_cached(requester, num_frames)
        for owner in self.frames.policy.give_way(self.frames, requester):
            if self.frames.free_bytes >= need:
                break
            if owner.weights_resident and owner.is_idle():
                self._move_weights(owner.name, to_device=False)
        return freed

    def _make_room_for_weights(self, name: str) -> bool:
        """Frees bytes for `name`'s weights (cached pages, idle weights); True if they fit."""
        owner = self.frames.owners[name]
        short = owner.weight_bytes - self.frames.free_bytes
        if short > 0 and self.frames.policy.is_elastic:
            self._reclaim(name, -(-short // self.frames.frame_bytes))
        return owner.weight_bytes <= self.frames.free_bytes

    def _admit(self, name: str) -> bool:
        """Whether `name` can run now, loading its weights if they are on the host."""
        if self.weights_resident(name):
            return True
        if not self._make_room_for_weights(name):
            return False
        self._move_weights(name, to_device=True)
        return True

    # ----------------------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: Sequence[Any],
                    sampling: SamplingParams | None = None, *, model: str, **kwargs) -> None:
        """Queues a request for `model` (keyword arguments as `Engine.add_request`); it waits
        while the model's weights do not fit.

        Raises ValueError (nothing queued) for an unknown model or an id in use; the model's
        engine validates the rest when the request is admitted (a refused one finishes with
        its `error`).
        """
        check_identity(request_id, **{k: kwargs[k] for k in (
            "tenant", "priority", "arrival_time", "cache_salt") if k in kwargs})
        if model not in self.engines:
            raise ValueError(f"request {request_id!r}: unknown model {model!r}; expected one "
                             f"of {sorted(self.engines)}")
        if request_id in self._model_of:
            raise ValueError(f"request {request_id!r}: the id is already in use")
        kwargs.setdefault("arrival_time", self.clock())  # waiting for weights counts in TTFT
        if self._waiting or not self._admit(model):
            self._model_of[request_id] = model
            self._waiting.append((model, request_id, prompt, sampling, kwargs))
            return
        self.engines[model].add_request(request_id, prompt, sampling, **kwargs)
        self._model_of[request_id] = model
        self.frames.touch(model)

    def model_of(self, request_id: str) -> str:
        """The model a live request runs on."""
        return self._model_of[request_id]

    def _admit_waiting(self) -> None:
        """Admits waiting requests in arrival order while their models fit; one the model's
        engine refuses (ValueError) finishes with its error, the others go on."""
        while self._waiting:
            model, request_id, prompt, sampling, kwargs = self._waiting[0]
            if not self._admit(model):
                return
            self._waiting.popleft()
            try:
                self.engines[model].add_request(request_id, prompt, sampling, **kwargs)
            except ValueError as e:
                self._finish_outside(request_id, kwargs["arrival_time"], str(e))
                continue
            self.frames.touch(model)

    def _finish_outside(self, request_id: str, arrival_time: float, error: str | None) -> None:
        """A request that ends before its engine took it: refused, or aborted while waiting."""
        self._model_of.pop(request_id)
        self._done.append(RequestOutput(request_id=request_id, prompt_ids=[], outputs=[],
                                        finished=True, arrival_time=arrival_time,
                                        finish_time=self.clock(), error=error))

    def abort(self, request_id: str) -> None:
        """Stops a request (waiting or running); ValueError for an unknown id."""
        waiting = [w for w in self._waiting if w[1] == request_id]
        if waiting:
            self._waiting.remove(waiting[0])
            self._finish_outside(request_id, waiting[0][4]["arrival_time"], None)
            return
        if request_id not in self._model_of:
            raise ValueError(f"request {request_id!r} is not live")
        self.engines[self._model_of[request_id]].abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._done) or any(
            e.has_unfinished() for e in self.engines.values())

    def step(self, *, logits_mode: LogitsMode = LogitsMode.NONE) -> list[RequestOutput]:
        """One step of every model with work, in turn; returns the requests that finished."""
        self._admit_waiting()
        self.stats["waiting"] = len(self._waiting)
        finished, self._done = self._done, []
        self._sampled = []
        for name, engine in self.engines.items():
            if not engine.has_unfinished():
                continue
            if not self.weights_resident(name):
                raise RuntimeError(f"model {name!r} has requests but its weights are on the "
                                   f"host")
            outs = engine.step(logits_mode=logits_mode)
            if logits_mode is not LogitsMode.NONE and engine.last_logits is not None:
                self._sampled.append((engine.last_sampled_rows, engine.last_logits))
            for out in outs:
                self._model_of.pop(out.request_id, None)
                finished.append(out)
            self._check_budget()
        return finished

    @property
    def last_sampled_rows(self) -> tuple[tuple[str, int], ...]:
        """`Engine.last_sampled_rows` of every model stepped last, rows into `last_logits`."""
        rows, offset = [], 0
        for sampled, logits in self._sampled:
            rows += [(seq, offset + row) for seq, row in sampled]
            offset += logits.shape[0]
        return tuple(rows)

    @property
    def last_logits(self) -> np.ndarray | None:
        """The last step's logits of every model stacked [R, V_max] (-inf past a model's
        vocabulary), or None."""
        if not self._sampled:
            return None
        arrays = [np.asarray(logits, np.float32) for _, logits in self._sampled]
        width = max(a.shape[1] for a in arrays)
        return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1])),
                                      constant_values=-np.inf) for a in arrays])

    def snapshot_outputs(self, *, drain: bool = True, with_text: bool = True
                         ) -> list[RequestOutput]:
        """`Engine.snapshot_outputs` of every model."""
        return [o for e in self.engines.values()
                for o in e.snapshot_outputs(drain=drain, with_text=with_text)]

    def metrics(self) -> dict[str, int]:
        """`Engine.metrics` summed over the models; waiting counts requests waiting for
        weights too."""
        total = collections.Counter()
        for engine in self.engines.values():
            total.update(engine.metrics())
        total["num_waiting"] += len(self._waiting)
        return dict(total)

    def export_trace(self, path) -> None:
        """Writes the traced models' events (EngineConfig.trace) as one Perfetto JSON, each
        model's tracks under its name ('<model>:pages/device', ...)."""
        tracer = Tracer()
        tracer.events = [e._replace(track=f"{name}:{e.track}")
                         for name, engine in self.engines.items() if engine.tracer.enabled
                         for e in engine.tracer.events]
        if not tracer.events:
            raise ValueError("export_trace needs EngineConfig(trace=True) on a model")
        tracer.export(path)

    def models(self) -> dict[str, Engine]:
        """The engines requests can be routed to, by model name."""
        return dict(self.engines)

    def _check_budget(self) -> None:
        used = self.frames.used_bytes
        if used > self.frames.budget_bytes:
            raise RuntimeError(f"the pool holds {used} bytes, over its budget of "
                               f"{self.frames.budget_bytes}")
        self.stats["max_used_bytes"] = max(self.stats["max_used_bytes"], used)

    def generate(self, model: str, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | None = None) -> list[RequestOutput]:
        """Runs `prompts` on `model` to completion (other models' requests step alongside);
        invalid ones come back with `error` set, alone."""
        ids, done = submit_all(functools.partial(self.add_request, model=model), prompts,
                               sampling, f"{model}-gen-{next(self._generations)}", self.clock())
        while any(i not in done for i in ids):
            done.update((o.request_id, o) for o in self.step())
        return [done[i] for i in ids]

    # ----------------------------------------------------------------------------- views

    def kv_utilization(self) -> float:
        """Bytes of the running sequences' cached tokens over the budget's KV share (the
        budget less resident weights): how much of the memory left for KV serves live KV."""
        live = sum(s.num_computed * engine.kv_bytes_per_token
                   for engine in self.engines.values() for s in engine.scheduler.running)
        share = self.frames.budget_bytes - self.frames.resident_weight_bytes
        return live / share if share > 0 else 0.0

    def summary(self) -> dict:
        """The ledger and counters: bytes in use, frames and weights per model."""
        return dict(
            budget_bytes=self.frames.budget_bytes, frame_bytes=self.frames.frame_bytes,
            num_frames=self.frames.num_frames, used_bytes=self.frames.used_bytes,
            frames_in_use=self.frames.frames_in_use, **self.stats,
            models={name: dict(frames=o.frames, weights_resident=o.weights_resident,
                               weight_bytes=o.weight_bytes,
                               page_size=self.engines[name].config.page_size)
                    for name, o in self.frames.owners.items()})
