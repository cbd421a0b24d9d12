"""A multi-turn run's agent setup, checked on the driver before Ray starts.

The workers load the tools and render tool turns through the chat template when
they build their rollouts; a mistake there costs a cluster start and ends in a worker
traceback. `check_agent_setup` does the same on the driver first (`Trainer.preflight`):

- the configured tools and interactions load (`rayrl.workers.agent`): a tool whose
  schema is not valid JSON Schema, a class that cannot be imported, ... is a
  `ToolConfigError` naming the key and the tool;
- the chat template renders a tool turn exactly as the rollout will (a ``tool``
  message after an assistant message: `TurnFormat.pieces`): a template that raises on
  it (strict role-alternation templates do) is a `ConfigError` naming the template
  and the role;
- a template that renders a prompt the same with and without ``tools=`` drops the
  tool schemas: the model would never see them, which a warning says (a model taught
  its tools by fine-tuning needs no schemas, so it is not an error).
"""

from __future__ import annotations

import logging
from typing import Any

from rayrl.config.errors import ConfigError
from rayrl.config.schema import RayRLConfig
from rayrl.rollout.agent.format import TurnFormat, TurnFormatError
from rayrl.workers.agent import configured_interactions, configured_tools

log = logging.getLogger("rayrl.trainer")

TOOL_ROLE = "tool"  # the role of a tool's answer in the conversation (the rollout's)
_PROBE = [{"role": "user", "content": "What is 2 + 2?"}]


def check_agent_setup(cfg: RayRLConfig, tokenizer: Any, model_path: str) -> None:
    """Check a multi-turn run's tools, interactions and chat template (module
    docstring); `model_path` is the actor's model directory (its template's source)."""
    tools = configured_tools(cfg)
    configured_interactions(cfg)
    where = template_source(cfg, model_path)
    kwargs = dict(cfg.data.apply_chat_template_kwargs)
    check_tool_turns(tokenizer, where, kwargs)
    if tools:
        warn_if_tools_dropped(tokenizer, where, kwargs, [tool.schema for tool in tools])


def template_source(cfg: RayRLConfig, model_path: str) -> str:
    """Where the chat template comes from, as the config names it."""
    model = cfg.actor_rollout_ref.model
    if model.custom_chat_template is not None:
        return "actor_rollout_ref.model.custom_chat_template"
    if model.tokenizer_path:
        return f"the chat template of actor_rollout_ref.model.tokenizer_path={model.tokenizer_path}"
    return f"the chat template of actor_rollout_ref.model.path={model_path}"


def check_tool_turns(tokenizer: Any, where: str, kwargs: dict[str, Any]) -> None:
    """Raise ConfigError when the template cannot render a tool's answer after an
    assistant turn (what every tool call of the rollout appends)."""
    try:
        TurnFormat(tokenizer, template_kwargs=kwargs).pieces((TOOL_ROLE,))
    except TurnFormatError as err:
        cause = err.__cause__ if err.__cause__ is not None else err
        said = " ".join(f"{type(cause).__name__}: {cause}".split())  # one line
        raise ConfigError(
            f"{where} cannot render a {TOOL_ROLE!r} message (a tool's answer) after an "
            f"assistant message, as every tool call of a multi-turn rollout needs ({said}); "
            "use a model whose chat template renders tool messages, or set "
            "actor_rollout_ref.model.custom_chat_template to one that does"
        ) from None


def warn_if_tools_dropped(
    tokenizer: Any, where: str, kwargs: dict[str, Any], schemas: list[dict[str, Any]]
) -> bool:
    """Warn when the template renders a prompt the same with and without the tools'
    schemas; whether it warned. A template that fails with ``tools=`` is the prompt
    dataset's to report (it sets such rows aside, saying why)."""
    try:
        plain = _render(tokenizer, kwargs)
        shown = _render(tokenizer, {**kwargs, "tools": schemas})
    except Exception:  # noqa: BLE001 - any template error: the dataset reports it
        return False
    if plain != shown:
        return False
    names = ", ".join(s["function"]["name"] for s in schemas)
    log.warning(
        "%s ignores the tools= list: the prompts will not show the model the schemas of "
        "its tools (%s), so it knows them only from its training; use a template that "
        "renders tools, or describe them in the prompts",
        where,
        names,
    )
    return True


def _render(tokenizer: Any, kwargs: dict[str, Any]) -> str:
    text: str = tokenizer.apply_chat_template(
        _PROBE, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return text
