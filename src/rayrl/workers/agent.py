"""The agent side of the actor: the configured tools and the multi-turn rollout settings.

A rollout worker (the hybrid actor, an asynchronous replica) generates through a
`RolloutService` (`rollout_service`); with `actor_rollout_ref.rollout.multi_turn.enable`
it holds `rayrl.rollout.agent.rollout.MultiTurnRollout` over the worker's engine. Its tools
come, once per worker, from the config (`configured_tools`): verl's tool YAML
(`multi_turn.tool_config_path`), verl's function-tool file (`function_tool_path`)
and rayrl's `multi_turn.tools` list, in that order; two tools with one name are an
error. verl's interactions (`multi_turn.interaction_config_path`: a simulated user
answering messages without tool calls) load the same way (`configured_interactions`). The driver loads the same tools before anything is reserved, to render their
schemas into the prompts (`tool_schemas`) and to fail early on a bad tool config.
For a vision-language policy the episodes also get its image processor (loaded from
the model directory, with ``data.mm_processor_kwargs``, as the prompts were read), so
that a tool or environment may show the model images (`rayrl.rollout.agent.format`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from rayrl.config.multi_turn import KEY
from rayrl.config.schema import RayRLConfig
from rayrl.envs import (
    LoadError,
    Tool,
    build_tools,
    load_function_tools,
    load_interaction_config,
    load_tool_config,
)
from rayrl.rollout.agent.rollout import MultiTurnRollout
from rayrl.rollout.base import RolloutEngine
from rayrl.rollout.service import RolloutService, ServedEngine

if TYPE_CHECKING:
    from rayrl.data.vision import VisionProcessor


class ToolConfigError(ValueError):
    """The tools the config names cannot be loaded; the message names the key."""


def configured_tools(cfg: RayRLConfig) -> list[Tool]:
    """Fresh tool objects of the config (see the module docstring); none when multi-turn
    rollouts are off."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return []
    try:
        entries: list[Any] = []
        if mt.tool_config_path:
            entries += load_tool_config(mt.tool_config_path)
        if mt.function_tool_path:
            entries += load_function_tools(mt.function_tool_path)
        entries += [dict(e) if isinstance(e, dict) else e for e in mt.tools]
        return build_tools(entries)
    except (LoadError, ValueError, TypeError, LookupError) as err:  # LookupError: a
        # name no registry knows (UnknownNameError, with its did-you-mean), a missing key
        raise ToolConfigError(
            f"{KEY}: the tools of tool_config_path={mt.tool_config_path!r}, "
            f"function_tool_path={mt.function_tool_path!r} and tools={list(mt.tools)!r} "
            f"could not be loaded: {err}"
        ) from err


def configured_interactions(cfg: RayRLConfig) -> dict[str, Any]:
    """The interactions of `multi_turn.interaction_config_path` by name (verl's YAML,
    `rayrl.envs.interaction`); none when it is null or multi-turn rollouts are off."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable or not mt.interaction_config_path:
        return {}
    try:
        return load_interaction_config(mt.interaction_config_path)
    except (LoadError, ValueError, TypeError, KeyError) as err:
        raise ToolConfigError(
            f"{KEY}.interaction_config_path={mt.interaction_config_path!r}: the interactions "
            f"could not be loaded: {err}"
        ) from err


def tool_schemas(cfg: RayRLConfig) -> list[dict[str, Any]]:
    """The OpenAI schemas of the configured tools, for the prompts' chat template."""
    return [tool.schema for tool in configured_tools(cfg)]


def default_agent(cfg: RayRLConfig) -> str | None:
    """The environment of rows without an `agent_name` (None: multi-turn is off)."""
    r = cfg.actor_rollout_ref.rollout
    return r.agent.default_agent_loop if r.multi_turn.enable else None


def episode_settings(cfg: RayRLConfig) -> dict[str, Any]:
    """The multi-turn rollout's settings from the config (`MultiTurnRollout`'s keyword
    arguments): the `actor_rollout_ref.rollout.multi_turn` group as it is, the
    environment of rows without an `agent_name`, and the chat template's arguments."""
    r = cfg.actor_rollout_ref.rollout
    return {
        "config": r.multi_turn,
        "environment": r.agent.default_agent_loop,
        "chat_template_kwargs": dict(cfg.data.apply_chat_template_kwargs),
    }


def rollout_service(
    engine: RolloutEngine,
    cfg: RayRLConfig,
    tools: list[Tool],
    interactions: dict[str, Any],
    tokenizer: Any,
    receiver: bool = False,
    model_path: str | None = None,
) -> RolloutService:
    """The rollout service of a rollout worker: ``engine``, and with multi-turn rollouts
    the episodes over it with the worker's tools and interactions (and the image
    processor of the model directory ``model_path``, a vision-language one);
    ``receiver``: an asynchronous replica's (weights offered mid-call)."""
    episodes = None
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        episodes = MultiTurnRollout(
            engine,
            tools,
            tokenizer=tokenizer,
            interactions=interactions,
            vision=episode_vision(cfg, model_path, tokenizer),
            **episode_settings(cfg),
        )
    # both registered engines serve the request contract (`rayrl.rollout.requests`)
    return RolloutService(cast("ServedEngine", engine), episodes, receiver)


def episode_vision(
    cfg: RayRLConfig, model_path: str | None, tokenizer: Any
) -> VisionProcessor | None:
    """The image processor of a vision-language model directory (as the prompts were
    read: ``data.mm_processor_kwargs``), or None (a text-only model, or no directory)."""
    from rayrl.models.vision_language import is_vision_language, local_config

    config = local_config(model_path) if model_path else None
    if config is None or not is_vision_language(config):
        return None
    from rayrl.data.vision import load_vision_processor

    kwargs = dict(cfg.data.mm_processor_kwargs or {})
    return load_vision_processor(str(model_path), tokenizer, mm_processor_kwargs=kwargs)
