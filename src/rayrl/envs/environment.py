"""Environments: what answers the model between its turns.

An `Environment` runs one episode (one sample of one prompt). `reset` gets the row the
episode comes from (`Episode`: its chat messages, ``extra_info``, ``tools_kwargs``);
then, after every assistant turn, `step(conversation, message)` gets the conversation
so far and the text of the model's last message and returns a `StepResult`: the
observation (messages to append, a ``tool`` or ``user`` turn), whether the episode is
done, and an optional reward. `close` ends the episode and may return final rewards.

Built in, by name (``ENVIRONMENTS``; verl's ``agent_name`` values are aliases):

- ``tools`` (``tool_agent``): `ToolEnvironment`: the model's tool calls, parsed in
  the configured format, run through the episode's `ToolSession`; one ``tool``
  message per call. A message without calls ends the episode, unless the rollout has
  interactions (verl's ``interaction_config_path``, `rayrl.envs.interaction`): then
  the episode's interaction answers it as the user, and ends the episode when it says so.
- ``single_turn`` (``single_turn_agent``): done after the first message.

A user's environment subclasses `Environment` and is named in the config by its
registered name, dotted path or file (`rayrl.envs.loader.load_object`). Its `step` runs
on a worker thread under a timeout; one that raises or hangs ends its episode (the
sample is kept, the event counted), never the rollout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rayrl.envs.interaction import EpisodeInteraction
from rayrl.envs.parsers import HermesParser, ToolCallParser
from rayrl.envs.registry import ENVIRONMENTS
from rayrl.envs.toolbox import Toolbox, ToolEvent, ToolSession

__all__ = [
    "Environment",
    "Episode",
    "SingleTurnEnvironment",
    "StepResult",
    "ToolEnvironment",
    "make_environment",
]


@dataclass
class Episode:
    """The dataset row an episode starts from (one sample of one prompt)."""

    sample_uid: str
    messages: list[dict[str, Any]]
    extra_info: dict[str, Any] = field(default_factory=dict)
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    data_source: str | None = None


@dataclass
class StepResult:
    """What the environment answers to one assistant message.

    Attributes:
        observation: messages to append before the model's next turn; a string is one
            ``user`` message. Empty with ``done=False`` is the same as done.
        done: True ends the episode (no observation is appended).
        reward: an optional reward for this turn (the sample's ``turn_scores``).
        assistant: the model's message as the trajectory records it (e.g. with its
            parsed ``tool_calls``); None records the plain text.
    """

    observation: list[dict[str, Any]] | str = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    assistant: dict[str, Any] | None = None

    def messages(self) -> list[dict[str, Any]]:
        """The observation as a list of chat messages."""
        if isinstance(self.observation, str):
            return [{"role": "user", "content": self.observation}]
        return list(self.observation)


class Environment:
    """Base class of environments; see the module docstring.

    Args:
        config: the environment's settings from the config.
        toolbox: the rollout's tools (environments that run no tools ignore it).
        parser: the tool-call parser of the configured format.
        interactions: the rollout's interactions by name (`rayrl.envs.interaction`;
            environments that simulate no user ignore them).
    """

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        toolbox: Toolbox | None = None,
        parser: ToolCallParser | None = None,
        interactions: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = dict(config or {})
        self.toolbox = toolbox if toolbox is not None else Toolbox({})
        self.parser = parser if parser is not None else HermesParser()
        self.interactions = dict(interactions or {})
        self.episode: Episode | None = None

    def reset(self, episode: Episode) -> None:
        """Start an episode from its row."""
        self.episode = episode

    def step(self, conversation: list[dict[str, Any]], message: str) -> StepResult:
        """The answer to the model's last ``message``; ``conversation`` is the episode so
        far, the prompt's messages first and this message (as plain text) last."""
        raise NotImplementedError(f"{type(self).__name__} has no step()")

    def close(self) -> dict[str, float]:
        """End the episode; rewards it gives at the end, by name (default: none)."""
        return {}

    @property
    def events(self) -> list[ToolEvent]:
        """Tool calls made in this episode so far."""
        return []


@ENVIRONMENTS.register("tools", aliases=("tool_agent",))
class ToolEnvironment(Environment):
    """Runs the model's tool calls; a message without calls ends the episode, or goes to
    the episode's interaction when the rollout has some (module docstring)."""

    session: ToolSession | None = None
    user: EpisodeInteraction | None = None

    def reset(self, episode: Episode) -> None:
        super().reset(episode)
        only = episode.extra_info.get("tool_selection") if episode.extra_info else None
        self.session = self.toolbox.session(episode.tools_kwargs, only=only)
        self.user = None
        if self.interactions:
            self.user = EpisodeInteraction.start(self.interactions, episode)

    def step(self, conversation: list[dict[str, Any]], message: str) -> StepResult:
        parsed = self.parser.parse(message)
        assistant: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if not parsed.calls:
            if self.user is None:
                return StepResult(done=True, assistant=assistant)
            done, text, score = self.user.answer([*conversation[:-1], assistant])
            return StepResult(text, done=done, reward=score, assistant=assistant)
        assistant["tool_calls"] = [call.as_message() for call in parsed.calls]
        results = self._session().run(parsed.calls)
        observation = [{"role": "tool", "name": name, "content": text} for name, text in results]
        return StepResult(observation, done=False, assistant=assistant)

    def close(self) -> dict[str, float]:
        try:
            return self._session().close()
        finally:
            if self.user is not None:
                self.user.finish()

    @property
    def events(self) -> list[ToolEvent]:
        return [] if self.session is None else list(self.session.events)

    def _session(self) -> ToolSession:
        if self.session is None:
            raise RuntimeError("ToolEnvironment: step() before reset(); call reset(episode) first.")
        return self.session


@ENVIRONMENTS.register("single_turn", aliases=("single_turn_agent",))
class SingleTurnEnvironment(Environment):
    """One assistant message, then done (verl's single-turn agent)."""

    def step(self, conversation: list[dict[str, Any]], message: str) -> StepResult:
        return StepResult(done=True)


def make_environment(
    spec: str | type[Environment],
    *,
    config: Mapping[str, Any] | None = None,
    toolbox: Toolbox | None = None,
    parser: ToolCallParser | None = None,
    interactions: Mapping[str, Any] | None = None,
) -> Environment:
    """An environment from a registered name, a dotted path / file spec, or a class."""
    from rayrl.envs.loader import load_object

    if isinstance(spec, str):
        is_path = any(c in spec for c in ".:/") and spec not in ENVIRONMENTS
        cls = load_object(spec, "environment") if is_path else ENVIRONMENTS.get(spec)
    else:
        cls = spec
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(
            f"environment {spec!r} is {cls!r}, not a subclass of rayrl.envs.Environment; "
            "subclass it and implement step(conversation, message)."
        )
    extra = {"interactions": interactions} if interactions else {}  # older subclasses' __init__
    return cls(config=config, toolbox=toolbox, parser=parser, **extra)
