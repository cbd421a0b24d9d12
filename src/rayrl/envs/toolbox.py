"""The tools of a rollout and one episode's use of them: calls in, observations out.

A `Toolbox` holds the tools (by name), the `ToolRunner` and the limits shared by every
episode. A `ToolSession` is one episode's view: the row's ``tools_kwargs`` (verl's
``{tool: {"create_kwargs": {...}}}``), the per-episode state each tool made, and the
record of every call. `ToolSession.run` takes the parsed calls of one assistant turn
and returns one observation per call, in order, running the valid ones concurrently:

- a malformed call, an unknown tool or arguments that break the schema give an error
  observation at once (the tool never runs);
- a tool that raises gives an error observation with the exception's type and text;
- a tool that returns something that is not text (a number, an object: see
  `rayrl.envs.tool.not_text`) is counted as an error, while the model sees its
  ``str()`` as the observation;
- a tool that overruns its timeout gives a timeout observation (the call is abandoned,
  see `rayrl.envs.runner`);
- calls past ``max_parallel_calls`` in one turn are not run and say so.

Every call is recorded as a `ToolEvent`; nothing here raises because of what a model
or a tool did.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rayrl.envs.arguments import check_arguments
from rayrl.envs.parsers import ToolCall
from rayrl.envs.runner import CallOutcome, ToolRunner
from rayrl.envs.tool import Tool, ToolResult, as_result, not_text, observation_content

__all__ = ["STATUSES", "ToolEvent", "ToolSession", "Toolbox"]

OK, ERROR, TIMEOUT, INVALID, MALFORMED, UNKNOWN, SKIPPED, CLOSE_ERROR = (
    "ok",
    "error",
    "timeout",
    "invalid_arguments",
    "malformed",
    "unknown_tool",
    "skipped",
    "close_error",  # a tool's reward() or release() raised at the episode's end
)
STATUSES = (OK, ERROR, TIMEOUT, INVALID, MALFORMED, UNKNOWN, SKIPPED, CLOSE_ERROR)


@dataclass
class ToolEvent:
    """One call and how it ended (``status`` is one of `STATUSES`)."""

    tool: str | None
    status: str
    latency_s: float = 0.0
    message: str = ""
    reward: float | None = None


@dataclass
class Toolbox:
    """Tools by name, the runner that executes them, and the per-turn call limit."""

    tools: Mapping[str, Tool]
    runner: ToolRunner = field(default_factory=ToolRunner)
    max_parallel_calls: int = 1

    def __post_init__(self) -> None:
        self.tools = dict(self.tools)
        if self.max_parallel_calls < 1:
            raise ValueError(
                f"max_parallel_calls={self.max_parallel_calls} must be >= 1 "
                "(actor_rollout_ref.rollout.multi_turn.max_parallel_calls)."
            )

    @classmethod
    def of(cls, tools: Iterable[Tool], **options: Any) -> Toolbox:
        """A toolbox of ``tools``; two tools with one name is an error."""
        by_name: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in by_name:
                raise ValueError(
                    f"two tools are named {tool.name!r} ({by_name[tool.name]!r} and {tool!r}); "
                    "give each a unique name in its schema."
                )
            by_name[tool.name] = tool
        return cls(by_name, **options)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI schemas of every tool (what the prompt's chat template shows)."""
        return [tool.schema for tool in self.tools.values()]

    def session(
        self, tools_kwargs: Mapping[str, Any] | None = None, only: Sequence[str] | None = None
    ) -> ToolSession:
        """A new episode's session; ``only`` limits it to some tools (verl's
        ``extra_info.tool_selection``)."""
        tools = self.tools if only is None else {n: self.tools[n] for n in only if n in self.tools}
        return ToolSession(self, dict(tools), dict(tools_kwargs or {}))


class ToolSession:
    """One episode's calls: per-episode tool state, events, rewards (module docstring)."""

    def __init__(self, box: Toolbox, tools: dict[str, Tool], tools_kwargs: dict[str, Any]) -> None:
        self.box, self.tools, self.tools_kwargs = box, tools, tools_kwargs
        self.states: dict[str, Any] = {}
        self.events: list[ToolEvent] = []
        self._lock = threading.Lock()
        self._create_lock = threading.Lock()

    def run(self, calls: Sequence[ToolCall]) -> list[tuple[str, str | list[dict[str, Any]]]]:
        """Run one turn's calls; ``(tool name, observation)`` for each, in order: its
        text, or content parts when it shows images (`observation_content`)."""
        limit = self.box.max_parallel_calls
        futures: dict[int, Any] = {}
        results: dict[int, tuple[str | list[dict[str, Any]], ToolEvent]] = {}
        for i, call in enumerate(calls):
            if i >= limit:
                text = f"Error: not run; at most {limit} tool call(s) per turn."
                results[i] = (text, ToolEvent(call.name, SKIPPED, message=text))
                continue
            problem = self._problem(call)
            if problem is not None:
                results[i] = problem
                continue
            # `_problem` found none: the call names a tool, with an object of arguments
            assert call.name is not None and call.arguments is not None
            tool = self.tools[call.name]
            futures[i] = self.box.runner.submit(
                functools.partial(self._execute, tool, call.arguments),
                tool.timeout_s,
                name=tool.name,
            )
        for i, future in futures.items():
            results[i] = _observation(calls[i].name, future.result(), self._timeout(calls[i].name))
        with self._lock:
            self.events.extend(results[i][1] for i in range(len(calls)))
        return [(calls[i].name or "", results[i][0]) for i in range(len(calls))]

    def _problem(self, call: ToolCall) -> tuple[str, ToolEvent] | None:
        if call.error is not None:
            status = INVALID if call.name in self.tools else MALFORMED
            text = f"Error: {call.error}."
            return text, ToolEvent(call.name, status, message=text)
        if call.name not in self.tools:
            known = ", ".join(sorted(self.tools)) or "none"
            text = f"Error: unknown tool {call.name!r}; the tools are: {known}."
            return text, ToolEvent(call.name, UNKNOWN, message=text)
        problem = check_arguments(call.arguments, self.tools[call.name].parameters)
        if problem is not None:
            text = f"Error: {problem}."
            return text, ToolEvent(call.name, INVALID, message=text)
        return None

    def _execute(self, tool: Tool, arguments: dict[str, Any]) -> tuple[ToolResult, str | None]:
        """The call's result, and the type it returned when that was not text."""
        with self._create_lock:  # the state is made once per episode, before any call
            if tool.name not in self.states:
                kwargs = self.tools_kwargs.get(tool.name) or {}
                self.states[tool.name] = tool.create(dict(kwargs.get("create_kwargs") or {}))
        value = tool.execute(arguments, self.states[tool.name])
        return as_result(value), not_text(value)

    def _timeout(self, name: str | None) -> float:
        tool = self.tools.get(name or "")
        timeout = None if tool is None else tool.timeout_s
        return self.box.runner.default_timeout_s if timeout is None else timeout

    def close(self) -> dict[str, float]:
        """End the episode: each used tool's reward (those that give one), then release.

        A tool whose ``reward`` or ``release`` raises is skipped (a ``close_error`` event).
        """
        rewards: dict[str, float] = {}
        for name, state in list(self.states.items()):
            tool = self.tools[name]
            for step in ("reward", "release"):
                try:
                    value = getattr(tool, step)(state)
                except Exception as err:
                    message = f"{step}: {_describe(err)}"
                    self.events.append(ToolEvent(name, CLOSE_ERROR, message=message))
                    continue
                if step == "reward" and value is not None:
                    rewards[name] = float(value)
        self.states.clear()
        return rewards


def _observation(
    name: str | None, outcome: CallOutcome, timeout: float
) -> tuple[str | list[dict[str, Any]], ToolEvent]:
    if outcome.timed_out:
        text = f"Error: tool {name!r} did not finish within {timeout:g} s."
        return text, ToolEvent(name, TIMEOUT, outcome.latency_s, text)
    if outcome.error is not None:
        text = f"Error: tool {name!r} failed: {_describe(outcome.error)}"
        return text, ToolEvent(name, ERROR, outcome.latency_s, text)
    result, returned = outcome.value
    if returned is not None:  # shown as its str(), counted as the tool's error
        message = f"tool {name!r} returned {returned}, not text; the model was shown its str()"
        return result.text, ToolEvent(name, ERROR, outcome.latency_s, message, result.reward)
    shown = observation_content(result)
    return shown, ToolEvent(name, OK, outcome.latency_s, reward=result.reward)


def _describe(err: BaseException) -> str:
    try:
        text = str(err)
    except Exception:
        text = ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
