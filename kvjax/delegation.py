"""Delegation: a coordinator's method that is one of its components' methods, with the same
signature and docstring, so the coordinator keeps its public API while the component owns the
work."""

from __future__ import annotations

import functools
from collections.abc import Callable


def delegate(component: str, method: Callable) -> Callable:
    """The method `method` of the owner's attribute `component`, as a method of the owner."""

    @functools.wraps(method)
    def forward(self, *args, **kwargs):
        return method(getattr(self, component), *args, **kwargs)

    return forward


def delegate_attribute(component: str, name: str, doc: str) -> property:
    """The attribute `name` of the owner's attribute `component`, read and set through the
    owner."""
    return property(lambda self: getattr(getattr(self, component), name),
                    lambda self, value: setattr(getattr(self, component), name, value), doc=doc)
