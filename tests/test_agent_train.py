"""Multi-turn rollouts wired into training, the fast parts: verl's multi-turn keys (and
its GSM8K tool-use example's command line) taking effect, prompts rendered with the
tools' schemas and carrying `agent_name`, multi-turn SFT rows masked on the assistant
messages only, the reward's `extra_info` with the episode, and the per-step token check
on a real multi-turn rollout (it finds a corrupted token and a loss on a tool token)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rayrl.cli.main import main
from rayrl.config import ConfigError, load_config
from rayrl.config.multi_turn import MultiTurnConfig
from rayrl.config.sft import load_sft_config
from rayrl.data import PromptDataset, synthetic_rows
from rayrl.data.sft import SFTDataset
from rayrl.data.synthetic import demonstrations
from rayrl.envs import load_object
from rayrl.models import build_tiny_model
from rayrl.rollout import HFRolloutEngine, SamplingParams
from rayrl.rollout.agent.rollout import MultiTurnRollout
from rayrl.trainer.episodes import episode_metrics, token_check
from rayrl.workers.agent import configured_tools, episode_settings
from rayrl.workers.reward import episode_extra_info
from verl_examples import MULTI_TURN_FILES, MULTI_TURN_SCRIPT

BENCH = Path(__file__).resolve().parents[1] / "bench"
MT = "actor_rollout_ref.rollout.multi_turn"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A random tiny model whose turns end often (bench/_agent_env.py)."""
    path = str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", layers=1, seed=0))
    load_object(f"{BENCH}/_agent_env.py:end_turns_often")(path, 1 / 6)
    return path


def test_multi_turn_keys_take_effect_and_are_checked(recwarn, tiny):
    cfg = load_config(
        "grpo",
        [
            f"{MT}.enable=true",
            f"{MT}.max_assistant_turns=3",
            f"{MT}.max_user_turns=2",
            f"{MT}.max_parallel_calls=4",
            f"{MT}.max_tool_response_length=32",
            f"{MT}.tool_response_truncate_side=left",
            f"{MT}.format=hermes",
            f"{MT}.tools=[calculator]",
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        ],
    )
    assert not [w for w in recwarn if "multi_turn" in str(w.message)]
    engine = HFRolloutEngine(model_path=tiny, device="cpu", cache="dynamic")
    runner = MultiTurnRollout(engine, configured_tools(cfg), **episode_settings(cfg))
    assert (runner.config.max_assistant_turns, runner.config.max_user_turns) == (3, 2)
    assert runner.toolbox.max_parallel_calls == 4 and runner.format.max_message_tokens == 32
    assert runner.format.truncate_side == "left"
    assert runner.environment == "tool_agent"
    assert list(runner.toolbox.tools) == ["calculator"]
    bad = {
        f"{MT}.max_assistant_turns=0": "max_assistant_turns=0",
        f"{MT}.tool_response_truncate_side=top": "tool_response_truncate_side",
        f"{MT}.use_inference_chat_template=true": "exact tokens",
        f"{MT}.num_repeat_rollouts=3": "rollout.n",
        f"{MT}.tokenization_sanity_check_mode=loose": "tokenization_sanity_check_mode",
    }
    for override, words in bad.items():
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_config("grpo", [override])


def test_verl_gsm8k_tool_example_passes_config_show(tmp_path, capsys):
    """The launch script's command line with only its paths changed (the project
    directory is the temporary one), Hydra's --config-path/--config-name included."""
    for name, text in MULTI_TURN_FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text.lstrip("\n"))
    script = MULTI_TURN_FILES[MULTI_TURN_SCRIPT].replace('"$(pwd)"', f'"{tmp_path}"')
    args = _command_line(script, {"HOME": str(tmp_path)})
    assert any(a.startswith("--config-path=") for a in args) and len(args) > 40
    assert main(["config", "show", *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert "config error" not in out.err and "multi_turn" not in out.err, out.err
    folder = tmp_path / "examples/sglang_multiturn/config"
    overrides = [a for a in args if not a.startswith("--")]
    cfg = load_config(str(folder / "gsm8k_multiturn_grpo.yaml"), overrides)
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.max_assistant_turns == 5  # from the Hydra config file
    assert mt.tool_config_path == str(folder / "tool_config/gsm8k_tool_config.yaml")
    assert f"tool_config_path: {mt.tool_config_path}" in out.out
    tools = configured_tools(cfg)  # verl's GSM8K tool class maps to the built-in
    assert [t.name for t in tools] == ["calc_gsm8k_reward"]


def _command_line(script: str, env: dict[str, str]) -> list[str]:
    """The trainer command's arguments after the shell's variable expansion."""
    for line in script.splitlines():
        m = re.match(r'^(\w+)="([^"]*)"$', line.strip())
        if m:
            env[m.group(1)] = re.sub(r"\$(\w+)", lambda v: env.get(v.group(1), ""), m.group(2))
    command = script[script.index("python3 -m verl.trainer.main_ppo") :]
    command = command.replace("\\\n", " ").replace("$@", "")
    command = re.sub(r"\$\{?(\w+)\}?", lambda v: env[v.group(1)], command)
    return [a for a in shlex.split(command) if "=" in a]


def test_prompts_show_the_tools_and_carry_agent_name(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.chat_template = (  # a template that renders tools, as Qwen's does
        "{%- if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n"
        "{%- endif %}{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{%- endfor %}"
        "{%- if add_generation_prompt %}assistant:{%- endif %}"
    )
    rows = synthetic_rows("multiply", 2, seed=0) + synthetic_rows("arithmetic", 1, seed=0)
    schemas = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    data = PromptDataset(
        rows, tokenizer, max_prompt_length=256, tools=schemas, default_agent="single_turn_agent"
    )
    texts = [tokenizer.decode(ids) for ids in data.prompt_ids]
    assert texts[0].startswith("TOOLS:calculator;") and texts[1].startswith("TOOLS:")
    assert "TOOLS" not in texts[2]  # a row without agent_name: verl's single-turn agent
    batch = data.collate([0, 1, 2])
    assert list(batch["agent_name"]) == ["tool_agent", "tool_agent", "single_turn_agent"]
    plain = PromptDataset(rows, tokenizer, max_prompt_length=256)
    assert "TOOLS" not in tokenizer.decode(plain.prompt_ids[0])


def test_multi_turn_sft_trains_the_assistant_messages_only(tiny):
    cfg = load_sft_config("demo_tools", [])
    assert cfg.data.multiturn.enable and cfg.data.synthetic_task == "multiply"
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    rows = demonstrations("multiply", 8, seed=3, correct_rate=0.5)
    data = SFTDataset(rows, tokenizer, multiturn=True, max_length=512)
    assert len(data) == 8 and not data.rejected
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row, response, mask in zip(rows, data.response_ids, data.response_masks, strict=True):
        trained = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if m])
        shown = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if not m])
        said = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert trained == "<|im_end|>".join(said) + "<|im_end|>"
        if row["extra_info"]["correct"]:  # the tool's answer is shown, never trained
            assert "<|im_start|>tool\n" + row["extra_info"]["ground_truth"] in shown
        ends = [k for k, t in enumerate(response) if t == im_end and mask[k]]
        assert all(mask[k + 1] == 0 for k in ends if k + 1 < len(mask))
    batch = data.collate(list(range(8)))
    assert int(batch["response_mask"].sum()) == sum(sum(m) for m in data.response_masks)


def _episodes(tiny: str, names: list[str]):
    """A real multi-turn rollout: every turn of the random model is a 'tool call'."""
    engine = HFRolloutEngine(model_path=tiny, device="cpu")
    environment = load_object(f"{BENCH}/_agent_env.py:LatencyEnvironment")
    config = MultiTurnConfig(environment_config={"latency_s": 0})
    runner = MultiTurnRollout(engine, [], config, environment=environment)
    rows = synthetic_rows("arithmetic", len(names), seed=0)  # no agent_name: the default
    prompts = PromptDataset(rows, engine.tokenizer, max_prompt_length=64).collate(range(len(rows)))
    prompts.non_tensors["uid"][:] = names
    prompts.meta["step"] = 0
    return runner.generate(prompts, SamplingParams(n=2, max_new_tokens=48, seed=5))


def test_token_check_on_a_real_rollout_and_what_it_catches(tiny):
    batch = _episodes(tiny, ["a", "b", "c"])
    metrics = episode_metrics(batch)
    assert metrics["multi_turn/num_turns/max"] > 2  # turns ended, observations appended
    checked, first = token_check(batch)
    assert first is None and checked["rollout/token_mismatch"] == 0
    assert checked["multi_turn/tool_tokens"] > 0 and checked["multi_turn/loss_on_tool_tokens"] == 0
    # The record is the rollout's own, apart from the batch's tensors: a changed token in
    # what is trained on, or a loss on a tool token, is found.
    row = int(np.argmax([len(t) for t in batch["rollout_token_ids"]]))
    sampled = np.asarray(batch["rollout_sampled"][row])
    broken = batch.select(*batch.tensors, *batch.non_tensors)
    broken.tensors["responses"] = batch["responses"].clone()
    broken.tensors["responses"][row, 0] += 1
    checked, first = token_check(broken)
    assert checked["rollout/token_mismatch"] == 1 and f"sample {batch['uid'][row]}" in first
    # The response part of input_ids is trained on too (the log-probs are of input_ids):
    # one token changed there alone is found, and named in that column.
    width = batch["prompts"].shape[1]
    position = len(batch["rollout_token_ids"][row]) - 1
    broken = batch.select(*batch.tensors, *batch.non_tensors)
    broken.tensors["input_ids"] = batch["input_ids"].clone()
    broken.tensors["input_ids"][row, width + position] += 1
    checked, first = token_check(broken)
    assert checked["rollout/token_mismatch"] == 1
    assert "in input_ids" in first and f"position {position}" in first
    leaky = batch.select(*batch.tensors, *batch.non_tensors)
    leaky.tensors["response_mask"] = batch["response_mask"].clone()
    leaky.tensors["response_mask"][row, int(np.flatnonzero(sampled == 0)[0])] = 1
    assert token_check(leaky)[0]["multi_turn/loss_on_tool_tokens"] == 1
    assert torch.equal(
        batch["response_mask"][row, : len(sampled)], torch.from_numpy(sampled).long()
    )


def test_the_reward_sees_the_episode_in_extra_info(tiny):
    batch = _episodes(tiny, ["a"])
    infos = episode_extra_info(batch)
    for i, info in enumerate(infos):
        assert info["num_turns"] == batch["num_turns"][i]
        assert info["trajectory"][0]["role"] == "user" and info["turn_scores"] == []
        assert info["rollout_reward_scores"] == {} and "question" in info
    assert "trajectory" not in batch["extra_info"][0]  # the batch's own column is untouched


def test_report_plots_turns_and_tool_calls(tmp_path):
    from rayrl.trainer.report import write_report

    rows = [
        {
            "step": step,
            "multi_turn/num_turns/mean": 2.0 + step / 2,
            "multi_turn/num_turns/max": 4.0,
            "tool/calculator/calls": 3.0 * step,
            "tool/calculator/errors": 0.0,
            "tool/calculator/latency_s": 0.01,
            "timing_s/gen": 1.0,
            "timing_s/tools": 0.5,
            "timing_s/step": 2.0,
        }
        for step in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(tmp_path).read_text()
    assert (tmp_path / "report/turns.png").is_file() and 'src="turns.png"' in page
    assert (tmp_path / "report/tool_calls.png").is_file() and 'src="tool_calls.png"' in page
