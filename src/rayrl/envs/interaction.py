"""Interactions: a simulated user that answers the model when it stops calling tools.

verl's ``actor_rollout_ref.rollout.multi_turn.interaction_config_path`` names a YAML
file with an ``interaction:`` list of ``{name, class_name, config}`` entries. In verl's
tool agent loop, an assistant message without tool calls goes to the episode's
interaction (the one ``extra_info.interaction_kwargs.name`` names), which answers with
``(should_terminate, text, score, metrics)``: the text is appended as a ``user`` turn
and the model goes on, unless the interaction ends the episode; the score is a turn
score. rayrl does the same in its tool environment (`rayrl.envs.environment`): an
episode's interaction is started at reset with the row's ``interaction_kwargs`` (an
instance id first), asked after every message without calls, and finalised at close.
``max_user_turns`` counts its answers as verl's loop does.

An interaction is an object with verl's ``BaseInteraction`` methods:
``start_interaction(instance_id, **kwargs)``, ``generate_response(instance_id,
messages, **kwargs)``, ``finalize_interaction(instance_id)``, each a plain function or
a coroutine (verl's are async; each coroutine runs on its own event loop in the
environment's worker thread). `Interaction` is rayrl's base class for them.

Built in: ``gsm8k`` (`Gsm8kInteraction`), the counterpart of verl's GSM8K interaction
(``verl.interactions.gsm8k_interaction.Gsm8kInteraction`` maps to it): the last number
of the model's message against ``interaction_kwargs.ground_truth``; right: "Your
response is correct!", score 1, the episode ends; wrong: it asks the model to reflect
and try again, score 0.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import uuid
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any

from rayrl.envs.builtin.gsm8k import _value
from rayrl.envs.errors import LoadError

__all__ = [
    "BUILTIN_INTERACTIONS",
    "EpisodeInteraction",
    "Gsm8kInteraction",
    "Interaction",
    "call_interaction",
    "load_interaction_config",
]


class Interaction:
    """Base class of interactions (verl's ``BaseInteraction`` protocol, synchronous)."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        self.name = self.config.get("name", "")
        self._episodes: dict[str, dict[str, Any]] = {}

    def start_interaction(self, instance_id: str, **kwargs: Any) -> str:
        """Start one episode's interaction with the row's ``interaction_kwargs``."""
        self._episodes[instance_id] = dict(kwargs)
        return instance_id

    def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """(should_terminate, the user's answer, a turn score, metrics)."""
        raise NotImplementedError(f"{type(self).__name__} has no generate_response()")

    def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._episodes.pop(instance_id, None)


class Gsm8kInteraction(Interaction):
    """Checks the model's last number against the row's ground truth (module docstring)."""

    def generate_response(self, instance_id, messages, **kwargs):
        said = next(
            (m.get("content") or "" for m in reversed(messages) if m["role"] == "assistant"), ""
        )
        truth = self._episodes.get(instance_id, {}).get("ground_truth")
        answer, expected = _value(said), _value(truth) if truth is not None else None
        if answer is not None and answer == expected:
            return True, "Your response is correct!", 1.0, {}
        reply = "Your response is incorrect! You need to reflect on your answer and try again."
        return False, reply, 0.0, {}


class EpisodeInteraction:
    """One episode's interaction: the one its row names, under an instance id of its own."""

    def __init__(self, interaction: Any, instance_id: str, kwargs: dict[str, Any]) -> None:
        self.interaction, self.instance_id, self.kwargs = interaction, instance_id, kwargs

    @classmethod
    def start(cls, interactions: Mapping[str, Any], episode: Any) -> EpisodeInteraction:
        """Start the interaction that ``extra_info.interaction_kwargs.name`` names (the only
        one when the row names none), with those kwargs, as verl's tool agent loop does.

        Raises:
            ValueError: the row names no interaction and there are several, or one that
                the interaction config does not define.
        """
        extra = episode.extra_info if isinstance(episode.extra_info, Mapping) else {}
        kwargs = dict(extra.get("interaction_kwargs") or {})
        name = kwargs.get("name")
        if name is None and len(interactions) == 1:
            name = next(iter(interactions))
        if name is None or name not in interactions:
            raise ValueError(
                f"extra_info.interaction_kwargs.name={name!r} names none of the interactions of "
                f"multi_turn.interaction_config_path ({', '.join(sorted(interactions))}); give "
                "each row the name of its interaction"
            )
        interaction, instance_id = interactions[name], uuid.uuid4().hex
        call_interaction(interaction.start_interaction, instance_id, **kwargs)
        return cls(interaction, instance_id, kwargs)

    def answer(self, messages: list[dict[str, Any]]) -> tuple[bool, str, float | None]:
        """(ends the episode, the user's answer, the turn score) to the model's message,
        which ``messages`` ends with."""
        method = self.interaction.generate_response
        done, text, score, *_ = call_interaction(method, self.instance_id, messages, **self.kwargs)
        return (
            bool(done),
            "" if text is None else str(text),
            None if score is None else float(score),
        )

    def finish(self) -> None:
        call_interaction(self.interaction.finalize_interaction, self.instance_id)


BUILTIN_INTERACTIONS: dict[str, type[Interaction]] = {
    "gsm8k": Gsm8kInteraction,
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction,
}


def call_interaction(method: Any, *args: Any, **kwargs: Any) -> Any:
    """Call an interaction's method; an awaitable it returns (a coroutine of verl's async
    methods, or any other) is awaited to its end."""
    result = method(*args, **kwargs)
    return asyncio.run(_awaited(result)) if inspect.isawaitable(result) else result


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def load_interaction_config(path: str | Path) -> dict[str, Any]:
    """The interactions of verl's interaction YAML, by name (see the module docstring).

    Raises:
        LoadError: no such file, not YAML, no ``interaction:`` list, an entry without
            ``class_name``, a class that cannot be loaded, or two entries of one name.
    """
    import yaml  # PyYAML comes with omegaconf, a rayrl dependency

    key = "multi_turn.interaction_config_path"
    file = Path(path).expanduser()
    if not file.is_file():
        raise LoadError(
            f"{key}: no such file {file.absolute()}; give a YAML file with an 'interaction:' "
            "list of {name, class_name, config} entries (verl's format)."
        )
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise LoadError(f"{key}: {file} is not valid YAML ({err}).") from err
    entries = data.get("interaction") if isinstance(data, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise LoadError(f"{key}: {file} has no 'interaction:' list of entries.")
    interactions: dict[str, Any] = {}
    for entry in entries:
        name, interaction = _build(entry, file)
        if name in interactions:
            raise LoadError(f"{key}: {file} names two interactions {name!r}; names must be unique.")
        interactions[name] = interaction
    return interactions


def _build(entry: Any, file: Path) -> tuple[str, Any]:
    from rayrl.envs.loader import load_object

    target = entry.get("class_name") if isinstance(entry, Mapping) else None
    if not target:
        raise LoadError(
            f"multi_turn.interaction_config_path: an entry of {file} names no class_name: {entry!r}"
        )
    config = dict(entry.get("config") or {})
    name = entry.get("name") or _default_name(str(target))
    config["name"] = name  # as verl: the interaction reads its name from its config
    cls = BUILTIN_INTERACTIONS.get(target) or load_object(target, "interaction")
    if not callable(getattr(cls, "generate_response", None)):
        raise LoadError(
            f"multi_turn.interaction_config_path: {target!r} has no generate_response(); an "
            "interaction has verl's BaseInteraction methods (start_interaction, "
            "generate_response, finalize_interaction)."
        )
    return name, cls(config=config)


def _default_name(target: str) -> str:
    """verl's default name of an interaction: its class name without ``Interaction``."""
    short = re.split(r"[.:]", target)[-1]
    return short.removesuffix("Interaction").lower() or short.lower()
