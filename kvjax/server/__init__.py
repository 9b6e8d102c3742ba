"""An OpenAI-compatible HTTP server over `kvjax.Engine` (FastAPI + uvicorn).

    engine = kvjax.Engine(kvjax.load_model(), kvjax.EngineConfig(max_num_seqs=8))
    engine.warmup()
    kvjax.server.serve(engine, kvjax.server.ServerConfig(model_name="smollm2-135m"))

The engine runs in one background thread (`AsyncEngine`); HTTP handlers submit to it and
await their outputs. Nothing below this package imports it.
"""

from kvjax.server.app import BackgroundServer, DrainingServer, build_app, serve
from kvjax.server.async_engine import AsyncEngine, EngineRequest, NotAdmitting, QueueFull
from kvjax.server.serving import ApiError, OpenAIServing, ServerConfig

__all__ = [
    "ApiError",
    "AsyncEngine",
    "BackgroundServer",
    "DrainingServer",
    "EngineRequest",
    "NotAdmitting",
    "OpenAIServing",
    "QueueFull",
    "ServerConfig",
    "build_app",
    "serve",
]
