"""The registries of the agent layer: tools, tool-call parsers and environments by name.

A config names each of them by a string (``calculator``, ``hermes``, ``tools``); the
built-ins register themselves when `rayrl.envs` is imported, and users add their own
with the same decorators (or name a class by its dotted path or file, see `loader`).
"""

from __future__ import annotations

from rayrl.registry import Registry

__all__ = ["ENVIRONMENTS", "TOOLS", "TOOL_PARSERS"]

MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"

TOOLS: Registry = Registry("tool", config_key=f"{MULTI_TURN}.tools")
"""Tool classes by name; each builds with ``cls(config=dict, schema=dict | None)``."""

TOOL_PARSERS: Registry = Registry("tool-call parser", config_key=f"{MULTI_TURN}.format")
"""Tool-call parser classes by format name (verl's ``multi_turn.format``: ``hermes``)."""

ENVIRONMENTS: Registry = Registry("environment", config_key=f"{MULTI_TURN}.environment")
"""Environment classes by name; verl's ``agent_name`` values are aliases."""
