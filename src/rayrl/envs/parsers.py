"""Tool-call parsers: find the tool calls in an assistant message, in the model's format.

A parser turns the text of one assistant turn into its content and its calls. A call
the model wrote badly (not JSON, no name, arguments that are not an object, a tag
never closed) is still returned, with ``error`` saying what is wrong, so that the
model gets an error observation instead of silence. Parsers register in
``TOOL_PARSERS`` under verl's ``multi_turn.format`` names (``hermes``, ``gpt-oss``; verl's
others, such as ``qwen3_coder``, ``glm`` or ``kimi``, are not here yet).

``hermes`` (Qwen2.5, Qwen3, Hermes and most open chat models): each call is
``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``; ``arguments`` may also be
a JSON string holding the object. ``qwen`` and ``qwen25`` are its aliases: the names
verl's SGLang rollout gave SGLang's Qwen 2.5 function-call parser, whose format this is.

``gpt-oss`` (OpenAI's gpt-oss models, verl's ``gpt-oss`` parser): the harmony format,
read with its special tokens: a call is a ``commentary`` message addressed
``to=functions.NAME`` whose JSON arguments end at ``<|call|>``; ``analysis`` messages
(reasoning) are dropped before parsing, and the content is the ``final`` channel's text.

A parser may name stop strings (`ToolCallParser.stop`): the rollout then ends an
assistant turn there as well as at EOS. Hermes models end a turn with EOS after their
calls (several calls in one turn stay possible), so ``hermes`` names none by default;
``HermesParser(stop_at_call_end=True)`` ends the turn at the first ``</tool_call>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from rayrl.envs.registry import TOOL_PARSERS

__all__ = [
    "GptOssParser",
    "HermesParser",
    "ParsedMessage",
    "ToolCall",
    "ToolCallParser",
    "make_parser",
]


@dataclass
class ToolCall:
    """One call found in a message; ``error`` is set when it cannot be run as written."""

    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None

    def as_message(self) -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` entry (for the trajectory)."""
        function = {"name": self.name or "", "arguments": self.arguments}
        if self.arguments is None:
            function["arguments"] = self.raw
        return {"type": "function", "function": function}


@dataclass
class ParsedMessage:
    """An assistant message split into its text content and its tool calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Base class: `parse` one assistant turn's text (``keeps_special_tokens``: the
    text it reads keeps the tokenizer's special tokens)."""

    stop: tuple[str, ...] = ()
    keeps_special_tokens: bool = False

    def parse(self, text: str) -> ParsedMessage:
        raise NotImplementedError


@TOOL_PARSERS.register("hermes", aliases=("qwen", "qwen25"))
class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` calls (see the module)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, stop_at_call_end: bool = False) -> None:
        self.stop = (self.end_tag,) if stop_at_call_end else ()
        self._closed = re.compile(
            re.escape(self.start_tag) + r"(.*?)" + re.escape(self.end_tag), re.S
        )

    def parse(self, text: str) -> ParsedMessage:
        calls = [self._call(body) for body in self._closed.findall(text)]
        content = self._closed.sub("", text)
        if self.start_tag in content:  # opened, never closed
            tail = content[content.index(self.start_tag) :]
            content = content[: content.index(self.start_tag)]
            calls.append(
                ToolCall(None, None, tail, f"the tool call was not closed with {self.end_tag}")
            )
        return ParsedMessage(content.strip(), calls)

    def _call(self, body: str) -> ToolCall:
        raw = body.strip()
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError as err:
            return ToolCall(None, None, raw, f"the tool call is not valid JSON ({err})")
        if not isinstance(payload, dict):
            return ToolCall(
                None,
                None,
                raw,
                'the tool call must be a JSON object {"name": ..., "arguments": {...}}',
            )
        name = payload.get("name")
        if not isinstance(name, str) or not name:
            return ToolCall(None, None, raw, 'the tool call has no "name" string')
        return _with_arguments(name, payload.get("arguments", payload.get("parameters", {})), raw)


def _with_arguments(name: str, arguments: Any, raw: str) -> ToolCall:
    """A call of ``name`` whose arguments are a JSON object (or a string holding one)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return ToolCall(name, None, raw, f'"arguments" is a string that is not JSON ({err})')
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(name, None, raw, '"arguments" must be a JSON object')
    return ToolCall(name, arguments, raw)


@TOOL_PARSERS.register("gpt-oss")
class GptOssParser(ToolCallParser):
    """gpt-oss's harmony format (see the module docstring)."""

    keeps_special_tokens = True
    _analysis = re.compile(
        r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>.*?(?:<\|end\|>|$)", re.S
    )
    _call = re.compile(
        r"(?:<\|start\|>assistant)?<\|channel\|>[^<]*?to=functions\.([^\s<]+)\s*"
        r"(?:<\|constrain\|>\s*json)?<\|message\|>(.*?)<\|call\|>",
        re.S,
    )
    _final = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)
    _markers = re.compile(r"<\|start\|>assistant|<\|channel\|>[^<]*<\|message\|>|<\|[a-z_]+\|>")

    def parse(self, text: str) -> ParsedMessage:
        text = self._analysis.sub("", text)  # reasoning may mention calls; none run
        calls = [
            _with_arguments(name, body, body.strip()) for name, body in self._call.findall(text)
        ]
        rest = self._call.sub("", text)
        final = self._final.findall(rest)
        content = "".join(final) if final else self._markers.sub("", rest)
        return ParsedMessage(content.strip(), calls)


def make_parser(name: str, **options: Any) -> ToolCallParser:
    """The parser registered under ``name`` (unknown names: a did-you-mean error)."""
    return TOOL_PARSERS.get(name)(**options)
