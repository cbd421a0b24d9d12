"""A tool: a named function the model may call, with an OpenAI-style JSON schema.

Subclass `Tool` and implement `execute(arguments, state)`; the class attributes give
the default name, description and ``parameters`` schema, which a config may override
(verl's tool YAML passes a whole ``tool_schema``). A tool may keep per-episode state:
`create` makes it from the row's ``tools_kwargs[name]["create_kwargs"]`` before the
episode's first call of the tool, `reward` turns it into a reward at the end (verl's
``calc_reward``) and `release` frees it. `FunctionTool` wraps a plain function.

`execute` runs on a worker thread of the `ToolRunner`, under the tool's ``timeout_s``
(None: the runner's default). It may return a `ToolResult`, a string, or anything
else; `as_result` turns every return value into text, so a tool that returns garbage
still gives the model an observation. A value it can show only as its ``str()`` (a
number, an arbitrary object: `not_text` names its type) is counted as the call's error
(`rayrl.envs.toolbox`), while the model still sees that text.

A tool may also show the model images (a vision-language policy): a `ToolResult` with
``images`` (PIL images), or an object with ``text`` and ``image`` (verl's
``ToolResponse(text=..., image=[...])``). The observation is then the images and the
text, as content parts (`observation_content`), which the multi-turn rollout feeds
through the model's image processor (`rayrl.rollout.agent.format`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rayrl.envs.arguments import EMPTY_PARAMETERS, schema_from_function

__all__ = [
    "FunctionTool",
    "Tool",
    "ToolResult",
    "as_result",
    "function_tool",
    "not_text",
    "observation_content",
    "split_schema",
]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")


@dataclass
class ToolResult:
    """What a tool call returns: the observation text, and optionally a reward, metrics
    and images to show the model (PIL images, before the text)."""

    text: str
    reward: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)


class Tool:
    """Base class of tools; see the module docstring.

    Args:
        config: tool settings (verl's ``config`` block); ``timeout_s`` is read here.
        schema: an OpenAI tool schema (``{"type": "function", "function": {...}}`` or
            the bare function object) that replaces the class's name, description and
            parameters.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = EMPTY_PARAMETERS
    timeout_s: float | None = None

    def __init__(
        self, config: Mapping[str, Any] | None = None, schema: Mapping[str, Any] | None = None
    ) -> None:
        self.config = dict(config or {})
        name, description, parameters = split_schema(schema) if schema else (None, None, None)
        self.name = name or type(self).name
        self.description = description if description is not None else type(self).description
        parameters = parameters or type(self).parameters
        # not a mapping: kept as it is, for `rayrl.envs.tool_schema` to say so by name
        self.parameters = dict(parameters) if isinstance(parameters, Mapping) else parameters
        if self.config.get("timeout_s") is not None:
            self.timeout_s = float(self.config["timeout_s"])
        if not self.name or not _NAME.match(self.name):
            raise ValueError(
                f"{type(self).__name__}: tool name {self.name!r} is not a valid name (letters, "
                "digits, '_', '.', '-'; up to 64); set the class attribute `name` or the "
                "schema's function.name."
            )

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI-style tool schema the chat template shows the model."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def create(self, create_kwargs: Mapping[str, Any]) -> Any:
        """Per-episode state, made before the episode's first call (default: the kwargs)."""
        return dict(create_kwargs)

    def execute(self, arguments: dict[str, Any], state: Any) -> ToolResult | str | Any:
        """Run one call with checked ``arguments``; return the observation."""
        raise NotImplementedError(f"tool {self.name!r} ({type(self).__name__}) has no execute()")

    def reward(self, state: Any) -> float | None:
        """A reward from the episode's state once it ends (None: no reward)."""
        return None

    def release(self, state: Any) -> None:
        """Free the episode's state."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionTool(Tool):
    """A tool that calls ``fn(**arguments)``; the schema is derived from its signature
    unless ``parameters`` is given. The description defaults to the docstring's first
    paragraph."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        parameters: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        doc = (fn.__doc__ or "").strip().split("\n\n")[0]
        schema = {
            "name": name or fn.__name__,
            "description": description if description is not None else " ".join(doc.split()),
            "parameters": dict(parameters) if parameters else schema_from_function(fn),
        }
        super().__init__({"timeout_s": timeout_s}, schema)
        self.fn = fn

    def execute(self, arguments: dict[str, Any], state: Any) -> Any:
        return self.fn(**arguments)


def function_tool(
    fn: Callable[..., Any] | None = None, **options: Any
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """Make a `FunctionTool`: ``function_tool(fn)`` or ``@function_tool(name="x")``."""
    if fn is not None:
        return FunctionTool(fn, **options)
    return lambda f: FunctionTool(f, **options)


def split_schema(schema: Mapping[str, Any]) -> tuple[str | None, str | None, dict | None]:
    """(name, description, parameters) of an OpenAI tool schema or its function object."""
    function = schema.get("function", schema) if isinstance(schema, Mapping) else None
    if not isinstance(function, Mapping):
        raise ValueError(
            f"tool schema {schema!r} is not an OpenAI tool schema; expected "
            '{"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}.'
        )
    parameters = function.get("parameters")
    return function.get("name"), function.get("description"), parameters


def as_result(value: Any) -> ToolResult:
    """Any tool return value as a `ToolResult` with valid UTF-8 text.

    A `ToolResult` stays (its text cleaned); ``(text, reward)`` pairs and verl's
    ``(response, reward, metrics)`` triples are unpacked; objects with a ``text``
    attribute (verl's ``ToolResponse``) give that text; bytes are decoded; dicts and
    lists become JSON; None becomes an empty string; anything else its ``str``.
    """
    if isinstance(value, ToolResult):
        text, reward = _text(value.text), _reward(value.reward)
        return ToolResult(text, reward, dict(value.metrics or {}), list(value.images or []))
    if isinstance(value, tuple) and value and len(value) <= 3:
        reward = _reward(value[1]) if len(value) > 1 else None
        metrics = value[2] if len(value) > 2 and isinstance(value[2], dict) else {}
        first = as_result(value[0])
        return ToolResult(first.text, reward, dict(metrics), first.images)
    return ToolResult(_text(value), images=_images(value))


def observation_content(result: ToolResult) -> str | list[dict[str, Any]]:
    """What the model is shown of a result: its text, or with images the content parts
    ``{"type": "image", "image": ...}`` (each image) then ``{"type": "text", ...}``."""
    if not result.images:
        return result.text
    parts: list[dict[str, Any]] = [{"type": "image", "image": i} for i in result.images]
    return [*parts, {"type": "text", "text": result.text}]


def _images(value: Any) -> list[Any]:
    """The images of an object with ``text`` and ``image`` (verl's ``ToolResponse``)."""
    if isinstance(value, str | bytes | bytearray | dict | list | type) or value is None:
        return []
    image = getattr(value, "image", None)
    if image is None or not hasattr(value, "text"):
        return []
    return list(image) if isinstance(image, list | tuple) else [image]


def not_text(value: Any) -> str | None:
    """The type of a return value that `as_result` can show only as its ``str()`` (not
    text, bytes, JSON data, None, a `ToolResult`, a ``(text, reward[, metrics])`` tuple
    or an object with a ``text``, each of those by its text), or None when it is one of
    those: a tool's contract is text, and anything else is a bug in the tool."""
    if isinstance(value, ToolResult):
        return not_text(value.text)
    if isinstance(value, tuple) and value and len(value) <= 3:
        return not_text(value[0])
    if value is None or isinstance(value, str | bytes | bytearray | dict | list):
        return None
    if hasattr(value, "text") and not isinstance(value, type):
        return not_text(value.text)
    return type(value).__name__


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        text = value
    elif isinstance(value, bytes | bytearray):
        text = bytes(value).decode("utf-8", errors="replace")
    elif isinstance(value, dict | list):
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = str(value)
    elif hasattr(value, "text") and not isinstance(value, type):
        return _text(value.text)
    else:
        text = str(value)
    return text.encode("utf-8", errors="replace").decode("utf-8")  # lone surrogates


def _reward(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None
