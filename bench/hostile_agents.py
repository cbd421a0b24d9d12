"""Hostile cases of agents: tool schemas, chat templates, tool answers, the sandbox's
limits, the response budget (`bench/hostile.py` runs them)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hostile_run import rows, text, train, verdict

MT = "actor_rollout_ref.rollout.multi_turn"
ALWAYS_CALLS = """
import json

from rayrl.envs import ToolEnvironment

CALLS = {calls!r}


class AlwaysCalls(ToolEnvironment):
    \"\"\"A random model never writes a tool call: its first turns are read as CALLS.\"\"\"

    def step(self, conversation, message):
        made = len(self.events)
        if made < len(CALLS):
            name, arguments = CALLS[made]
            call = json.dumps({{"name": name, "arguments": arguments}})
            message = "<tool_call>" + call + "</tool_call>"
        return super().step(conversation, message)
"""
RECORD_TOOL_ANSWERS = """
import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({out!r}, "a") as f:
        for message in (extra_info or {{}}).get("trajectory", []):
            if message.get("role") == "tool":
                f.write(json.dumps(message["content"]) + "\\n")
    return 0.0
"""


def _agent_run(tmp: Path, calls: list, *extra: str, timeout: float = 600):
    """`rayrl train` with multi-turn episodes on a random model whose turns end after
    about 10 tokens, each episode making `calls` (tool name, arguments) first; the
    run and the tool answers the model saw (recorded by the reward function)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _agent_env import end_turns_often
    from rayrl.models import build_tiny_model

    model = build_tiny_model(tmp / "model", layers=1, hidden=32)
    end_turns_often(str(model), 0.1)
    env, reward, answers = tmp / "env.py", tmp / "reward.py", tmp / "answers.jsonl"
    env.write_text(ALWAYS_CALLS.format(calls=calls))
    reward.write_text(RECORD_TOOL_ANSWERS.format(out=str(answers)))
    done = train(
        tmp / "run",
        f"actor_rollout_ref.model.path={model}",
        f"{MT}.enable=true",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={env}:AlwaysCalls",
        f"custom_reward_function.path={reward}",
        "trainer.total_training_steps=1",
        *extra,
        timeout=timeout,
    )
    seen = [json.loads(x) for x in answers.read_text().splitlines()] if answers.exists() else []
    return done, seen


def bad_tool_schema(tmp: Path) -> dict:
    """A tool YAML whose schema requires an argument it does not define: one line
    naming the tool and the mistake, exit 2, before Ray starts."""
    tools = tmp / "tools.yaml"
    tools.write_text(
        "tools:\n  - class_name: rayrl.envs.builtin.calculator.Calculator\n"
        "    config: {type: native}\n"
        "    tool_schema: {type: function, function: {name: calc, description: Math., "
        "parameters: {type: objekt, properties: {expression: {type: string}}}}}\n"
    )
    done = train(tmp / "run", f"{MT}.enable=true", f"{MT}.tool_config_path={tools}", timeout=120)
    said = text(done)
    named = "tool 'calc': its tool_schema is not valid JSON Schema: parameters.type='objekt'"
    ok = done.returncode == 2 and named in said
    return verdict(ok and "Traceback" not in said and "Ray" not in said, said[-400:])


def strict_chat_template(tmp: Path) -> dict:
    """A model whose chat template allows no 'tool' role (strict role alternation):
    one line naming the template and the role, exit 2, before Ray starts."""
    from transformers import AutoTokenizer

    from rayrl.models import build_tiny_model

    model = build_tiny_model(tmp / "model", layers=1, hidden=32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{- raise_exception('Conversation roles must alternate user/assistant') }}"
        "{%- endif %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
    )
    tokenizer.save_pretrained(model)
    done = train(
        tmp / "run",
        f"actor_rollout_ref.model.path={model}",
        f"{MT}.enable=true",
        f"{MT}.tools=[calculator]",
        timeout=120,
    )
    said = text(done)
    named = f"the chat template of actor_rollout_ref.model.path={model} cannot render a 'tool'"
    ok = done.returncode == 2 and named in said and len(done.stderr.strip().splitlines()) == 1
    return verdict(ok and "Traceback" not in said, said[-400:])


def tool_returns_no_text(tmp: Path) -> dict:
    """A function tool that returns a number: the model is shown "42", the call counts
    as the tool's error, the run goes on."""
    tool = tmp / "tools.py"
    tool.write_text(
        "from rayrl.envs import function_tool\n\n\n@function_tool\n"
        'def lookup(key: str) -> int:\n    """Look a key up."""\n    return 42\n'
    )
    done, seen = _agent_run(
        tmp,
        [["lookup", {"key": "a"}]],
        f"{MT}.function_tool_path={tool}",
        "data.max_response_length=64",
    )
    last = rows(tmp / "run")[-1] if rows(tmp / "run") else {}
    calls, errors = last.get("tool/lookup/calls", 0), last.get("tool/lookup/errors", 0)
    ok = done.returncode == 0 and calls > 0 and errors == calls and "42" in seen
    return verdict(ok, f"calls {calls}, errors {errors}, seen {seen[:2]} | {text(done)[-200:]}")


def sandbox_fusion_limits(tmp: Path) -> dict:
    """verl's SandboxFusion tool config without a sandbox_fusion_url (the local sandbox):
    its default_timeout (3 s) stops an endless loop, its memory_limit_mb (256) fails a
    600 MB allocation, and the service's keys that have no effect are named."""
    tools = tmp / "tools.yaml"
    tools.write_text(
        "tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n"
        "    config: {num_workers: 10, rate_limit: 4, default_timeout: 3, memory_limit_mb: 256, "
        "type: native}\n"
        "    tool_schema: {type: function, function: {name: code_interpreter, description: "
        "Run code., parameters: {type: object, properties: {code: {type: string}}, "
        "required: [code]}}}\n"
    )
    calls = [
        ["code_interpreter", {"code": "while True: pass"}],
        ["code_interpreter", {"code": 'x = b"x" * (600 << 20)\nprint("allocated")'}],
    ]
    start = time.monotonic()
    done, seen = _agent_run(
        tmp, calls, f"{MT}.tool_config_path={tools}", "data.max_response_length=512"
    )
    looped = [s for s in seen if "killed after 3." in s]
    failed = [s for s in seen if "MemoryError" in s and "allocated" not in s]
    named = "num_workers, rate_limit of its config have no effect" in text(done)
    ok = done.returncode == 0 and looped and failed and named
    took = time.monotonic() - start
    return verdict(
        ok, f"{len(looped)} loops stopped, {len(failed)} allocations failed, {took:.0f} s"
    )


def sandbox_forks(tmp: Path) -> dict:
    """Code that forks 4 children of 200 MB under code_interpreter's memory_mb=512: the
    limit bounds the call's processes together, so the call is killed."""
    code = (
        "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
        "        data = b'x' * (200 << 20)\n        time.sleep(30)\n        os._exit(0)\n"
        "time.sleep(30)\n"
    )
    done, seen = _agent_run(
        tmp,
        [["code_interpreter", {"code": code}]],
        f"{MT}.tools=[{{name: code_interpreter, config: {{memory_mb: 512, timeout_s: 20}}}}]",
        "data.max_response_length=128",
    )
    killed = [s for s in seen if "MB together (memory limit)" in s]
    return verdict(done.returncode == 0 and killed, f"{len(killed)} of {len(seen)}: {seen[:1]}")


def response_budget_too_small(tmp: Path) -> dict:
    """`-c grpo`'s 32 tokens with a tool called every episode: the tool turns do not
    fit, and the log says so once, naming data.max_response_length; the tiny model's
    template, which drops the tools= list, is warned about too."""
    calls = [["calculator", {"expression": "457*823"}]]
    done, _ = _agent_run(
        tmp,
        calls,
        f"{MT}.tools=[calculator]",
        "data.max_response_length=32",
        "trainer.total_training_steps=2",
    )
    said = text(done)
    cut = said.count("the response budget cut a tool turn short")
    named = "data.max_response_length=32" in said and "ignores the tools= list" in said
    return verdict(done.returncode == 0 and cut == 1 and named, said[-600:])
