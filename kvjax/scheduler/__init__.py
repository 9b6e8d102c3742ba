"""Scheduling: which sequences run in each step (host-only decisions, returned as data)."""

from kvjax.scheduler.output import RunnerOutput, ScheduledRow, SchedulerOutput
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
    "CompletionOutput",
    "FinishReason",
    "PreemptionDecision",
    "PreemptionMode",
    "RequestOutput",
    "RunnerOutput",
    "ScheduledRow",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulingPolicy",
    "SeqStatus",
    "Sequence",
    "WeightUpdatePolicy",
    "decide_preemption",
    "make_policy",
    "register_policy",
]
