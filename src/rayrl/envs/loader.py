"""Loading user classes and tools named in a config.

`load_object(spec)` imports what a spec names, through `rayrl.usercode` (the one
loader of user code), raising LoadError:

- ``"package.module:Name"`` or ``"package.module.Name"`` (verl's ``class_name``);
- ``"/path/to/file.py:Name"`` or a ``(path, name)`` pair (the file imported as a
  module of its own).

`build_tool(spec)` makes one `Tool` from a config entry:

- a registered tool name (``"calculator"``) or a spec of a `Tool` subclass, a function
  (wrapped in a `FunctionTool`) or a ready `Tool` object;
- a mapping ``{"name" | "class_name": ..., "config": {...}, "tool_schema": {...}}``:
  verl's tool YAML entry (``rayrl.envs.verl`` maps verl's own tool classes to the
  built-ins and adapts classes written against verl's ``BaseTool``).

Every tool built here has its ``parameters`` schema checked (`rayrl.envs.tool_schema`):
one that is not valid JSON Schema is refused with a LoadError naming the tool.

`load_function_tools(path)` imports a Python file (verl's ``function_tool_path``) and
returns the tools it defines at module level: the objects ``@function_tool`` made.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rayrl import usercode
from rayrl.envs.errors import LoadError
from rayrl.envs.registry import TOOLS
from rayrl.envs.tool import FunctionTool, Tool
from rayrl.envs.tool_schema import check_tool_schema

__all__ = ["LoadError", "build_tool", "build_tools", "load_function_tools", "load_object"]


def load_object(spec: str | tuple[str, str] | list, kind: str = "object") -> Any:
    """The object a spec names (`rayrl.usercode.load_object`); LoadError says what to fix."""
    return usercode.load_object(spec, kind, error=LoadError)


def load_function_tools(path: str | Path) -> list[Tool]:
    """The `Tool` objects a Python file defines at module level (see the module docstring)."""
    module = usercode.import_file(path, "function_tool_path", error=LoadError)
    tools = [value for value in vars(module).values() if isinstance(value, Tool)]
    if not tools:
        raise LoadError(
            f"function_tool_path: {path} defines no tools; decorate functions with "
            "@rayrl.envs.function_tool (a module-level FunctionTool each)."
        )
    return tools


def build_tool(spec: Any) -> Tool:
    """One tool from a config entry (see the module docstring), its schema checked."""
    tool = _build(spec)
    check_tool_schema(tool.name, tool.parameters)
    return tool


def _build(spec: Any) -> Tool:
    if isinstance(spec, Tool):
        return spec
    if isinstance(spec, Mapping):
        return _from_mapping(spec)
    if isinstance(spec, str) and (spec in TOOLS or not any(c in spec for c in ".:/")):
        return TOOLS.get(spec)()  # an unknown bare name: a did-you-mean error
    return instantiate_tool(load_object(spec, "tool"), {}, None, where=str(spec))


def build_tools(specs: Iterable[Any]) -> list[Tool]:
    """Tools from a list of config entries; two tools with one name is an error."""
    tools = [build_tool(spec) for spec in specs]
    seen: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in seen:
            raise LoadError(
                f"two tools are named {tool.name!r} ({seen[tool.name]!r}, {tool!r}); tool names "
                "must be unique: rename one in its tool_schema.function.name."
            )
        seen[tool.name] = tool
    return tools


def _from_mapping(entry: Mapping[str, Any]) -> Tool:
    from rayrl.envs import verl

    target = entry.get("class_name") or entry.get("name") or entry.get("class")
    if not target:
        raise LoadError(
            f"tool entry {dict(entry)!r} names no tool: give 'name' (a registered tool) or "
            "'class_name' (a class by dotted path)."
        )
    config = dict(entry.get("config") or {})
    schema = entry.get("tool_schema") or entry.get("schema")
    verl.check_tool_type(config, target)
    target, config = verl.builtin_tool(target, config)
    if target in TOOLS or not any(c in str(target) for c in ".:/"):
        return TOOLS.get(target)(config=config, schema=schema)
    return instantiate_tool(load_object(target, "tool"), config, schema, where=str(target))


def instantiate_tool(obj: Any, config: dict, schema: Any, *, where: str) -> Tool:
    """A `Tool` from a loaded class, function or object (verl ``BaseTool`` adapted)."""
    from rayrl.envs import verl

    if isinstance(obj, Tool):
        return obj
    if inspect.isclass(obj) and issubclass(obj, Tool):
        return obj(config=config, schema=schema)
    if inspect.isclass(obj) and verl.is_verl_tool_class(obj):
        return verl.VerlTool.of(obj, config, schema)
    if callable(obj) and not inspect.isclass(obj):
        return FunctionTool(obj, **_function_options(config, schema))
    raise LoadError(
        f"tool {where}: {obj!r} is not a rayrl.envs.Tool subclass, a function, or a class "
        "with verl's BaseTool methods (async create/execute/release)."
    )


def _function_options(config: dict, schema: Any) -> dict[str, Any]:
    from rayrl.envs.tool import split_schema

    options: dict[str, Any] = {"timeout_s": config.get("timeout_s")}
    if schema:
        name, description, parameters = split_schema(schema)
        options.update(name=name, description=description, parameters=parameters)
    return options
