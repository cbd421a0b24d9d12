"""The agent keys of the rollout: `actor_rollout_ref.rollout.multi_turn.*` and `.agent.*`.

verl's names, defaults and meaning, each acted on:

- `multi_turn.enable`: generate episodes of model turns and tool answers
  (`rayrl.rollout.agent.rollout`) instead of one response per prompt;
- `max_assistant_turns` / `max_user_turns` (null: no limit), `max_parallel_calls`
  (tool calls run per assistant turn), `max_tool_response_length` (tokens of each
  tool response, cut on `tool_response_truncate_side`: left, middle or right),
  `format` (the tool-call format: hermes, alias qwen / qwen25, or gpt-oss);
- `tool_config_path`: verl's tool YAML (a `tools:` list of `{class_name, config,
  tool_schema}`); `function_tool_path`: a Python file whose module-level
  `rayrl.envs.function_tool` objects are tools;
- `interaction_config_path`: verl's interaction YAML (an `interaction:` list of
  `{name, class_name, config}`): a simulated user that answers each message without
  tool calls, picked per row by `extra_info.interaction_kwargs.name`
  (`rayrl.envs.interaction`; verl's GSM8K interaction is built in);
- `tokenization_sanity_check_mode`: `strict` (and `ignore_strippable`) check every
  step that the tokens trained on are the rollout's (`rollout/token_mismatch`, a
  warning naming the first sample that differs), `disable` skips the check;
- `agent.default_agent_loop`: the environment of rows without an `agent_name` column
  (verl's default `single_turn_agent`: rows must say `tool_agent` to use tools).

verl's `use_inference_chat_template` (only `false`: rayrl trains on the exact tokens the
rollout sampled and appended) and `num_repeat_rollouts` (only null: samples per prompt
are `rollout.n`) are compat rules (`rayrl.config.compat.verl_ppo`).

rayrl's own keys, beside verl's: `tools` (tools by registered name, `module:Name`,
`/path/file.py:Name` or verl-style entries, added to the tool file's), `tool_timeout_s`,
`env_timeout_s` (a whole environment step), `max_concurrent_tools` (per worker),
`stop_at_tool_call_end` (end a turn at the first complete call) and
`environment_config` (settings of every environment).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayrl.config.errors import ConfigError

KEY = "actor_rollout_ref.rollout.multi_turn"
TRUNCATE_SIDES = ("left", "middle", "right")
SANITY_MODES = ("strict", "ignore_strippable", "disable")


@dataclass
class MultiTurnConfig:
    enable: bool = False
    max_assistant_turns: int | None = None
    tool_config_path: str | None = None
    function_tool_path: str | None = None
    interaction_config_path: str | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tokenization_sanity_check_mode: str = "strict"
    format: str = "hermes"
    # rayrl's own
    tools: list[Any] = field(default_factory=list)
    tool_timeout_s: float = 30.0
    env_timeout_s: float = 600.0
    max_concurrent_tools: int = 16
    stop_at_tool_call_end: bool = False
    environment_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentConfig:
    default_agent_loop: str = "single_turn_agent"


def check_multi_turn(mt: MultiTurnConfig) -> None:
    """Raise ConfigError for the first multi-turn setting that cannot run."""
    for name in ("max_assistant_turns", "max_user_turns"):
        value = getattr(mt, name)
        if value is not None and value < 1:
            raise ConfigError(f"{KEY}.{name}={value} must be at least 1 (or null: no limit)")
    for name in ("max_parallel_calls", "max_tool_response_length", "max_concurrent_tools"):
        if getattr(mt, name) < 1:
            raise ConfigError(f"{KEY}.{name}={getattr(mt, name)} must be at least 1")
    for name in ("tool_timeout_s", "env_timeout_s"):
        if getattr(mt, name) <= 0:
            raise ConfigError(f"{KEY}.{name}={getattr(mt, name)} must be > 0 (seconds)")
    if mt.tool_response_truncate_side not in TRUNCATE_SIDES:
        raise ConfigError(
            f"{KEY}.tool_response_truncate_side={mt.tool_response_truncate_side!r} is not one "
            f"of {', '.join(TRUNCATE_SIDES)}"
        )
    if mt.tokenization_sanity_check_mode not in SANITY_MODES:
        raise ConfigError(
            f"{KEY}.tokenization_sanity_check_mode={mt.tokenization_sanity_check_mode!r} is "
            f"not one of {', '.join(SANITY_MODES)}"
        )
    if not isinstance(mt.tools, list):
        raise ConfigError(f"{KEY}.tools must be a list of tools; got {mt.tools!r}")
