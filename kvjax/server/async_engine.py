"""The engine in one background thread, and a thread-safe way in and out of it.

HTTP handlers run on an asyncio event loop; the engine runs in its own thread, and nothing
else touches it. A handler calls `AsyncEngine.submit`, which checks the queue bound and
queues the requests for the engine thread; each comes back as a `RequestStream`. The engine
thread adds them (a request the engine refuses is rejected on its stream, alone), steps the
engine while anything is unfinished, and after each step posts every changed request's
cumulative output to its stream through the event loop (`call_soon_threadsafe`). Outputs
coalesce: a slow reader sees the latest output, never a backlog.

Top logprobs: while any request wants them, steps return their logits (`LogitsMode.LAST`,
which runs steps synchronously); the engine thread takes each sampled row's top k.

Prompt logprobs (`echo` with logprobs): `score_prompt` runs the prompt through a
prefill-only scorer (`kvjax.models.scoring`) on the engine thread, between steps.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvjax.engine.engine import Engine
from kvjax.engine.request import RequestOutput
from kvjax.engine.step import LogitsMode
from kvjax.models.scoring import PrefillOnlyScorer
from kvjax.sampling import SamplingParams
from kvjax.scheduler.controller import SLO

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at its bound; retry later (HTTP 429)."""


class NotAdmitting(Exception):
    """The engine is draining or stopped, or failed (HTTP 503)."""


class RequestFailed(RuntimeError):
    """The engine could not take one request for a reason that is not the request's fault
    (HTTP 500); the message names the request and nothing internal. The engine goes on."""


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One engine request: a prompt, its sampling, who sent it, and when it arrived.

    Attributes:
      request_id: unique among live requests.
      prompt_ids: the prompt's token ids.
      sampling: the engine's SamplingParams (n samples).
      tenant: prefix-cache salt and fair-share identity; None for the default tenant.
      priority: the engine priority (larger first under the `priority` policy).
      num_top_logprobs: most likely tokens to report per generated token (0: none).
      arrival_time: on the engine's clock.
      model: the model it runs on, for an engine of several models
        (`kvjax.engine.multi.MultiModelEngine`); None for a one-model engine.
      slo: its SLO for the engine's KV controller; None: the engine's default.
      cache_salt: the shared prefix-cache salt it names (vLLM's field), or None.
      logprobs_temperature: when set, every logprob reported for it (each token's and the top
        ones) is of the distribution after dividing the logits by this (its sampling
        temperature; penalties, biases and filters are not applied); None: the model's own.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    tenant: str | None = None
    priority: int = 0
    num_top_logprobs: int = 0
    arrival_time: float | None = None
    model: str | None = None
    slo: SLO | None = None
    logprobs_temperature: float | None = None
    cache_salt: str | None = None

    @property
    def reads_logits(self) -> bool:
        """Whether its logprobs are computed here from the step's logits."""
        return bool(self.num_top_logprobs) or self.logprobs_temperature is not None


@dataclasses.dataclass(frozen=True)
class Update:
    """A request's cumulative state after a step.

    Attributes:
      output: the engine's RequestOutput (text not decoded; `finished` on the last update).
      top_logprobs: per sample, per generated token, {token id: logprob} of the top k (k =
        num_top_logprobs); None when none were asked for.
    """

    output: RequestOutput
    top_logprobs: tuple[list[dict[int, float]], ...] | None = None


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, fn, value) -> None:
    """Calls `fn(value)` (the future's set_result or set_exception) on the future's loop."""
    try:
        loop.call_soon_threadsafe(lambda: future.done() or fn(value))
    except RuntimeError:  # The loop is closed: nobody is listening any more.
        pass


class RequestStream:
    """The event-loop side of one request: whether the engine took it, then its updates.

    The engine thread only calls the `_post_*` methods, which hop onto the event loop.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._loop = loop
        self.accepted: asyncio.Future = loop.create_future()
        self._latest: Update | None = None
        self._error: BaseException | None = None
        self._changed = asyncio.Event()

    async def next(self) -> Update:
        """The newest update since the last call (waits for one); raises if the engine
        failed."""
        await self._changed.wait()
        self._changed.clear()
        if self._error is not None:
            raise self._error
        return self._latest

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # The loop is closed: nobody is listening any more.
            pass

    def _post_accepted(self, error: BaseException | None) -> None:
        self._post(self._set_accepted, error)

    def _post_update(self, update: Update) -> None:
        self._post(self._set_update, update)

    def _post_error(self, error: BaseException) -> None:
        self._post(self._set_error, error)

    def _set_accepted(self, error: BaseException | None) -> None:
        if self.accepted.done():
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(error)

    def _set_update(self, update: Update) -> None:
        self._latest = update
        self._changed.set()

    def _set_error(self, error: BaseException) -> None:
        self._set_accepted(error)
        self._error = error
        self._changed.set()


@dataclasses.dataclass
class _Tracked:
    """The engine thread's record of a live request."""

    request: EngineRequest
    stream: RequestStream
    top: list[list[dict[int, float]]]
    # With logprobs_temperature: per sample, each token's logprob, and the last step's
    # logprob row per sample whose token is not read yet.
    token_logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    pending: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    num_tokens: int = 0  # generated so far, all samples
    is_started: bool = False
    is_aborted: bool = False


class AsyncEngine:
    """Runs an `Engine` in a background thread and serves many callers at once.

    Attributes:
      engine: the Engine; only the engine thread may touch it once `start` was called.
      max_waiting: most sequences (a request of n samples counts n) accepted but without a
        first token yet; `submit` raises QueueFull beyond it.
      max_waiting_tokens: most prompt tokens of those requests (the prefill work queued);
        beyond it QueueFull, except that an empty queue takes any one request.
      on_finished: callables the engine thread calls with each final RequestOutput (metrics).
    """

    def __init__(self, engine: Engine, *, max_waiting: int = 128,
                 max_waiting_tokens: int = 1 << 16):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting!r}")
        if max_waiting_tokens < 1:
            raise ValueError(f"max_waiting_tokens must be >= 1, got {max_waiting_tokens!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_waiting_tokens = max_waiting_tokens
        self.on_finished: list[Callable[[RequestOutput], None]] = []
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_waiting = 0  # sequences
        self._num_waiting_tokens = 0
        self._num_in_commands = 0  # requests submitted that the engine thread has not added
        self._is_admitting = True
        self._tracked: dict[str, _Tracked] = {}
        self._scorers: dict[str | None, PrefillOnlyScorer] = {}  # per routed model
        self._needs_step = False
        self._metrics = engine.metrics()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------- callers

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def is_admitting(self) -> bool:
        return self._is_admitting and self.is_alive

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine thread, if it failed."""
        return self._error

    @property
    def num_waiting(self) -> int:
        """Sequences of the requests accepted that have no output token yet (the bounded
        queue)."""
        return self._num_waiting

    @property
    def num_live(self) -> int:
        """Requests accepted and not yet finished."""
        return len(self._tracked) + self._num_in_commands

    def metrics(self) -> dict[str, int]:
        """`Engine.metrics()` as of the engine thread's last step (any thread may read it)."""
        return self._metrics

    def clock(self) -> float:
        return self.engine.clock()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread was already started")
        self._thread = threading.Thread(target=self._run, name="kvjax-engine", daemon=True)
        self._thread.start()

    def stop_admitting(self) -> None:
        """New submissions raise NotAdmitting from now on; live requests go on."""
        self._is_admitting = False

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stops admitting, lets live requests finish for up to `drain_timeout_s`, aborts
        the rest and joins the engine thread."""
        self.stop_admitting()
        if self._thread is None:
            return
        deadline = time.monotonic() + drain_timeout_s
        while self.num_live and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._commands.put(("stop",))
        self._thread.join()

    def submit(self, requests: list[EngineRequest], loop: asyncio.AbstractEventLoop
               ) -> list[RequestStream]:
        """Queues requests for the engine thread, all or none; returns their streams.

        Raises:
          QueueFull: they would take the waiting queue past `max_waiting`.
          NotAdmitting: the engine is draining, stopped or failed.
        """
        if not self.is_admitting:
            raise NotAdmitting("the server is not admitting requests" if self._error is None
                               else "the engine failed; the server must be restarted")
        seqs = sum(r.sampling.n for r in requests)
        tokens = sum(len(r.prompt_ids) for r in requests)
        with self._lock:
            if self._num_waiting + seqs > self.max_waiting:
                raise QueueFull(f"{self._num_waiting} sequences are waiting (the bound is "
                                f"{self.max_waiting})")
            if self._num_waiting and self._num_waiting_tokens + tokens > self.max_waiting_tokens:
                raise QueueFull(f"{self._num_waiting_tokens} prompt tokens are waiting (the "
                                f"bound is {self.max_waiting_tokens})")
            self._num_waiting += seqs
            self._num_waiting_tokens += tokens
            self._num_in_commands += len(requests)
        streams = [RequestStream(r.request_id, loop) for r in requests]
        self._commands.put(("add", list(zip(requests, streams, strict=True))))
        return streams

    def abort(self, request_id: str) -> None:
        """Aborts a request (a no-op once it finished); its pages are freed at once."""
        self._commands.put(("abort", request_id))

    def score_prompt(self, request_id: str, prompt_ids: list[int], num_top: int,
                     loop: asyncio.AbstractEventLoop, *, model: str | None = None
                     ) -> asyncio.Future:
        """A future of `PrefillOnlyScorer.prompt_logprobs(prompt_ids, num_top)`, computed on
        the engine thread: per token None (the first) or (logprob, top {id: logprob}, rank)."""
        if not self.is_admitting:
            raise NotAdmitting("the server is not admitting requests")
        future = loop.create_future()
        self._commands.put(("score", request_id, list(prompt_ids), num_top, model, future,
                            loop))
        return future

    def call(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """A future of `fn()`, run on the engine thread between two steps (reads of engine
        state that the engine thread mutates, e.g. the prefix cache's index)."""
        future = loop.create_future()
        self._commands.put(("call", fn, future, loop))
        return future

    # ----------------------------------------------------------------------------- engine thread

    def _release_waiting(self, request: EngineRequest) -> None:
        with self._lock:
            self._num_waiting -= request.sampling.n
            self._num_waiting_tokens -= len(request.prompt_ids)

    def _run(self) -> None:
        try:
            while self._take_commands(block=not (self.engine.has_unfinished()
                                                 or self._needs_step)):
                if self.engine.has_unfinished() or self._needs_step:
                    self._step()
                self._metrics = self.engine.metrics()
        except BaseException as e:  # Every caller must hear of it, whatever it was.
            logger.exception("the engine thread failed")
            self._error = e
            # Callers hear that it failed; what failed (and the engine's internals) is logged.
            failed = RequestFailed("the engine failed; the server must be restarted")
            for tracked in self._tracked.values():
                tracked.stream._post_error(failed)
            self._drain_commands_after_failure(failed)

    def _drain_commands_after_failure(self, error: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                for _, stream in command[1]:
                    stream._post_error(error)
            elif command[0] == "score":
                future, loop = command[5], command[6]
                _resolve(loop, future, future.set_exception, error)
            elif command[0] == "call":
                _resolve(command[3], command[2], command[2].set_exception, error)

    def _take_commands(self, *, block: bool) -> bool:
        """Applies queued commands (waiting for one if `block`); False once told to stop."""
        commands = collections.deque()
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            kind = command[0]
            if kind == "add":
                for request, stream in command[1]:
                    self._add(request, stream)
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "score":
                self._score(*command[1:])
            elif kind == "call":
                _, fn, future, loop = command
                try:
                    result = fn()
                except Exception as e:  # The caller's to handle; the engine goes on.
                    _resolve(loop, future, future.set_exception, e)
                else:
                    _resolve(loop, future, future.set_result, result)
            elif kind == "stop":
                for request_id in list(self._tracked):
                    self._abort(request_id)
                self._step()
                return False
        return True

    def _add(self, request: EngineRequest, stream: RequestStream) -> None:
        with self._lock:
            self._num_in_commands -= 1
        routed = {} if request.model is None else dict(model=request.model)
        if request.cache_salt is not None:
            routed["cache_salt"] = request.cache_salt
        try:
            self.engine.add_request(request.request_id, request.prompt_ids, request.sampling,
                                    tenant=request.tenant, priority=request.priority,
                                    arrival_time=request.arrival_time, slo=request.slo,
                                    **routed)
        except ValueError as e:
            self._release_waiting(request)
            stream._post_accepted(e)
            return
        except Exception:  # Not the request's fault, and no reason to stop everyone else's.
            logger.exception("adding request %r failed", request.request_id)
            self._release_waiting(request)
            stream._post_accepted(RequestFailed(
                f"request {request.request_id!r}: internal error while adding it"))
            return
        self._tracked[request.request_id] = _Tracked(
            request, stream, top=[[] for _ in range(request.sampling.n)],
            token_logprobs=[[] for _ in range(request.sampling.n)])
        stream._post_accepted(None)

    def _score(self, request_id: str, prompt_ids: list[int], num_top: int, model: str | None,
               future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        try:
            if model not in self._scorers:
                scored_model = self.engine.models()[model].model
                c = scored_model.config
                # One layer's K and V in float32 for the longest context the model has.
                budget = 2 * c.num_kv_heads * c.head_dim * 4 * c.max_position_embeddings
                self._scorers[model] = PrefillOnlyScorer(scored_model, kv_budget_bytes=budget)
            result = self._scorers[model].prompt_logprobs(request_id, prompt_ids, num_top)
        except ValueError as e:
            _resolve(loop, future, future.set_exception, e)
        except Exception:  # Not the request's fault, and no reason to stop everyone else's.
            logger.exception("scoring request %r failed", request_id)
            _resolve(loop, future, future.set_exception, RequestFailed(
                f"request {request_id!r}: internal error while scoring its prompt"))
        else:
            _resolve(loop, future, future.set_result, result)

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.is_aborted:
            return
        tracked.is_aborted = True
        try:
            self.engine.abort(request_id)
        except ValueError:  # It finished in the step the abort drained; its output follows.
            pass
        self._needs_step = True  # The output comes out of the next step.

    def _step(self) -> None:
        wants_logits = any(t.request.reads_logits for t in self._tracked.values())
        finished = self.engine.step(logits_mode=LogitsMode.LAST if wants_logits else
                                    LogitsMode.NONE)
        self._needs_step = False
        if wants_logits:
            self._take_logprobs()
        # Counters first, then the outputs: a client that has its answer sees them counted.
        self._metrics = self.engine.metrics()
        for out in finished:
            tracked = self._tracked.pop(out.request_id, None)
            if tracked is None:
                continue
            if not tracked.is_started:
                self._release_waiting(tracked.request)
            for callback in self.on_finished:
                callback(out)
            tracked.stream._post_update(self._update(tracked, out))
        if not self._tracked:
            return
        for out in self.engine.snapshot_outputs(drain=False, with_text=False):
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            num_tokens = sum(len(o.token_ids) for o in out.outputs)
            if num_tokens == tracked.num_tokens:
                continue
            tracked.num_tokens = num_tokens
            if not tracked.is_started:
                tracked.is_started = True
                self._release_waiting(tracked.request)
            tracked.stream._post_update(self._update(tracked, out))

    @staticmethod
    def _update(tracked: _Tracked, out: RequestOutput) -> Update:
        request = tracked.request
        if request.logprobs_temperature is not None:  # each new token's logprob, from its row
            for sample in out.outputs:
                mine = tracked.token_logprobs[sample.index]
                row = tracked.pending.pop(sample.index, None)
                if row is not None and len(sample.token_ids) == len(mine) + 1:
                    mine.append(float(row[sample.token_ids[-1]]))
            out = dataclasses.replace(out, outputs=[
                dataclasses.replace(sample, logprobs=list(
                    tracked.token_logprobs[sample.index][:len(sample.token_ids)]))
                for sample in out.outputs])
        if not request.num_top_logprobs:
            return Update(out)
        return Update(out, tuple(list(sample) for sample in tracked.top))

    def _take_logprobs(self) -> None:
        """From each sampled row's logits, for the requests that asked: the top k, and with
        `logprobs_temperature` the row (after temperature) its new token is read from."""
        rows = []
        for seq_id, row in self.engine.last_sampled_rows:
            request_id, _, sample = seq_id.rpartition("#")
            tracked = self._tracked.get(request_id)
            if tracked is not None and tracked.request.reads_logits and sample.isdigit():
                rows.append((tracked, int(sample), row))
        if not rows:
            return
        logits = np.asarray(self.engine.last_logits, np.float32)  # [R, V]
        picked = logits[[row for _, _, row in rows]]  # [r, V]
        scale = np.asarray([t.request.logprobs_temperature or 1.0 for t, _, _ in rows],
                           np.float32)
        picked = picked / scale[:, None]
        shifted = picked - picked.max(axis=-1, keepdims=True)
        logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # [r, V]
        for (tracked, sample, _), row_logprobs in zip(rows, logprobs, strict=True):
            if tracked.request.logprobs_temperature is not None:
                tracked.pending[sample] = row_logprobs
            k = tracked.request.num_top_logprobs
            if not k:
                continue
            top = np.argpartition(-row_logprobs, k - 1)[:k]
            top = top[np.argsort(-row_logprobs[top], kind="stable")]
            tracked.top[sample].append({int(t): float(row_logprobs[t]) for t in top})
