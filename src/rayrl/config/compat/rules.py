"""The rule kinds for verl keys outside rayrl's schema, and the walk that applies them.

A verl key reaches a rayrl config in one of four ways:

- under its own name, as a key of the schema (no rule);
- `Moved`: another spelling of a schema key (verl 0.9.1's `reward.*` section beside the
  older `reward_model.*`, names verl deprecated, ...): the value moves to the schema
  key, and values that mean "not set" in verl (its `null` defaults) are dropped;
- `Inert`: accepted and dropped, with one warning that says why it has no effect;
- `Only`: accepted and dropped for the values that ask for nothing rayrl does not do
  (the feature off, or rayrl's own behaviour), refused with a `ConfigError` naming the
  missing feature for any other value.

A rule's key is a dotted pattern in which `*` stands for one segment
(`actor_rollout_ref.*.profiler`); a rule on a group covers every key under it. Where
several patterns match, the longest wins (then the one with fewer `*`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rayrl.config.errors import ConfigError


@dataclass(frozen=True)
class Inert:
    """Any value is accepted and has no effect; `reason` says why."""

    reason: str


@dataclass(frozen=True)
class Only:
    """Values in `accepted` are dropped (with `note` as a warning when given: why they
    change nothing); any other value is refused: `feature` is what rayrl lacks, `hint`
    what to do instead."""

    accepted: tuple[object, ...]
    feature: str
    note: str | None = None
    hint: str = ""


@dataclass(frozen=True)
class Moved:
    """The value moves to the schema key `target` (a rule on a group moves the keys
    under it); values in `unset` mean "not set" and are dropped. `note`, when given,
    is printed after "KEY=VALUE sets TARGET: " (a deprecation, or what changes)."""

    target: str
    unset: tuple[object, ...] = ()
    note: str = ""


Rule = Inert | Only | Moved


def _split(pattern: str) -> tuple[str, ...]:
    return tuple(pattern.split("."))


class RuleTable:
    """Rules by dotted pattern, and the schema's own paths (which no rule overrides,
    except a `Moved` rule whose target is the key itself)."""

    def __init__(
        self, rules: dict[str, Rule], schema_paths: Iterable[str], dict_leaves: Iterable[str] = ()
    ) -> None:
        self.rules = [(_split(p), r) for p, r in rules.items()]
        self.schema = set(schema_paths)
        self.dict_leaves = set(dict_leaves)

    def match(self, path: str, moved: bool) -> tuple[str, Rule] | None:
        """The best rule of the kind asked for (`Moved` or not) that covers `path`:
        (the part of `path` it matched, the rule)."""
        parts = _split(path)
        best, best_key = None, None
        for pattern, rule in self.rules:
            if isinstance(rule, Moved) != moved or len(pattern) > len(parts):
                continue
            if all(p in ("*", q) for p, q in zip(pattern, parts, strict=False)):
                key = (len(pattern), -pattern.count("*"))
                if best_key is None or key > best_key:
                    best, best_key = (".".join(parts[: len(pattern)]), rule), key
        return best

    def in_schema(self, path: str) -> bool:
        """Whether `path` is a schema key, or lies inside a dict-valued schema key."""
        parts = _split(path)
        return any(".".join(parts[:i]) in self.dict_leaves for i in range(1, len(parts))) or (
            path in self.schema
        )


def flatten(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of every leaf of `data` (an empty dict is a leaf; the keys
    of a dict-valued schema key are leaves too, and `_set` nests them again)."""
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.extend(flatten(value, path + "."))
        else:
            out.append((path, value))
    return out


def _shown(value: Any) -> str:
    return "{...}" if isinstance(value, dict) and value else repr(value)


def _move(path: str, value: Any, table: RuleTable) -> str | None:
    """Where a key lands after its `Moved` rules (None: a value that means unset)."""
    for _ in range(8):  # a move chain is short; the bound only guards a cycle
        found = table.match(path, moved=True)
        if found is None:
            return path
        matched, rule = found
        assert isinstance(rule, Moved)
        if matched == path and _accepted(value, rule.unset):
            return None
        if rule.target == matched:
            return path
        path = rule.target + path[len(matched) :]
    raise AssertionError(f"moved keys loop at {path}")


def apply_rules(
    data: dict[str, Any], table: RuleTable, warn: Callable[[str], None]
) -> dict[str, Any]:
    """`data` (one source's nested dict) with the rules applied: moved keys at their
    schema names, inert keys dropped with one warning per rule and group, keys without
    a rule kept (unknown ones are refused later, with a suggestion). Raises ConfigError
    for a refused value and for two spellings of one key with different values."""
    out: dict[str, Any] = {}
    origin: dict[str, tuple[str, Any]] = {}
    dropped: dict[tuple[int, str], tuple[str, list[str]]] = {}
    for path, value in flatten(data):
        target = _move(path, value, table)
        if target is None:
            continue
        if target != path:
            _note_move(path, target, value, table, warn)
        if not table.in_schema(target):
            found = table.match(target, moved=False)
            if found is not None:
                _drop(path, value, found, dropped)  # named as the user wrote it
                continue
        if target in origin and origin[target][1] != value:
            first, first_value = origin[target]
            raise ConfigError(
                f"{first}={first_value!r} and {path}={value!r} set the same key ({target}); "
                "give one of them"
            )
        origin[target] = (path, value)
        _set(out, target, value)
    for reason, keys in dropped.values():
        warn(_inert_message(keys, reason))
    return out


def _note_move(
    path: str, target: str, value: Any, table: RuleTable, warn: Callable[[str], None]
) -> None:
    found = table.match(path, moved=True)
    if found is not None and isinstance(found[1], Moved) and found[1].note:
        warn(f"{path}={_shown(value)} sets {target}: {found[1].note}")


def _drop(
    path: str,
    value: Any,
    found: tuple[str, Rule],
    dropped: dict[tuple[int, str], tuple[str, list[str]]],
) -> None:
    matched, rule = found
    if isinstance(rule, Only):
        if not _accepted(value, rule.accepted):
            hint = f"; {rule.hint}" if rule.hint else ""
            raise ConfigError(
                f"{path}={_shown(value)}: rayrl does not support {rule.feature}{hint}"
            )
        if rule.note is None:
            return
        reason = rule.note
    else:
        assert isinstance(rule, Inert)
        reason = rule.reason
    entry = dropped.setdefault((id(rule), matched), (reason, []))
    entry[1].append(f"{path}={_shown(value)}")


def _accepted(value: Any, accepted: tuple[object, ...]) -> bool:
    return any(value == a and type(value) is type(a) for a in accepted)


def _inert_message(keys: list[str], reason: str) -> str:
    shown = ", ".join(keys[:6])
    more = f" and {len(keys) - 6} more" if len(keys) > 6 else ""
    verb = "has" if len(keys) == 1 else "have"
    return f"{shown}{more} {verb} no effect in rayrl: {reason}"


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *groups, leaf = path.split(".")
    for group in groups:
        node = tree.setdefault(group, {})
        if not isinstance(node, dict):  # a group given as a value too: let the schema refuse it
            return
        tree = node
    tree[leaf] = value
