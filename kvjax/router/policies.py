"""Routing policies: which engine instance serves a new request.

A policy is a small class behind the `RoutingPolicy` protocol, registered by name so a flag or
config picks it. It sees the request (`RouteRequest`) and one `InstanceState` per instance, a
snapshot the router builds from its own bookkeeping and each instance's prefix cache, so a
policy is a pure choice that tests can drive with hand-made states.

Every policy breaks ties the same way: fewer queued tokens, then the lower index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Protocol

from kvjax.registry import Registry


@dataclasses.dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of the request being routed.

    Attributes:
      prompt_len: tokens in the prompt.
      tenant: who sent it (its prefix-cache salt), or None.
    """

    prompt_len: int
    tenant: str | None = None


@dataclasses.dataclass(frozen=True)
class InstanceState:
    """One engine instance as a policy sees it when a request arrives.

    Attributes:
      num_seqs: requests routed to it and not finished (running or waiting there).
      num_tokens: their tokens, prompt plus max new tokens each, times n samples: what they
        will occupy in its KV pool.
      prefix_tokens: leading tokens of this request's prompt whose KV the instance already
        holds in its prefix cache or is computing for an earlier unfinished request (full
        pages only, and never the prompt's last token, as the prefix cache shares them).
    """

    num_seqs: int
    num_tokens: int
    prefix_tokens: int = 0


class RoutingPolicy(Protocol):
    """Chooses the instance for a request.

    Attributes:
      name: the registered name.
      reads_prefix: whether `choose` reads `InstanceState.prefix_tokens` (an HTTP router
        tokenizes the prompt only for such a policy).
    """

    name: str
    reads_prefix: bool

    def choose(self, request: RouteRequest, instances: Seq[InstanceState]) -> int:
        """The index in `instances` of the instance that serves `request`."""


def _argmin(instances: Seq[InstanceState], key: Callable[[InstanceState], float]) -> int:
    """The index minimizing (key, queued tokens, index)."""
    return min(range(len(instances)),
               key=lambda i: (key(instances[i]), instances[i].num_tokens, i))


class RoundRobin:
    """Instances in turn, blind to load and cache contents: the baseline."""

    name = "round_robin"
    reads_prefix = False

    def __init__(self):
        self._next = 0

    def choose(self, request: RouteRequest, instances: Seq[InstanceState]) -> int:
        index = self._next % len(instances)
        self._next = index + 1
        return index


class LeastLoaded:
    """The instance with the fewest queued tokens (its running and waiting requests')."""

    name = "least_loaded"
    reads_prefix = False

    def choose(self, request: RouteRequest, instances: Seq[InstanceState]) -> int:
        return _argmin(instances, lambda s: s.num_tokens)


class PrefixAffinity:
    """The instance holding the longest prefix of the prompt; ties go to the least loaded."""

    name = "prefix_affinity"
    reads_prefix = True

    def choose(self, request: RouteRequest, instances: Seq[InstanceState]) -> int:
        return _argmin(instances, lambda s: -s.prefix_tokens)


class LoadAware:
    """Trades cache hits against queueing with no tuned weight.

    score = (prompt tokens the instance must still prefill) x (its batch size + 1): the new
    prefill work, stretched by the requests it shares the instance with (waiting ones count,
    as they join the batch first). The lowest score wins.
    """

    name = "load_aware"
    reads_prefix = True

    def choose(self, request: RouteRequest, instances: Seq[InstanceState]) -> int:
        return _argmin(instances, lambda s: (request.prompt_len - s.prefix_tokens)
                       * (s.num_seqs + 1))


POLICIES = Registry.of("routing policy", RoundRobin, LeastLoaded, PrefixAffinity, LoadAware)


def make_policy(name: str) -> RoutingPolicy:
    """A fresh routing policy by registered name."""
    return POLICIES.make(name)
