"""Agents' side of a rollout: tools, environments, tool-call parsers and the sandbox.

A leaf package (the standard library, `rayrl.registry` and PyYAML for verl's tool
files; no Ray, no torch): the multi-turn rollout
(`rayrl.rollout.agent.rollout`) drives these between the model's turns.

- `tool`: `Tool` (name, OpenAI-style schema, ``execute``), `FunctionTool`;
  `arguments`: checking a call's arguments against the schema;
- `parsers`: tool calls in the model's format (``hermes``);
- `runner`: `ToolRunner`, concurrent calls with timeouts that never raise;
- `toolbox`: `Toolbox` (the tools of a rollout) and `ToolSession` (one episode's calls);
- `environment`: `Environment`, `ToolEnvironment`, `SingleTurnEnvironment`;
- `interaction`: a simulated user answering the model between turns (verl's
  interactions, ``interaction_config_path``);
- `loader` / `verl`: tools and environments named in a config, verl's tool YAML;
- `sandbox`: running untrusted code in an isolated child process;
- `builtin`: ``calculator``, ``code_interpreter``, ``search``, ``gsm8k_answer``.
"""

from rayrl.envs import builtin
from rayrl.envs.arguments import check_arguments
from rayrl.envs.environment import (
    Environment,
    Episode,
    SingleTurnEnvironment,
    StepResult,
    ToolEnvironment,
    make_environment,
)
from rayrl.envs.interaction import Interaction, load_interaction_config
from rayrl.envs.loader import (
    LoadError,
    build_tool,
    build_tools,
    load_function_tools,
    load_object,
)
from rayrl.envs.parsers import HermesParser, ParsedMessage, ToolCall, ToolCallParser, make_parser
from rayrl.envs.registry import ENVIRONMENTS, TOOL_PARSERS, TOOLS
from rayrl.envs.runner import CallOutcome, ToolRunner
from rayrl.envs.sandbox import Sandbox, SandboxLimits, SandboxResult
from rayrl.envs.tool import FunctionTool, Tool, ToolResult, function_tool
from rayrl.envs.toolbox import STATUSES, Toolbox, ToolEvent, ToolSession
from rayrl.envs.verl import episode_fields, load_tool_config

__all__ = [
    "ENVIRONMENTS",
    "STATUSES",
    "TOOLS",
    "TOOL_PARSERS",
    "CallOutcome",
    "Environment",
    "Episode",
    "FunctionTool",
    "HermesParser",
    "Interaction",
    "LoadError",
    "ParsedMessage",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SingleTurnEnvironment",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolEnvironment",
    "ToolEvent",
    "ToolResult",
    "ToolRunner",
    "ToolSession",
    "Toolbox",
    "build_tool",
    "build_tools",
    "builtin",
    "check_arguments",
    "episode_fields",
    "function_tool",
    "load_function_tools",
    "load_object",
    "load_interaction_config",
    "load_tool_config",
    "make_environment",
    "make_parser",
]
