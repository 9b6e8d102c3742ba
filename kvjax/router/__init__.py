"""Routing requests over engine instances, and prefill/decode disaggregation.

The HTTP router over server processes is `kvjax.router.http` (imported on its own: it needs
httpx, the `router` extra).
"""

from kvjax.router.disagg import DisaggregatedEngine, replay_disaggregated
from kvjax.router.policies import (
    POLICIES,
    InstanceState,
    RouteRequest,
    RoutingPolicy,
    make_policy,
)
from kvjax.router.router import Arrival, Router, SimClock, replay

__all__ = [
    "POLICIES",
    "Arrival",
    "DisaggregatedEngine",
    "InstanceState",
    "RouteRequest",
    "Router",
    "RoutingPolicy",
    "SimClock",
    "make_policy",
    "replay",
    "replay_disaggregated",
]
