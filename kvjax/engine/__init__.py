"""The serving engine: the facade, its core loop, the model runner and the jitted step."""

from kvjax.engine.config import EngineConfig, PreemptionMode
from kvjax.engine.core import EngineCore
from kvjax.engine.engine import Engine
from kvjax.engine.runner import ModelRunner, StepBuckets, StepObserver
from kvjax.engine.step import (
                               AttentionImpl,
                               LogitsMode,
                               MatmulImpl,
                               StepInput,
                               StepOutput,
                               StepShape,
)

__all__ = [
    "AttentionImpl",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "LogitsMode",
    "MatmulImpl",
    "ModelRunner",
    "PreemptionMode",
    "StepBuckets",
    "StepInput",
    "StepObserver",
    "StepOutput",
    "StepShape",
]
