"""A small name -> object registry, so a config string picks an implementation.

Variants (advantage estimators, policy losses, KL estimators, ...) register themselves
with a decorator; callers look them up by the name a user wrote in a config::

    ADV_ESTIMATORS = Registry("advantage estimator", config_key="algorithm.adv_estimator")

    @ADV_ESTIMATORS.register("grpo", needs_critic=False)
    def grpo_advantages(...): ...

    fn = ADV_ESTIMATORS.get("grpo")

An unknown name raises :class:`UnknownNameError` with a "did you mean" suggestion, the
list of valid names, and the config key to change.

An entry whose module is costly to import (one that imports transformers) can be
declared by its import path instead (``declare("hf", "rayrl.rollout.hf.engine:HFRolloutEngine")``):
the name is known at once, for checking a config; the module is imported on the first
`get`, and its ``register`` decorator then fills the entry in.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(LookupError):
    """Raised when a registry is asked for a name nobody registered."""


class _Declared:
    """A placeholder for an entry known by its import path, ``"module:attribute"``."""

    def __init__(self, target: str) -> None:
        self.module, _, self.attribute = target.partition(":")

    def is_target(self, obj: object) -> bool:
        return (
            getattr(obj, "__module__", None) == self.module
            and getattr(obj, "__qualname__", None) == self.attribute
        )


class Registry(Generic[T]):
    """Maps names (and aliases) to registered objects plus free-form metadata.

    Args:
        kind: what the entries are, for error messages ("policy loss").
        config_key: the config key that selects an entry, named in error messages.
    """

    def __init__(self, kind: str, config_key: str | None = None) -> None:
        self.kind = kind
        self.config_key = config_key
        self._entries: dict[str, T] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._aliases: dict[str, str] = {}

    def register(
        self, name: str, *, aliases: tuple[str, ...] = (), **info: Any
    ) -> Callable[[T], T]:
        """Decorator registering an object under ``name`` (and ``aliases``).

        Keyword arguments are stored as metadata, readable with :meth:`info`.
        Registering a name twice is an error.
        """

        def decorator(obj: T) -> T:
            self.add(name, obj, aliases=aliases, **info)
            return obj

        return decorator

    def add(
        self,
        name: str,
        obj: T,
        *,
        aliases: tuple[str, ...] = (),
        replace: bool = False,
        **info: Any,
    ) -> None:
        """Register ``obj`` under ``name`` without a decorator; ``replace`` lets it take
        the place of what ``name`` (or an alias) held, else that is an error."""
        declared = self._entries.get(name)
        if isinstance(declared, _Declared) and declared.is_target(obj):
            self._entries[name] = obj  # the declared module is being imported
            self._info[name] = {**self._info[name], **info}
            return
        for key in (name, *aliases):
            if replace:
                self._entries.pop(key, None)
                self._aliases.pop(key, None)
            elif key in self._entries or key in self._aliases:
                raise ValueError(f"{self.kind} {key!r} is already registered")
        self._entries[name] = obj
        self._info[name] = dict(info)
        for alias in aliases:
            self._aliases[alias] = name

    def declare(
        self, name: str, target: str, *, aliases: tuple[str, ...] = (), **info: Any
    ) -> None:
        """Know ``name`` now and import its object, ``target`` = ``"module:attribute"``,
        on the first `get`; that module registers the object under ``name`` itself."""
        self.add(name, _Declared(target), aliases=aliases, **info)  # type: ignore[arg-type]

    def canonical(self, name: str) -> str:
        """The registered name behind ``name`` (resolving aliases); raises if unknown."""
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        raise UnknownNameError(self.unknown_message(name))

    def get(self, name: str) -> T:
        """The object registered under ``name`` or one of its aliases."""
        name = self.canonical(name)
        entry = self._entries[name]
        if isinstance(entry, _Declared):
            importlib.import_module(entry.module)
            entry = self._entries[name]
            if isinstance(entry, _Declared):
                raise ImportError(
                    f"{entry.module} did not register the {self.kind} {name!r} "
                    f"({entry.module}:{entry.attribute} must be decorated with register({name!r}))"
                )
        return entry

    def info(self, name: str) -> dict[str, Any]:
        """Metadata given at registration (a copy)."""
        return dict(self._info[self.canonical(name)])

    def names(self) -> list[str]:
        """Registered names, without aliases, in registration order."""
        return list(self._entries)

    def copy(self) -> Registry[T]:
        """A registry of the same entries that can change without changing this one."""
        other: Registry[T] = Registry(self.kind, self.config_key)
        other._entries, other._info = dict(self._entries), dict(self._info)
        other._aliases = dict(self._aliases)
        return other

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"

    def unknown_message(self, name: str, config_key: str | None = None) -> str:
        """What to say about an unknown ``name``: did-you-mean, valid names, the key."""
        known = sorted([*self._entries, *self._aliases])
        close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        key = config_key or self.config_key
        where = f" Set {key} to one of them." if key else ""
        return (
            f"unknown {self.kind} {name!r}.{hint} Valid names: {', '.join(known) or '(none)'}."
            f"{where}"
        )
