"""An HTTP router in front of several kvjax server replicas (data parallelism over processes).

    app = build_router_app(RouterConfig(replicas=("http://127.0.0.1:8001", ...),
                                        policy="prefix_affinity"))
    uvicorn.run(app, port=8000)          # or scripts/router.py

The OpenAI API is passed through: POST /v1/completions and /v1/chat/completions (streamed
responses relayed event by event), GET /v1/models, POST /tokenize and /detokenize; a replica's
error comes back with its status and body. Each request goes to the healthy replica a routing
policy (`kvjax.router.policies`) picks from the replicas' polled state
(`kvjax.router.replicas`); a prefix-reading policy matches the prompt's pages under the
chain root the replica reports for the request's affinity key (its API key, named tenant and
cache_salt, digested), so a tenant's requests follow its pages. GET /health is 200 while a
replica is in the rotation; GET /metrics holds every replica's series labelled `replica`,
counters also summed (`replica="all"`), and the router's own `kvjax:router_*` series.

Faults. Every request carries an X-Request-Id (the client's, or one the router makes), which
the replica uses as the response id. When a replica's connection fails before it sent any
output (for a stream: before its first token event; a chat stream's opening role event is
held back until one), or it answers 503 (not admitting), the request
is sent once more, with the same id, to another replica, and the first leaves the rotation; a
dying replica cannot finish what it never answered, so no request runs twice to completion.
A stream that fails after output ends with an OpenAI error event and `[DONE]`: the
client saw output, so it is not run again. A replica silent for `read_timeout_s` gets 504
(not retried: it may still be running; closing the connection makes it abort). The router
keeps no state beyond its flags: a restart loses nothing but the requests in flight.

Prefill/decode disaggregation (`RouterConfig.prefill_replicas`): a completion or chat request
first goes to a prefill replica's POST /pd/prefill/... (`kvjax.server.pd`), which runs the
prompt for one token and answers with its KV pages in a frame; the frame goes to a decode
replica (`replicas`, chosen by the policy) as POST /pd/decode, whose answer (streamed or not)
is the client's, as a colocated server would give it. A prefill replica that fails (connection,
timeout, 503) leaves the rotation and the prefill runs once more on another, else the client
gets 503; a prefill replica's refusal (400, 429, ...) comes back as it is. The frames' KV bytes
are counted in `kvjax:router_kv_transfer_bytes_total`.

Alternating phases (`RouterConfig.phase_period_s`, `kvjax.router.phases`): the alternative to
disaggregation that moves no KV. Each replica in turn, for its window of every period, is the
only one new requests go to (the policy still picks, among that one); a retry, or a window
whose replica is down, falls back to every healthy replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvjax.router.http_metrics import RouterMetrics, aggregate_replica_metrics
from kvjax.router.phases import PhaseSchedule
from kvjax.router.policies import RouteRequest, make_policy
from kvjax.router.replicas import InFlight, Replica, ReplicaSet
from kvjax.server import protocol
from kvjax.server.kv_state import affinity_key
from kvjax.server.pd import CONTENT_TYPE as KV_FRAME_TYPE
from kvjax.server.pd import IMPORTED_TOKENS_HEADER, decode_header
from kvjax.server.serving import TENANT_HEADER

logger = logging.getLogger(__name__)

# Headers a replica's answer keeps on its way to the client.
_RELAYED_HEADERS = ("content-type", "retry-after", "cache-control", "x-request-id",
                    IMPORTED_TOKENS_HEADER)
REPLICA_HEADER = "x-kvjax-replica"  # which replica answered (for clients and tests)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How the router reaches its replicas.

    Attributes:
      replicas: base URLs of the kvjax servers (http://host:port).
      policy: a registered routing policy (round_robin, least_loaded, prefix_affinity,
        load_aware).
      poll_interval_s: seconds between polls of each replica's /health and /kv_state.
      poll_timeout_s: a health poll slower than this counts as missed; `max_missed_polls`
        in a row take the replica out of the rotation.
      max_missed_polls: see poll_timeout_s.
      connect_timeout_s: a replica not accepting a connection in this time counts as down.
      read_timeout_s: longest silence from a replica on a request (before its answer, or
        between two stream events); then the client gets 504.
      replica_api_key: sent to replicas that need one for /kv_state (clients' own keys are
        passed through on their requests).
      affinity_secret: the key of the replicas' /kv_state affinity digests
        (`ServerConfig.affinity_secret`), so the router finds tenants' cached pages there;
        None: tenants' requests are told apart without it but matched to no reported root.
      prefill_replicas: base URLs of prefill replicas; when given, requests are
        disaggregated: prefilled there, decoded on `replicas` (see the module docstring).
      phase_period_s: when given, replicas alternate prefill and decode phases
        (`kvjax.router.phases`): in each period of this many seconds, each replica in turn is
        the only one new requests go to.
    """

    replicas: tuple[str, ...]
    policy: str = "round_robin"
    poll_interval_s: float = 0.1
    poll_timeout_s: float = 2.0
    max_missed_polls: int = 3
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0
    replica_api_key: str | None = None
    affinity_secret: str | None = dataclasses.field(default=None, repr=False)
    prefill_replicas: tuple[str, ...] = ()
    phase_period_s: float | None = None

    def __post_init__(self):
        if self.phase_period_s is not None and self.prefill_replicas:
            raise ValueError("phase_period_s and prefill_replicas exclude each other: with "
                             "alternating phases every replica prefills in its own window, "
                             "so none is a prefill replica")
        if self.phase_period_s is not None and not self.phase_period_s > 0:
            raise ValueError(f"phase_period_s must be > 0, got {self.phase_period_s!r}")
        if set(self.prefill_replicas) & set(self.replicas):
            raise ValueError(f"a replica cannot be both a prefill and a decode replica: "
                             f"{sorted(set(self.prefill_replicas) & set(self.replicas))}")
        for name in ("poll_interval_s", "poll_timeout_s", "connect_timeout_s",
                     "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        make_policy(self.policy)  # An unknown name fails here, not at the first request.


class _NoReplica(Exception):
    """Every healthy replica was tried (or none is healthy)."""


class _BeforeOutput(Exception):
    """A replica failed before sending any output: the request may go elsewhere."""


def _error(status: int, message: str, *, type: str = "server_error") -> JSONResponse:
    return JSONResponse(protocol.error_body(message, type=type), status_code=status)


def _sse_error(message: str) -> bytes:
    body = protocol.error_body(message, type="server_error")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def _carries_output(event: bytes) -> bool:
    """Whether an SSE event shows the client anything of the answer: all but the role event a
    chat stream opens with (every choice's delta a role and no content). A token whose text is
    empty (a special token, half a character) still counts: the replica computed it."""
    try:
        choices = json.loads(event.decode().removeprefix("data: "))["choices"]
        return not choices or not all(
            "role" in c["delta"] and not c["delta"].get("content") for c in choices)
    except (ValueError, KeyError, TypeError):
        return True  # [DONE], an error event, a completion chunk: the client sees it.


def _affinity(body: Any, raw: Request, secret: str | None) -> str:
    """The request's affinity key (`kvjax.server.kv_state.affinity_key`), from what the replica
    reads to choose its pages' cache key: the API key, the named tenant and the cache_salt."""
    fields = body if isinstance(body, dict) else {}
    salt = fields.get("cache_salt")
    return affinity_key(raw.headers.get("authorization"),
                        raw.headers.get(TENANT_HEADER) or fields.get("user") or None,
                        salt if isinstance(salt, str) else None, secret=secret)


async def _events(response: httpx.Response) -> AsyncIterator[bytes]:
    """The response's SSE events, each whole (ending in a blank line), as they arrive."""
    buffer = b""
    async for chunk in response.aiter_raw():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buffer.strip():
        yield buffer


class HttpRouter:
    """Routes OpenAI requests over replicas; the logic behind `build_router_app`.

    Attributes:
      config: the RouterConfig.
      replicas: the ReplicaSet (health, polled state, in-flight requests).
      policy: the RoutingPolicy.
      metrics: the router's own counters (RouterMetrics).
    """

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient, *,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.client = client
        headers = ({} if config.replica_api_key is None
                   else {"authorization": f"Bearer {config.replica_api_key}"})
        self.replicas = ReplicaSet(config.replicas, client,
                                   poll_interval_s=config.poll_interval_s,
                                   poll_timeout_s=config.poll_timeout_s,
                                   max_missed_polls=config.max_missed_polls, headers=headers)
        self.policy = make_policy(config.policy)
        self.prefill_replicas = None
        if config.prefill_replicas:
            self.prefill_replicas = ReplicaSet(
                config.prefill_replicas, client, poll_interval_s=config.poll_interval_s,
                poll_timeout_s=config.poll_timeout_s, max_missed_polls=config.max_missed_polls,
                headers=headers)
            self.prefill_policy = make_policy(config.policy)
        self.phases = (None if config.phase_period_s is None else
                       PhaseSchedule(config.phase_period_s, len(config.replicas), clock=clock))
        self.metrics = RouterMetrics(self.replicas)
        self._timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)

    # ----------------------------------------------------------------------------- choosing

    async def _prompt_ids(self, path: str, body: Any) -> list[int] | None:
        """The prompt's token ids when the policy reads prefixes (the first prompt of a
        batch), from the body or a healthy replica's /tokenize; None if unknown."""
        if not self.policy.reads_prefix or not isinstance(body, dict):
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # A batch: route by its first prompt.
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            # Out-of-range ids are the replica's to refuse; they name no cached page.
            return prompt if all(0 <= t < 2**31 for t in prompt) else None
        if path.endswith("chat/completions"):
            query = dict(messages=body.get("messages"), add_generation_prompt=True)
        elif isinstance(prompt, str):
            query = dict(prompt=prompt)
        else:
            return None
        if body.get("model") is not None:
            query["model"] = body["model"]
        healthy = self.replicas.healthy()
        if not healthy:
            return None
        try:
            answer = await self.client.post(healthy[0].url + "/tokenize", json=query,
                                            timeout=self._timeout)
        except httpx.HTTPError:
            return None
        if answer.status_code != 200:
            return None  # The replica will refuse the request itself, with its reason.
        try:
            return [int(t) for t in answer.json()["tokens"]]
        except (ValueError, KeyError, TypeError):
            return None

    def replica_sets(self) -> list[ReplicaSet]:
        """The decode (or only) replicas, then the prefill replicas if any."""
        return [self.replicas] + ([] if self.prefill_replicas is None
                                  else [self.prefill_replicas])

    def _choose(self, prompt_ids: list[int] | None, affinity: str, tried: Sequence[Replica],
                *, prefill: bool = False) -> Replica:
        replicas, policy = ((self.prefill_replicas, self.prefill_policy) if prefill
                            else (self.replicas, self.policy))
        candidates = [r for r in replicas.healthy() if r not in tried]
        if not candidates:
            raise _NoReplica
        if self.phases is not None and not prefill:
            candidates = self.phases.admitting(candidates, replicas.replicas)
        hashes = [r.prompt_hashes(prompt_ids, affinity) for r in candidates]
        states = [r.instance_state(h) for r, h in zip(candidates, hashes, strict=True)]
        request = RouteRequest(prompt_len=len(prompt_ids or ()))
        index = policy.choose(request, states)
        if not 0 <= index < len(candidates):
            raise ValueError(f"policy {policy.name!r} chose replica {index} of "
                             f"{len(candidates)}")
        return candidates[index]

    # ----------------------------------------------------------------------------- proxying

    async def proxy(self, path: str, raw: Request) -> Response:
        """Forwards a completion request; retries it once elsewhere if its replica failed
        before any output."""
        content = await raw.body()
        try:
            body = json.loads(content)
        except ValueError:
            body = None  # The replica answers the malformed body with its 400.
        is_stream = isinstance(body, dict) and body.get("stream") is True
        request_id = raw.headers.get("x-request-id") or protocol.new_id(
            "chatcmpl" if path.endswith("chat/completions") else "cmpl")
        headers = {k: v for k, v in raw.headers.items()
                   if k.lower() not in ("host", "content-length")}
        headers["x-request-id"] = request_id
        prompt_ids = await self._prompt_ids(path, body)
        affinity = _affinity(body, raw, self.config.affinity_secret)
        if self.prefill_replicas is not None:
            frame = await self._prefill(path, content, headers, request_id, prompt_ids,
                                        affinity)
            if isinstance(frame, Response):
                return frame
            header = decode_header(frame)
            self.metrics.kv_transfer_bytes.inc(int(header["kv_bytes"]))
            self.metrics.kv_transfers.inc()
            if self.policy.reads_prefix:
                prompt_ids = [int(t) for t in header["prompt_ids"]]
            path, content = "/pd/decode", frame
            headers["content-type"] = KV_FRAME_TYPE
        max_new = body.get("max_tokens") if isinstance(body, dict) else None
        num_tokens = len(prompt_ids or ()) + (max_new if isinstance(max_new, int) else 0)
        tried: list[Replica] = []
        while len(tried) < 2:
            try:
                replica = self._choose(prompt_ids, affinity, tried)
            except _NoReplica:
                break
            tried.append(replica)
            replica.in_flight[request_id] = InFlight(
                num_tokens, replica.prompt_hashes(prompt_ids, affinity))
            try:
                return await self._attempt(replica, path, content, headers, request_id,
                                           is_stream)
            except _BeforeOutput as e:
                replica.in_flight.pop(request_id, None)
                self.replicas.mark_down(replica, str(e))
                self.metrics.count(replica, "failed_before_output")
                if len(tried) < 2:
                    self.metrics.retries.inc()
            except Exception:  # Logged in full; the client gets OpenAI's error JSON.
                replica.in_flight.pop(request_id, None)
                logger.exception("request %r on replica %s failed in the router", request_id,
                                 replica.url)
                self.metrics.count(replica, "router_error")
                return _error(502, f"request {request_id!r}: the router failed relaying "
                              f"replica {replica.url}'s answer")
            except BaseException:  # Cancelled: the client is gone.
                replica.in_flight.pop(request_id, None)
                raise
        self.metrics.count(None, "no_replica")
        return _error(503, f"request {request_id!r}: no healthy replica could serve it")

    async def _prefill(self, path: str, content: bytes, headers: dict[str, str],
                       request_id: str, prompt_ids: list[int] | None,
                       affinity: str) -> bytes | Response:
        """The request's KV frame from a prefill replica (tried once more on another if the
        first fails), or the response the client gets instead (a refusal, or 503)."""
        tried: list[Replica] = []
        while len(tried) < 2:
            try:
                replica = self._choose(prompt_ids, affinity, tried, prefill=True)
            except _NoReplica:
                break
            tried.append(replica)
            try:
                answer = await self.client.post(
                    replica.url + "/pd/prefill" + path.removeprefix("/v1"), content=content,
                    headers=headers, timeout=self._timeout)
                failure = None if answer.status_code != 503 else "it answered 503"
            except Exception as e:  # Nothing reached the client: the prefill may run again.
                failure = repr(e)
            if failure is None and answer.status_code == 200:
                self.metrics.count(replica, "prefill_200")
                return answer.content
            if failure is None:  # The replica's refusal of the request is the client's answer.
                self.metrics.count(replica, f"prefill_{answer.status_code}")
                relayed = {k: v for k, v in answer.headers.items() if k in _RELAYED_HEADERS}
                relayed[REPLICA_HEADER] = replica.url
                return Response(answer.content, status_code=answer.status_code,
                                headers=relayed)
            self.replicas_of(replica).mark_down(replica, f"prefill of {request_id!r}: {failure}")
            self.metrics.count(replica, "prefill_failed")
            if len(tried) < 2:
                self.metrics.retries.inc()
        self.metrics.count(None, "no_prefill_replica")
        return _error(503, f"request {request_id!r}: no healthy prefill replica could "
                      f"prefill it")

    def replicas_of(self, replica: Replica) -> ReplicaSet:
        return next(s for s in self.replica_sets() if replica in s.replicas)

    async def _attempt(self, replica: Replica, path: str, content: bytes,
                       headers: dict[str, str], request_id: str, is_stream: bool) -> Response:
        """One try on one replica. Raises _BeforeOutput when another replica may take it."""
        request = self.client.build_request("POST", replica.url + path, content=content,
                                            headers=headers, timeout=self._timeout)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.TimeoutException:
            return self._finish(replica, request_id, "timeout", _error(
                504, f"request {request_id!r}: replica {replica.url} did not answer in time"))
        except Exception as e:
            # Any failure before the replica answered (a transport error, or one the HTTP
            # stack raises unmapped when a socket dies mid-connect) left the client nothing;
            # the closed connection makes a live replica abort the request.
            raise _BeforeOutput(f"request {request_id!r}: {e!r}") from None
        if upstream.status_code == 503:  # Not admitting (draining, failed): nothing ran.
            await upstream.aclose()
            raise _BeforeOutput(f"request {request_id!r}: the replica answered 503")
        relayed = {k: v for k, v in upstream.headers.items() if k in _RELAYED_HEADERS}
        relayed[REPLICA_HEADER] = replica.url
        if not (is_stream and upstream.status_code == 200):
            try:
                data = await upstream.aread()
            except httpx.TimeoutException:
                return self._finish(replica, request_id, "timeout", _error(
                    504, f"request {request_id!r}: replica {replica.url} stalled"))
            except httpx.TransportError:
                # It had answered: the request ran there, so it is not run again.
                return self._finish(replica, request_id, "broken", _error(
                    502, f"request {request_id!r}: replica {replica.url} failed mid-answer"))
            finally:
                await upstream.aclose()
            return self._finish(replica, request_id, str(upstream.status_code),
                                Response(data, status_code=upstream.status_code,
                                         headers=relayed))
        events = _events(upstream)
        held: list[bytes] = []  # a chat stream's opening role event carries no output
        try:
            while not held or not _carries_output(held[-1]):
                held.append(await anext(events))
        except StopAsyncIteration:
            if not held:
                await upstream.aclose()
                raise _BeforeOutput(f"request {request_id!r}: stream ended before its first "
                                    "event") from None
        except httpx.TransportError as e:
            await upstream.aclose()
            if isinstance(e, httpx.TimeoutException):
                return self._finish(replica, request_id, "timeout", _error(
                    504, f"request {request_id!r}: replica {replica.url} stalled"))
            raise _BeforeOutput(f"request {request_id!r}: stream failed before any output: "
                                f"{e!r}") from None
        return StreamingResponse(self._relay(replica, request_id, upstream, held, events),
                                 status_code=200, headers=relayed)

    async def _relay(self, replica: Replica, request_id: str, upstream: httpx.Response,
                     held: list[bytes], events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        outcome = "200"
        try:
            for event in held:
                yield event
            async for event in events:
                yield event
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "client_gone"  # Closing the upstream below makes the replica abort it.
            raise
        except httpx.TransportError as e:
            outcome = "stream_broken"
            self.replicas.mark_down(replica, f"stream of {request_id!r} broke: {e!r}")
            yield _sse_error(f"request {request_id!r}: replica {replica.url} failed while "
                             "streaming; the output above is incomplete")
        finally:
            await upstream.aclose()
            self._finish(replica, request_id, outcome, None)

    def _finish(self, replica: Replica, request_id: str, outcome: str,
                response: Response | None) -> Response | None:
        replica.in_flight.pop(request_id, None)
        self.metrics.count(replica, outcome)
        return response

    async def forward(self, method: str, path: str, raw: Request) -> Response:
        """A request no routing choice matters for (models, tokenize), to a healthy replica."""
        healthy = self.replicas.healthy()
        if not healthy:
            return _error(503, "no healthy replica")
        headers = {k: v for k, v in raw.headers.items()
                   if k.lower() not in ("host", "content-length")}
        try:
            answer = await self.client.request(method, healthy[0].url + path,
                                               content=await raw.body(), headers=headers,
                                               timeout=self._timeout)
        except httpx.HTTPError as e:
            return _error(502, f"replica {healthy[0].url} failed: {e!r}")
        relayed = {k: v for k, v in answer.headers.items() if k in _RELAYED_HEADERS}
        return Response(answer.content, status_code=answer.status_code, headers=relayed)

    async def render_metrics(self) -> bytes:
        """The replicas' /metrics (labelled by replica, counters summed) and the router's."""
        texts = {}
        for replica in [r for replicas in self.replica_sets() for r in replicas.healthy()]:
            try:
                answer = await self.client.get(replica.url + "/metrics", timeout=self._timeout)
                texts[replica.url] = answer.text
            except httpx.HTTPError:
                continue
        return aggregate_replica_metrics(texts) + self.metrics.render()


def build_router_app(config: RouterConfig, client: httpx.AsyncClient | None = None, *,
                     clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The router's FastAPI app; its lifespan polls the replicas (`app.state.router` holds
    the HttpRouter). `client` (tests: one over fake replicas) defaults to a fresh one;
    `clock` times the phase windows (`RouterConfig.phase_period_s`)."""
    router = HttpRouter(config, client or httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)), clock=clock)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for replicas in router.replica_sets():
            await replicas.poll_once()
            replicas.start()
        try:
            yield
        finally:
            for replicas in router.replica_sets():
                await replicas.stop()
            if client is None:
                await router.client.aclose()

    app = FastAPI(title="kvjax router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await router.proxy("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await router.proxy("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await router.forward("GET", "/v1/models", raw)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        return await router.forward("POST", "/tokenize", raw)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        return await router.forward("POST", "/detokenize", raw)

    @app.get("/health")
    async def health() -> Response:
        if not router.replicas.healthy():
            return _error(503, "no replica is healthy")
        return JSONResponse(dict(replicas={r.url: r.is_healthy
                                           for r in router.replicas.replicas}))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve_router(config: RouterConfig, *, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "info") -> None:
    """Serves the router over HTTP until SIGTERM or SIGINT."""
    uvicorn.run(build_router_app(config), host=host, port=port, log_level=log_level)
