"""Checking a tool call's arguments against the tool's JSON schema, and deriving schemas.

Models get arguments wrong: a missing required field, a string where a number belongs,
a field the tool does not take. `check_arguments` finds the first such mistake and
says it in words the model can act on (the text becomes the tool's error observation).
It covers the part of JSON Schema that OpenAI-style tool schemas use: an object's
``properties``, ``required`` and ``additionalProperties``, the basic ``type`` names (or
a list of them), ``enum``, and ``items`` of arrays (also verl's misspelt ``item``).

`schema_from_function` builds a tool's ``parameters`` schema from a Python function's
signature: annotated ``int``, ``float``, ``str``, ``bool``, ``list``, ``dict`` map to the
JSON types; parameters without a default are required.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["EMPTY_PARAMETERS", "check_arguments", "schema_from_function"]

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "required": []}

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}
_PYTHON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
_PYTHON_TYPES.update({list: "array", dict: "object", type(None): "null"})


def check_arguments(arguments: Any, parameters: Mapping[str, Any] | None) -> str | None:
    """The first way ``arguments`` break the ``parameters`` schema, or None if they fit.

    Args:
        arguments: the decoded JSON arguments of a call (should be an object).
        parameters: the tool's ``parameters`` JSON schema (None: no arguments taken).
    """
    parameters = parameters or EMPTY_PARAMETERS
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {_json_type(arguments)}"
    properties = parameters.get("properties") or {}
    missing = [k for k in parameters.get("required") or () if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}; the tool takes {sorted(properties)}"
    extra = sorted(k for k in arguments if k not in properties)
    if extra and parameters.get("additionalProperties", False) is not True:
        return f"unknown argument(s) {extra}; the tool takes {sorted(properties)}"
    for name, value in arguments.items():
        problem = _check_value(value, properties.get(name) or {}, name)
        if problem:
            return problem
    return None


def _check_value(value: Any, schema: Mapping[str, Any], where: str) -> str | None:
    wanted = schema.get("type")
    if wanted is not None:
        names = [wanted] if isinstance(wanted, str) else list(wanted)
        known = [n for n in names if n in _JSON_TYPES]
        if known and not any(_JSON_TYPES[n](value) for n in known):
            return f"argument {where!r} must be {' or '.join(known)}, got {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"argument {where!r} must be one of {schema['enum']}, got {value!r}"
    items = schema.get("items") or schema.get("item")
    if isinstance(value, list) and isinstance(items, Mapping):
        for i, item in enumerate(value):
            problem = _check_value(item, items, f"{where}[{i}]")
            if problem:
                return problem
    return None


def _json_type(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


def schema_from_function(fn: Callable[..., Any]) -> dict[str, Any]:
    """A ``parameters`` schema from ``fn``'s signature (annotations and defaults).

    Raises:
        TypeError: ``fn`` takes ``*args`` or ``**kwargs`` (a schema cannot name them).
    """
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references: fall back to no types
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(
                f"tool function {fn.__name__}: *args/**kwargs ({name}) cannot be described in "
                "a JSON schema; name every argument, or pass parameters= explicitly."
            )
        properties[name] = _type_schema(hints.get(name))
        if param.default is param.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def _type_schema(hint: Any) -> dict[str, Any]:
    if hint in _PYTHON_TYPES:
        return {"type": _PYTHON_TYPES[hint]}
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        names = [_type_schema(a).get("type") for a in typing.get_args(hint)]
        if all(isinstance(n, str) for n in names):
            return {"type": names}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    return {}
