"""A multi-turn run's agent setup refused before Ray starts, as `rayrl train` runs it: a
tool whose schema is not JSON Schema, a chat template that cannot render a tool's
answer (one `config error:` line naming the template and the role, exit code 2), a
template that drops the tool schemas (a warning); and a machine the run's pools would
oversubscribe many times over (the check `rayrl plan` makes too)."""

from __future__ import annotations

import logging

import pytest

from rayrl.cli.common import checked_config
from rayrl.cli.running import exit_code_of
from rayrl.cli.train_cmd import train
from rayrl.models import build_tiny_model
from rayrl.trainer import run as run_module
from rayrl.trainer.agent_checks import check_agent_setup
from rayrl.trainer.ppo import PPOTrainer

# A strict role-alternation template (as some models ship): no 'tool' role.
STRICT = (
    "{%- for m in messages %}"
    "{%- if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The tiny model's template, showing the tools' schemas when given.
WITH_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), layers=1, hidden=32)


def tools_config(tmp_path, model, *extra: str):
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "trainer.device=cpu",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={tmp_path / 'run'}",
        *extra,
    ]
    return checked_config("grpo", overrides, warn=lambda message: None)


def refused(cfg, monkeypatch, capsys) -> tuple[int, str]:
    """`rayrl train`'s exit code for `cfg` and what it printed on stderr; starting Ray
    fails the test (the refusal must come before)."""

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was about to start")

    monkeypatch.setattr(run_module, "connect", no_ray)
    code = exit_code_of(lambda: train(cfg))
    return code, capsys.readouterr().err


def test_a_tool_schema_that_is_not_json_schema_stops_train_before_ray(
    tmp_path, model, monkeypatch, capsys
):
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        "tools:\n  - class_name: rayrl.envs.builtin.calculator.Calculator\n"
        "    config: {type: native}\n"
        "    tool_schema: {type: function, function: {name: calc, description: Math., "
        "parameters: {type: object, properties: {expression: {type: string}}, "
        "required: [expr]}}}\n"
    )
    cfg = tools_config(
        tmp_path, model, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"
    )
    code, err = refused(cfg, monkeypatch, capsys)
    assert code == 2, err
    assert err.startswith("config error: ") and len(err.strip().splitlines()) == 1, err
    assert "tool 'calc': its tool_schema is not valid JSON Schema" in err
    assert "parameters.required names ['expr']" in err


def test_a_chat_template_that_cannot_render_tool_turns_stops_train_before_ray(
    tmp_path, model, monkeypatch, capsys
):
    cfg = tools_config(tmp_path, model, "actor_rollout_ref.rollout.multi_turn.tools=[calculator]")
    cfg.actor_rollout_ref.model.custom_chat_template = STRICT
    code, err = refused(cfg, monkeypatch, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(
        "config error: actor_rollout_ref.model.custom_chat_template cannot render a 'tool' "
        "message (a tool's answer) after an assistant message"
    ), err
    assert "Conversation roles must alternate" in err


def test_a_chat_template_that_drops_the_tools_gets_a_warning(tmp_path, model, caplog):
    cfg = tools_config(tmp_path, model, "actor_rollout_ref.rollout.multi_turn.tools=[calculator]")
    trainer = PPOTrainer(cfg)
    with caplog.at_level(logging.WARNING, logger="rayrl.trainer"):
        trainer.preflight()  # the tiny model's template shows no tools: passes, warns
    assert f"actor_rollout_ref.model.path={model} ignores the tools= list" in caplog.text
    assert "(calculator)" in caplog.text
    caplog.clear()
    tokenizer = trainer._actor_tokenizer()
    tokenizer.chat_template = WITH_TOOLS
    with caplog.at_level(logging.WARNING, logger="rayrl.trainer"):
        check_agent_setup(cfg, tokenizer, str(model))
    assert "ignores the tools= list" not in caplog.text
