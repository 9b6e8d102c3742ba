"""kvjax: the KV cache of LLM serving as explicit, hackable state in JAX.

The public names below load on first use (PEP 562), so a process that imports only the host-side
packages (`kvjax.scheduler`, `kvjax.memory`'s block manager, prefix cache and KV cache manager)
never imports jax: a router, a simulator or a replay of recorded decisions runs without an
accelerator.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module it is imported from (on first use).
_EXPORTS = {
    "AttentionImpl": "kvjax.engine.step",
    "Engine": "kvjax.engine.engine",
    "EngineConfig": "kvjax.engine.config",
    "FinishReason": "kvjax.engine.request",
    "Grammar": "kvjax.grammar",
    "GrammarKind": "kvjax.grammar",
    "KVLayout": "kvjax.config",
    "MatmulImpl": "kvjax.engine.step",
    "MlaConfig": "kvjax.config",
    "Model": "kvjax.models.model",
    "ModelConfig": "kvjax.config",
    "ModelSpec": "kvjax.engine.multi",
    "MoeConfig": "kvjax.config",
    "MoeScoring": "kvjax.config",
    "MultiModelEngine": "kvjax.engine.multi",
    "PoolConfig": "kvjax.engine.multi",
    "PreemptionMode": "kvjax.engine.config",
    "RequestOutput": "kvjax.engine.request",
    "SLO": "kvjax.scheduler.controller",
    "SamplingParams": "kvjax.sampling",
    "Segment": "kvjax.scheduler.context",
    "SpecConfig": "kvjax.scheduler.spec",
    "encode_prompt": "kvjax.generation",
    "generate": "kvjax.generation",
    "load_model": "kvjax.models.loading",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvjax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
