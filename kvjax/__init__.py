"""kvjax: the KV cache of LLM serving as explicit, hackable state in JAX."""

from kvjax.config import KVLayout, MlaConfig, ModelConfig
from kvjax.engine.config import EngineConfig, PreemptionMode
from kvjax.engine.engine import Engine
from kvjax.engine.multi import ModelSpec, MultiModelEngine, PoolConfig
from kvjax.engine.request import FinishReason, RequestOutput
from kvjax.engine.step import AttentionImpl, MatmulImpl
from kvjax.generation import encode_prompt, generate
from kvjax.grammar import Grammar, GrammarKind
from kvjax.models.loading import load_model
from kvjax.models.model import Model
from kvjax.sampling import SamplingParams
from kvjax.scheduler.context import Segment
from kvjax.scheduler.controller import SLO
from kvjax.scheduler.spec import SpecConfig

__all__ = [
    "AttentionImpl",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "Grammar",
    "GrammarKind",
    "KVLayout",
    "MatmulImpl",
    "MlaConfig",
    "Model",
    "ModelConfig",
    "ModelSpec",
    "MultiModelEngine",
    "PoolConfig",
    "PreemptionMode",
    "RequestOutput",
    "SLO",
    "SamplingParams",
    "Segment",
    "SpecConfig",
    "encode_prompt",
    "generate",
    "load_model",
]
