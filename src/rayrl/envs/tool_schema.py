"""Checking a tool's ``parameters`` schema when the tool loads, not when the model calls it.

A tool's schema is shown to the model (the chat template's ``tools=``) and checks
every call's arguments (`rayrl.envs.arguments`). One that is not valid JSON Schema
(verl's ``tool_schema.function.parameters`` with a ``type`` that is no JSON type,
``properties`` that are no object, a ``required`` name that is no property) would
fail or mislead every call of a run, so `schema_problem` finds the first such mistake
and `check_tool_schema` refuses the tool with it (`LoadError`, naming the tool),
before any worker starts.

The arguments of a call are a JSON object, so the top level must be an object schema.
Each property's schema (and nested object schemas, recursively) is checked the same
way; the rest of the schema (keywords such as ``enum``, ``minimum``, ``items``) is
checked against JSON Schema's own metaschema (the ``jsonschema`` package, which Ray
installs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rayrl.envs.errors import LoadError

__all__ = ["JSON_TYPES", "check_tool_schema", "schema_problem"]

JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")


def check_tool_schema(name: str, parameters: Any) -> None:
    """Raise LoadError naming tool ``name`` when ``parameters`` is not a valid schema."""
    problem = schema_problem(parameters)
    if problem is not None:
        raise LoadError(
            f"tool {name!r}: its tool_schema is not valid JSON Schema: {problem}; fix "
            "tool_schema.function.parameters (an object schema: type 'object', "
            "'properties' an object of property schemas, 'required' a list of their names)."
        )


def schema_problem(parameters: Any) -> str | None:
    """The first mistake in a tool's ``parameters`` schema, in words; None if it is valid."""
    if not isinstance(parameters, Mapping):
        return f"parameters is {type(parameters).__name__}, not an object schema"
    kind = parameters.get("type", "object")
    if kind != "object":
        problem = _type_problem(kind, "parameters")
        return problem or f"parameters.type={kind!r}: a call's arguments are an object"
    return _object_problem(parameters, "parameters") or _metaschema_problem(parameters)


def _object_problem(schema: Mapping[str, Any], where: str) -> str | None:
    """An object schema's ``properties`` (each checked in turn) and ``required``."""
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping):
        return f"{where}.properties is {type(properties).__name__}, not an object"
    for key, value in properties.items():
        problem = _property_problem(value, f"{where}.properties.{key}")
        if problem is not None:
            return problem
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{where}.required={required!r} is not a list of property names"
    missing = [r for r in required if r not in properties]
    if missing:
        return (
            f"{where}.required names {missing}, which {where}.properties does not have "
            f"(it has {sorted(properties)})"
        )
    return None


def _property_problem(schema: Any, where: str) -> str | None:
    if not isinstance(schema, Mapping):
        return f"{where} is {type(schema).__name__}, not a schema (an object)"
    if "type" in schema:
        problem = _type_problem(schema["type"], where)
        if problem is not None:
            return problem
    if schema.get("type") == "object" or "properties" in schema:
        return _object_problem(schema, where)
    items = schema.get("items")
    if isinstance(items, Mapping):
        return _property_problem(items, f"{where}.items")
    return None


def _type_problem(kind: Any, where: str) -> str | None:
    names = kind if isinstance(kind, list) else [kind]
    wrong = [n for n in names if n not in JSON_TYPES]
    if wrong or not names:
        return (
            f"{where}.type={kind!r} is not a JSON Schema type (one of {', '.join(JSON_TYPES)}, "
            "or a list of them)"
        )
    return None


def _metaschema_problem(parameters: Mapping[str, Any]) -> str | None:
    """What JSON Schema's metaschema finds wrong (the draft the schema's ``$schema``
    names, else 2020-12); None when the ``jsonschema`` package is not installed."""
    try:
        from jsonschema import exceptions, validators
    except ImportError:  # a Ray without it: the checks above still ran
        return None
    validator = validators.validator_for(parameters, default=validators.Draft202012Validator)
    error = exceptions.best_match(validator(validator.META_SCHEMA).iter_errors(parameters))
    if error is None:
        return None
    path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.path)
    return f"parameters{path}: {error.message}"
