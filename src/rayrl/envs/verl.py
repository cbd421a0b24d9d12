"""verl's tool setup, read as it is: the tool YAML, its tool classes, its row columns.

- `load_tool_config(path)`: the YAML of ``actor_rollout_ref.rollout.multi_turn.
  tool_config_path``: a ``tools:`` list of ``{class_name, config, tool_schema}`` entries
  (``config.type`` is ``native``; verl's ``mcp`` tools are not run here). Each entry
  goes to `rayrl.envs.loader.build_tool`.
- verl's own tool classes map to rayrl's built-ins (`builtin_tool`): the SandboxFusion
  code tool to ``sandbox_fusion`` (the code runs on the SandboxFusion server its
  ``sandbox_fusion_url`` names, `rayrl.envs.builtin.sandbox_fusion`), or without a URL
  to ``code_interpreter`` (rayrl's local sandbox, under the tool's ``default_timeout``
  and ``memory_limit_mb``; a warning names the keys that then have no effect); the
  retrieval search tool to ``search`` (a local corpus given in its config instead of a
  retrieval service URL), the GSM8K answer tool to ``gsm8k_answer``.
- A user's class written against verl's ``BaseTool`` (async ``create`` / ``execute``
  / ``calc_reward`` / ``release`` with instance ids) runs through `VerlTool`, each
  coroutine on its own event loop in the tool's worker thread.
- Row columns (`episode_fields`): ``agent_name`` picks the environment
  (``tool_agent``, ``single_turn_agent``) and ``extra_info.tools_kwargs`` gives each
  tool its per-episode ``create_kwargs``, where verl's dataset reads them.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rayrl.envs.tool import Tool, split_schema

__all__ = [
    "BUILTIN_FOR_CLASS",
    "VerlTool",
    "builtin_tool",
    "episode_fields",
    "is_verl_tool_class",
    "load_tool_config",
    "sandbox_fusion_config",
]

log = logging.getLogger("rayrl.envs")

SANDBOX_FUSION = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
BUILTIN_FOR_CLASS = {
    SANDBOX_FUSION: "code_interpreter",
    "verl.tools.search_tool.SearchTool": "search",
    "verl.tools.gsm8k_tool.Gsm8kTool": "gsm8k_answer",
    "verl.workers.tool.gsm8k_tool.Gsm8kTool": "gsm8k_answer",
}
# verl's SandboxFusion keys -> the `code_interpreter` keys that honour them.
SANDBOX_FUSION_LIMITS = {"default_timeout": "timeout_s", "memory_limit_mb": "memory_mb"}
# verl's SandboxFusion keys for the remote service: the local sandbox ignores them.
SANDBOX_FUSION_SERVICE = ("num_workers", "rate_limit", "enable_global_rate_limit")
_warned: set[str] = set()  # each warning once per process (the driver builds tools often)


def builtin_tool(target: str, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The built-in a tool class maps to (``target`` itself when none), with its config:
    verl's SandboxFusion tool runs on its server when it names one, else locally."""
    if target == SANDBOX_FUSION:
        if config.get("sandbox_fusion_url"):
            return "sandbox_fusion", config
        return "code_interpreter", sandbox_fusion_config(config)
    return BUILTIN_FOR_CLASS.get(target, target), config


def sandbox_fusion_config(config: dict[str, Any]) -> dict[str, Any]:
    """verl's SandboxFusion ``config`` without a server, as ``code_interpreter``'s: its
    limits mapped onto the local sandbox's (a ``code_interpreter`` key given as well
    wins); a warning names the keys that have no effect here (the remote service's, a
    language other than Python)."""
    mapped = dict(config)
    for verl_key, key in SANDBOX_FUSION_LIMITS.items():
        if verl_key in mapped and key not in mapped:
            mapped[key] = mapped[verl_key]
    ignored = [k for k in SANDBOX_FUSION_SERVICE if k in config]
    language = str(config.get("default_language", "python")).lower()
    if language != "python":
        ignored.append(f"default_language={language!r} (the local sandbox runs Python only)")
    if ignored:
        _warn_once(
            f"tool {SANDBOX_FUSION} names no sandbox_fusion_url, so it runs in rayrl's "
            f"local sandbox (code_interpreter): {', '.join(ignored)} of its config have no "
            "effect (default_timeout and memory_limit_mb are its limits; "
            "multi_turn.max_concurrent_tools bounds the calls at once)"
        )
    return mapped


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def load_tool_config(path: str | Path) -> list[dict[str, Any]]:
    """The tool entries of a verl tool YAML file (a ``tools:`` list)."""
    import yaml  # PyYAML comes with omegaconf, a rayrl dependency

    from rayrl.envs.errors import LoadError

    file = Path(path).expanduser()
    if not file.is_file():
        raise LoadError(
            f"multi_turn.tool_config_path: no such file {file.absolute()}; give a YAML file "
            "with a 'tools:' list (verl's format)."
        )
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise LoadError(f"multi_turn.tool_config_path: {file} is not valid YAML ({err}).") from err
    tools = (data or {}).get("tools") if isinstance(data, Mapping) else None
    if not isinstance(tools, list):
        raise LoadError(
            f"multi_turn.tool_config_path: {file} has no 'tools:' list; expected entries like "
            "{class_name: ..., config: {type: native}, tool_schema: {type: function, function: ...}}."
        )
    return [dict(entry) for entry in tools]


def check_tool_type(config: Mapping[str, Any], target: str) -> None:
    """Refuse verl tool types other than ``native`` (MCP servers are not run here)."""
    from rayrl.envs.errors import LoadError

    kind = str(config.get("type", "native")).lower()
    if kind != "native":
        raise LoadError(
            f"tool {target}: config.type={kind!r}; rayrl runs native tools only (verl's 'mcp' "
            "tools talk to an MCP server). Wrap the service in a Tool subclass instead."
        )


def is_verl_tool_class(cls: type) -> bool:
    """True for a class with verl's ``BaseTool`` protocol (async create and execute)."""
    return all(inspect.iscoroutinefunction(getattr(cls, m, None)) for m in ("create", "execute"))


class VerlTool(Tool):
    """A verl ``BaseTool`` object behind rayrl's `Tool` interface."""

    def __init__(self, inner: Any, schema: Mapping[str, Any]) -> None:
        super().__init__({"timeout_s": getattr(inner, "timeout_s", None)}, schema)
        self.inner = inner

    @classmethod
    def of(cls, tool_class: type, config: dict, schema: Any) -> VerlTool:
        """Build ``tool_class(config=..., tool_schema=...)`` the way verl does, and wrap it."""
        view = _SchemaView(_full_schema(schema)) if schema else None
        inner = tool_class(config=config, tool_schema=view)
        own = getattr(inner, "tool_schema", None)
        dump = own.model_dump() if own is not None and hasattr(own, "model_dump") else own
        wrapped = cls(inner, _full_schema(dump or schema or {}))
        wrapped.config = dict(config)
        if config.get("timeout_s") is not None:
            wrapped.timeout_s = float(config["timeout_s"])
        return wrapped

    def create(self, create_kwargs: Mapping[str, Any]) -> Any:
        made = asyncio.run(self.inner.create(create_kwargs=dict(create_kwargs)))
        return made[0] if isinstance(made, tuple) else made

    def execute(self, arguments: dict[str, Any], state: Any) -> Any:
        return asyncio.run(self.inner.execute(state, arguments))

    def reward(self, state: Any) -> float | None:
        calc = getattr(self.inner, "calc_reward", None)
        return None if calc is None else asyncio.run(calc(state))

    def release(self, state: Any) -> None:
        release = getattr(self.inner, "release", None)
        if release is not None:
            asyncio.run(release(state))


def _full_schema(schema: Any) -> dict[str, Any]:
    if not schema:
        return {}
    name, description, parameters = split_schema(schema)
    function: dict[str, Any] = {"name": name, "description": description or ""}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


class _SchemaView:
    """Attribute access over a schema dict, with pydantic's ``model_dump``, as verl's
    tools expect of their ``tool_schema``."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getattr__(self, name: str) -> Any:
        try:
            value = self._data[name]
        except KeyError:
            raise AttributeError(name) from None
        return _SchemaView(value) if isinstance(value, Mapping) else value

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return dict(self._data)


def episode_fields(row: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """``(agent_name, tools_kwargs)`` of a row's non-tensor columns, verl's way.

    ``agent_name`` is a column of its own (or, failing that, in ``extra_info``);
    ``tools_kwargs`` is in ``extra_info`` (or a column of its own).
    """
    extra = row.get("extra_info")
    extra = extra if isinstance(extra, Mapping) else {}
    agent = row.get("agent_name") or extra.get("agent_name")
    kwargs = row.get("tools_kwargs") or extra.get("tools_kwargs") or {}
    return (str(agent) if agent else None), dict(kwargs) if isinstance(kwargs, Mapping) else {}
