"""The FastAPI app and the uvicorn server around an `Engine`.

    app = build_app(engine, ServerConfig(model_name="smollm2"))   # routes, metrics, lifespan
    serve(engine, config, host="127.0.0.1", port=8000)            # blocks; SIGTERM drains

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, and vLLM's
POST /tokenize, POST /detokenize, GET /version; GET /health, GET /metrics (kvjax: and
vllm: names) and GET /kv_state (load and prefix-cache index for a router,
`kvjax.server.kv_state`); for a router's prefill/decode disaggregation, POST
/pd/prefill/completions, /pd/prefill/chat/completions and /pd/decode (`kvjax.server.pd`).
With API keys (`ServerConfig.api_keys`) every route but /health, /metrics and /version needs
one. An X-Request-Id header names the response (a router's retry
on another replica keeps its id). The app's lifespan starts the engine thread and, at
shutdown, stops it (live requests are aborted, their pages freed). Every error, a malformed
body included, is OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import signal
import socket
import threading
import time

import uvicorn
from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvjax.engine.engine import Engine
from kvjax.engine.multi import MultiModelEngine
from kvjax.server import protocol
from kvjax.server.async_engine import AsyncEngine, RequestFailed
from kvjax.server.kv_state import kv_state
from kvjax.server.metrics import ServerMetrics
from kvjax.server.pd import PDEndpoints
from kvjax.server.serving import ApiError, OpenAIServing, ServerConfig

logger = logging.getLogger(__name__)


def build_app(engine: Engine | MultiModelEngine, config: ServerConfig) -> FastAPI:
    """An app serving `engine` (which must not be stepped by anyone else from now on).

    A `MultiModelEngine` serves each of its models under its own name (the request's `model`
    picks it; `config.model_name` is the one a request without `model` goes to, or the first
    model if it names none of them).

    `app.state` holds `async_engine` (the AsyncEngine), `metrics` (ServerMetrics),
    `servings` (model name -> OpenAIServing) and `pd` (the prefill/decode endpoints,
    `kvjax.server.pd.PDEndpoints`).
    """
    async_engine = AsyncEngine(engine, max_waiting=config.max_waiting,
                               max_waiting_tokens=config.max_waiting_tokens)
    metrics = ServerMetrics(async_engine, config.model_name)
    servings = {}
    for route, model_engine in engine.models().items():
        if model_engine.model.tokenizer is None:
            raise ValueError("the server needs a model with a tokenizer (text in and out)")
        name = config.model_name if route is None else route
        servings[name] = OpenAIServing(
            async_engine, tokenizer=model_engine.model.tokenizer,
            max_model_len=model_engine.max_model_len,
            vocab_size=model_engine.model.config.vocab_size,
            config=dataclasses.replace(config, model_name=name), metrics=metrics, route=route,
            root=model_engine.model.config.name)
    default = servings.get(config.model_name, next(iter(servings.values())))

    def serving_for(model: str | None) -> OpenAIServing:
        """The serving of the model a request names (None: the default one)."""
        if model is None:
            return default
        if model not in servings:
            names = ", ".join(f"`{name}`" for name in servings)
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                           f"{names}", param="model", code="model_not_found")
        return servings[model]

    def authenticated(raw: Request) -> None:
        """Refuses (401) a request without a valid key before its body is looked at."""
        config.authenticate(raw.headers.get("authorization"))

    keyed = [Depends(authenticated)]

    async def routed(body, raw: Request, *, chat: bool) -> Response:
        serving = serving_for(body.model)
        return await (serving.chat(body, raw) if chat else serving.completions(body, raw))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="kvjax", lifespan=lifespan)
    app.state.async_engine, app.state.metrics, app.state.servings = (async_engine, metrics,
                                                                     servings)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        metrics.reject("invalid")
        return JSONResponse(protocol.validation_error_body(list(e.errors())), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(protocol.error_body(str(e.detail), type="invalid_request_error"),
                            status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        # The client learns that it failed, not how: an exception's text can hold paths,
        # fingerprints or other requests' data. The log has it all.
        logger.exception("unhandled error serving %s", request.url.path)
        message = str(e) if isinstance(e, RequestFailed) else "internal error"
        return JSONResponse(protocol.error_body(message, type="server_error"), status_code=500)

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: protocol.CompletionRequest, raw: Request) -> Response:
        return await _counted(metrics, routed(body, raw, chat=False))

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat(body: protocol.ChatCompletionRequest, raw: Request) -> Response:
        return await _counted(metrics, routed(body, raw, chat=True))

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict:
        listed = [serving.models()["data"] for serving in servings.values()]
        return dict(object="list", data=[m for data in listed for m in data])

    @app.post("/tokenize", dependencies=keyed)
    async def tokenize(body: protocol.TokenizeRequest) -> dict:
        return await serving_for(body.model).tokenize(body)

    @app.post("/detokenize", dependencies=keyed)
    async def detokenize(body: protocol.DetokenizeRequest) -> dict:
        return await serving_for(body.model).detokenize(body)

    pd = app.state.pd = PDEndpoints(async_engine)

    @app.post("/pd/prefill/completions", dependencies=keyed)
    async def prefill_completions(body: protocol.CompletionRequest, raw: Request) -> Response:
        return await _counted(metrics, pd.prefill(serving_for(body.model), body, raw,
                                                  chat=False))

    @app.post("/pd/prefill/chat/completions", dependencies=keyed)
    async def prefill_chat(body: protocol.ChatCompletionRequest, raw: Request) -> Response:
        return await _counted(metrics, pd.prefill(serving_for(body.model), body, raw,
                                                  chat=True))

    @app.post("/pd/decode", dependencies=keyed)
    async def decode(raw: Request) -> Response:
        return await _counted(metrics, pd.decode(serving_for, raw))

    @app.get("/version")
    async def version() -> dict:
        return dict(version=importlib.metadata.version("kvjax"))

    @app.get("/health")
    async def health() -> Response:
        if async_engine.error is not None:
            return JSONResponse(protocol.error_body(
                "the engine failed; the server must be restarted", type="server_error"),
                status_code=503)
        if not async_engine.is_admitting:
            return JSONResponse(protocol.error_body("the server is draining",
                                                    type="server_error"), status_code=503)
        return JSONResponse({})

    @app.get("/kv_state", dependencies=keyed)
    async def replica_state(model: str | None = None) -> dict:
        serving = serving_for(model)
        engine = async_engine.engine.models()[serving.route]
        affinities = serving.affinities.entries()  # a copy: the book changes on this thread
        return await async_engine.call(lambda: kv_state(engine, affinities),
                                       asyncio.get_running_loop())

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _counted(metrics: ServerMetrics, handler) -> Response:
    try:
        return await handler
    except ApiError as e:
        if e.status in (400, 404):
            metrics.reject("invalid")
        raise


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM / SIGINT draining instead of dying.

    On the signal the engine stops admitting (new requests get 503), uvicorn stops
    accepting connections and waits up to `timeout_graceful_shutdown` for in-flight
    responses, then the lifespan stops the engine. Unlike uvicorn's own handler, the signal
    is not raised again afterwards, so the process exits 0.
    """

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine):
        super().__init__(config)
        self.async_engine = async_engine

    def handle_exit(self, sig: int, frame) -> None:
        self.async_engine.stop_admitting()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class BackgroundServer:
    """A server on a thread of its own (notebooks, tests): `with BackgroundServer(...) as s:`.

    Attributes:
      app: the FastAPI app (its `state` holds the AsyncEngine and metrics).
      server: the DrainingServer; `shutdown()` asks it to drain and waits for it.
      base_url: http://host:port, the port picked by the OS when 0 was asked for.
    """

    def __init__(self, engine: Engine, config: ServerConfig, *, host: str = "127.0.0.1",
                 port: int = 0, log_level: str = "warning"):
        self.app = build_app(engine, config)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        host, port = self._socket.getsockname()[:2]
        self.base_url = f"http://{host}:{port}"
        uv_config = uvicorn.Config(self.app, log_level=log_level, lifespan="on",
                                   timeout_graceful_shutdown=config.drain_timeout_s)
        self.server = DrainingServer(uv_config, self.app.state.async_engine)
        self._thread = threading.Thread(target=self.server.run,
                                        kwargs=dict(sockets=[self._socket]),
                                        name="kvjax-http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def shutdown(self) -> None:
        """Drains as SIGTERM would (bounded by the drain timeout) and waits for the thread."""
        self.server.handle_exit(signal.SIGTERM, None)
        self._thread.join()
        self._socket.close()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


def serve(engine: Engine, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Serves `engine` over HTTP until SIGTERM or SIGINT (then drains and returns)."""
    app = build_app(engine, config)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                               timeout_graceful_shutdown=config.drain_timeout_s)
    DrainingServer(uv_config, app.state.async_engine).run()
