"""Factories by name: how a config or flag picks a policy (drafters, KV controllers, ...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Registry(dict[str, Callable[..., Any]]):
    """name -> factory(**options) of one kind of policy.

    `make(name, **options)` builds one; an unknown name or options the factory does not take
    raise ValueError naming the kind and what is registered.
    """

    def __init__(self, kind: str, factories: dict[str, Callable[..., Any]] | None = None):
        super().__init__(factories or {})
        self.kind = kind

    @classmethod
    def of(cls, kind: str, *classes: type) -> Registry:
        """A registry of `classes`, each under its `name` attribute."""
        return cls(kind, {c.name: c for c in classes})

    def register(self, name: str, factory: Callable[..., Any]) -> None:
        self[name] = factory

    def add(self, policy_class: type) -> type:
        """Registers a class under its `name` attribute; returns it (a class decorator)."""
        self[policy_class.name] = policy_class
        return policy_class

    def make(self, name: str, **options: Any) -> Any:
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {sorted(self)}")
        try:
            return self[name](**options)
        except TypeError as e:
            raise ValueError(f"{self.kind} {name!r}: bad options {options!r} ({e})") from None
