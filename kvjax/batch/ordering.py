"""Orderings of a batch: which request runs when, so the prefix cache hits more.

An ordering is a small class behind the `Ordering` protocol, registered by name so
`--order` picks it (as scheduling policies are). Row orderings only permute requests, so
greedy outputs equal the input order's; `fields` also rewrites record prompts with one
shared field order (LLMQueryReordering), which changes their tokens but not their content.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from kvjax.batch.requests import BatchRequest, render_record
from kvjax.registry import Registry

Encode = Callable[[str], list[int]]


class Ordering(Protocol):
    """Arranges a batch: returns its requests in run order (possibly with rewritten prompts)."""

    name: str

    def arrange(self, requests: Sequence[BatchRequest], encode: Encode) -> list[BatchRequest]:
        """The requests in the order they should run."""


def prefix_order(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Indices of `prompts` in depth-first order of a trie over their token ids.

    Prompts sharing a prefix come out adjacent, longest shared prefixes nearest, so each
    one's shared pages are still in the prefix cache when the next runs. Children are visited
    in first-seen order, so ties keep input order.
    """
    root: dict = {}
    ends: dict[int, list[int]] = collections.defaultdict(list)  # id(node) -> prompt indices
    for i, prompt in enumerate(prompts):
        node = root
        for t in prompt:
            node = node.setdefault(t, {})
        ends[id(node)].append(i)
    order, stack = [], [root]
    while stack:  # Iterative: prompts are longer than Python's recursion limit.
        node = stack.pop()
        order.extend(ends.get(id(node), ()))
        stack.extend(reversed(list(node.values())))
    return order


class InputOrder:
    """The baseline: the order of the input file."""

    name = "input"

    def arrange(self, requests, encode):
        return list(requests)


class PrefixOrder:
    """Depth-first over a trie of prompt ids (`prefix_order`)."""

    name = "prefix"

    def arrange(self, requests, encode):
        return [requests[i] for i in prefix_order([r.prompt_ids for r in requests])]


def shared_field_order(records: Sequence[dict[str, str]]) -> list[str]:
    """Fields ordered most-shared first: by how many records repeat a value they hold
    (records - distinct values), ties by first appearance. One order for every record, so
    rows agreeing on the leading fields share a prompt prefix."""
    fields = list(dict.fromkeys(f for r in records for f in r))
    present = {f: [r[f] for r in records if f in r] for f in fields}
    return sorted(fields, key=lambda f: -(len(present[f]) - len(set(present[f]))))


class FieldOrder:
    """LLMQueryReordering: record prompts re-rendered with `shared_field_order`, then
    `PrefixOrder` over the rows."""

    name = "fields"

    def arrange(self, requests, encode):
        fields = shared_field_order([r.record for r in requests if r.record is not None])
        rewritten = [r if r.record is None else dataclasses.replace(
            r, prompt_ids=encode(render_record(
                r.instruction, r.record, [f for f in fields if f in r.record])))
            for r in requests]
        return PrefixOrder().arrange(rewritten, encode)


class BlendOrder:
    """BlendServe: prefix groups kept whole, alternating prefill-heavy and decode-heavy ones,
    so each step mixes compute-bound prefill with memory-bound decode.

    Groups are runs of the trie order sharing their first `min_shared` tokens; a group's
    weight is its prompt tokens over its decode tokens.
    """

    name = "blend"

    def __init__(self, min_shared: int = 16):
        self.min_shared = min_shared

    def arrange(self, requests, encode):
        groups: list[list[BatchRequest]] = []
        for r in PrefixOrder().arrange(requests, encode):
            if groups and groups[-1][0].prompt_ids[:self.min_shared] == \
                    r.prompt_ids[:self.min_shared]:
                groups[-1].append(r)
            else:
                groups.append([r])
        groups.sort(key=lambda g: -sum(len(r.prompt_ids) for r in g)
                    / sum(r.sampling.max_new_tokens for r in g))
        mixed, lo, hi = [], 0, len(groups) - 1
        while lo <= hi:  # Heaviest prefill group, then heaviest decode group, inward.
            mixed.extend(groups[lo])
            if hi != lo:
                mixed.extend(groups[hi])
            lo, hi = lo + 1, hi - 1
        return mixed


ORDERINGS = Registry.of("batch order", InputOrder, PrefixOrder, FieldOrder, BlendOrder)


def register_ordering(cls: type) -> type:
    """Class decorator that makes an ordering selectable by its `name`."""
    return ORDERINGS.add(cls)


def make_ordering(name: str) -> Ordering:
    """Instantiates a registered ordering by name."""
    return ORDERINGS.make(name)
