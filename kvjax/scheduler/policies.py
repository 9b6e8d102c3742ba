"""Scheduling policies: the order in which waiting requests are admitted and running ones preempted.

A policy is a small class behind the `SchedulingPolicy` protocol, registered by name so a config
or flag picks it. The scheduler admits waiting requests in ascending `priority_key` order and,
when pages run out, preempts the running request with the largest key first.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Protocol

from kvjax.registry import Registry
from kvjax.scheduler.request import Sequence


class SchedulingPolicy(Protocol):
    """Orders requests. Smaller keys are served first and preempted last.

    Attributes:
      name: the registry name.
      ranks_prefills_together: whether a waiting sequence may go before a running one's
        unfinished prefill (True: prefill chunks follow the keys alone; False: running
        prefills finish first, so pages already taken are put to use before new admissions).
    """

    name: str
    ranks_prefills_together: bool

    def priority_key(self, seq: Sequence) -> tuple:
        """The sort key of a waiting or running sequence."""

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None:
        """Called after a step computed num_tokens tokens for seq (prefill or decode)."""


class FCFS:
    """First come, first served by arrival time."""

    name = "fcfs"
    ranks_prefills_together = False

    def priority_key(self, seq: Sequence) -> tuple:
        return (seq.arrival_time, seq.order)

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None:
        pass


class Priority:
    """Higher `priority` first, then arrival."""

    name = "priority"
    ranks_prefills_together = False

    def priority_key(self, seq: Sequence) -> tuple:
        return (-seq.priority, seq.arrival_time, seq.order)

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None:
        pass


class LongestPrefixMatch:
    """Cache-aware: requests with more prompt tokens already in the prefix cache go first."""

    name = "lpm"
    ranks_prefills_together = False

    def __init__(self, cached_tokens: Callable[[Sequence], int] | None = None):
        self.cached_tokens = cached_tokens

    def priority_key(self, seq: Sequence) -> tuple:
        hit = self.cached_tokens(seq) if self.cached_tokens else 0
        return (-hit, seq.arrival_time, seq.order)

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None:
        pass


class FairShare:
    """Per-tenant fair share: the tenant with the fewest tokens served so far goes first.

    A virtual token counter per tenant grows with every token computed for it. A tenant seen
    for the first time starts `new_tenant_credit` tokens below the current minimum: its first
    prompt (up to that many tokens) is prefilled without taking turns, chunk by chunk, with a
    backlogged tenant, while the credit is too small to claim the time it was absent. A
    tenant's waiting request goes before another tenant's unfinished prefill when it has been
    served less, so a flood of long prompts cannot hold the prefill slots.
    Trade-off: every new tenant name is worth the credit once, so where clients may name
    tenants freely (`--allow_client_tenant`) a client can buy priority by inventing names.

    Attributes:
      new_tenant_credit: tokens of head start a tenant gets when first seen.
    """

    name = "fair"
    ranks_prefills_together = True
    new_tenant_credit = 512.0

    def __init__(self):
        self.served: dict[str | None, float] = collections.defaultdict(float)

    def priority_key(self, seq: Sequence) -> tuple:
        if seq.tenant not in self.served:
            floor = min(self.served.values(), default=0.0)
            self.served[seq.tenant] = floor - self.new_tenant_credit
        return (self.served[seq.tenant], seq.arrival_time, seq.order)

    def on_tokens(self, seq: Sequence, num_tokens: int) -> None:
        self.served[seq.tenant] += num_tokens


POLICIES = Registry.of("scheduler policy", FCFS, Priority, LongestPrefixMatch, FairShare)


def register_policy(cls: type) -> type:
    """Class decorator that makes a policy selectable by its `name`."""
    return POLICIES.add(cls)


def make_policy(name: str) -> SchedulingPolicy:
    """Instantiates a registered policy by name."""
    return POLICIES.make(name)


def rank(policy: SchedulingPolicy, seqs: list[Sequence], first: tuple[str, ...] = ()
         ) -> list[Sequence]:
    """The policy's order; sequences named in `first` (a controller's order) before it."""
    ranked = sorted(seqs, key=policy.priority_key)
    if not first:
        return ranked
    where = {seq_id: i for i, seq_id in enumerate(first)}
    return sorted(ranked, key=lambda s: where.get(s.seq_id, len(where)))
