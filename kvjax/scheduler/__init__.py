"""Scheduling: which sequences run in each step (host-only decisions, returned as data)."""

from kvjax.scheduler.context import (
    STRATEGIES,
    ReuseStrategy,
    Segment,
    make_strategy,
    register_strategy,
)
from kvjax.scheduler.output import BlendRow, RunnerOutput, ScheduledRow, SchedulerOutput
from kvjax.scheduler.policies import POLICIES, SchedulingPolicy, make_policy, register_policy
from kvjax.scheduler.preemption import PreemptionDecision, PreemptionMode, decide_preemption
from kvjax.scheduler.request import (
    CompletionOutput,
    FinishReason,
    RequestOutput,
    SeqStatus,
    Sequence,
    WeightUpdatePolicy,
)
from kvjax.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = [
    "POLICIES",
    "STRATEGIES",
    "BlendRow",
    "CompletionOutput",
    "FinishReason",
    "PreemptionDecision",
    "PreemptionMode",
    "RequestOutput",
    "ReuseStrategy",
    "RunnerOutput",
    "ScheduledRow",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulingPolicy",
    "Segment",
    "SeqStatus",
    "Sequence",
    "WeightUpdatePolicy",
    "decide_preemption",
    "make_policy",
    "make_strategy",
    "register_policy",
    "register_strategy",
]
