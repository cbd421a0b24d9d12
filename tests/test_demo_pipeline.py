"""`rayrl demo` at a reduced size, run as a user runs it (its own process, joining the
session's local Ray), on the real roles: the base model is validated, SFT's HF export
starts the RL run, the table of the three accuracies is printed, and RL moves the
held-out reward the right way. (The demo's full-size gain, >= 15 points, is what
`bench/e2e_cpu.py` measures.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import start_local_ray
from rayrl.cli.demo_cmd import _val

pytestmark = [pytest.mark.slow, pytest.mark.command]

# SFT at a higher learning rate, so that 300 steps get it to answer with one of the two
# numbers (the full demo: 800 steps at 3e-3); then 10 GRPO steps. SHARED goes to both.
SHARED = ["data.synthetic_size=256", "data.synthetic_val_size=64"]
SFT = [
    "trainer.total_training_steps=300",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "optim.lr=1e-2",
]
RL = ["trainer.total_training_steps=10", "trainer.test_freq=10"]


def run_demo(out, *args: str, seed: int, shared: list, sft: list, rl: list):
    """`rayrl demo` in a process of its own, as a user runs it, joining the session's
    local Ray (both stages): ``shared`` overrides go to SFT and RL, ``sft`` to SFT only
    (``--sft=``), ``rl`` to RL only."""
    gcs = start_local_ray().get_runtime_context().gcs_address
    both = [*shared, f"resources.address={gcs}"]
    command = [sys.executable, "-m", "rayrl.cli.main", "demo", *args]
    command += ["--output-dir", str(out), "--seed", str(seed)]
    command += [f"--sft={o}" for o in [*both, *sft]] + [*both, *rl]
    return subprocess.run(command, capture_output=True, text=True, timeout=1800, env=os.environ)


@pytest.mark.timeout(1200)  # three stages in a process of their own, on a loaded 2-core machine
def test_demo_reports_accuracies_and_rl_helps(tmp_path):
    done = run_demo(tmp_path, seed=1, shared=SHARED, sft=SFT, rl=RL)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-4000:]
    acc = {
        "base": _val(tmp_path / "base", last=False),
        "sft": _val(tmp_path / "rl", last=False),
        "rl": _val(tmp_path / "rl", last=True),
    }
    assert all(0.0 <= a <= 1.0 for a, *_ in acc.values())
    assert acc["base"][0] == 0.0  # random weights answer nothing
    assert acc["rl"][1] > acc["sft"][1], acc  # RL's direction on held-out questions
    sft_rows = (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
    rl_rows = [json.loads(r) for r in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(sft_rows) == 300 and len([r for r in rl_rows if "actor/pg_loss" in r]) == 10
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rl_rows if "actor/pg_loss" in r)
    # The RL stage started from SFT's export; the base stage only validated.
    rl_config = (tmp_path / "rl" / "config.yaml").read_text()
    assert f"path: {tmp_path / 'sft' / 'hf'}" in rl_config
    assert not (tmp_path / "base" / "checkpoints").exists()
    assert "after SFT + RL (GRPO)" in done.stdout and f"{100 * acc['rl'][0]:.1f}%" in done.stdout
    assert (tmp_path / "rl" / "report" / "report.html").is_file()


# The agent demo at a reduced size: 200 SFT steps, then 4 multi-turn GRPO steps.
TOOLS_SHARED = ["data.synthetic_size=128", "data.synthetic_val_size=32"]
TOOLS_SFT = ["trainer.total_training_steps=200", "trainer.test_freq=-1", "trainer.save_freq=-1"]
TOOLS_RL = ["trainer.total_training_steps=4", "trainer.test_freq=4"]


@pytest.mark.timeout(1200)
def test_the_agent_demo_runs_multi_turn_sft_and_grpo_with_the_calculator(tmp_path):
    """`rayrl demo --task tools` as a user runs it: the 4-layer model, multi-turn SFT,
    multi-turn GRPO whose episodes call the calculator, every step's trained tokens the
    rollout's and no tool token under the loss, the table of accuracies printed."""
    done = run_demo(
        tmp_path, "--task", "tools", seed=2, shared=TOOLS_SHARED, sft=TOOLS_SFT, rl=TOOLS_RL
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-4000:]
    config = json.loads((tmp_path / "base-model" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["hidden_size"] == 64
    rows = [json.loads(r) for r in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 4
    assert sum(r["tool/calculator/calls"] for r in steps) > 0  # SFT taught the call
    assert all(r["rollout/token_mismatch"] == 0 for r in steps)
    assert all(r["multi_turn/loss_on_tool_tokens"] == 0 for r in steps)
    assert all(r["multi_turn/tool_tokens"] > 0 for r in steps)
    assert "after SFT + RL (GRPO)" in done.stdout and "tool calls / episode" in done.stdout


# The vision demo at a reduced size: 40 SFT steps at a higher learning rate (the full
# demo: 100 at 3e-3), then 6 GRPO steps (of 30), validated on 32 held-out images.
VISION_SHARED = ["data.synthetic_val_size=32"]
VISION_SFT = [
    "trainer.total_training_steps=40",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "optim.lr=1e-2",
]
VISION_RL = ["trainer.total_training_steps=6", "trainer.test_freq=6"]


@pytest.mark.timeout(1200)
def test_the_vision_demo_runs_sft_and_grpo_on_images_with_a_tiny_vision_language_model(tmp_path):
    """`rayrl demo --task vision` as a user runs it: the project's tiny Qwen2.5-VL, SFT
    on demonstrations with images, GRPO with the hf rollout from SFT's export, the table
    of accuracies printed; 6 GRPO steps add 15 points of held-out accuracy or more."""
    done = run_demo(
        tmp_path, "--task", "vision", seed=1, shared=VISION_SHARED, sft=VISION_SFT, rl=VISION_RL
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-4000:]
    config = json.loads((tmp_path / "base-model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert (tmp_path / "sft" / "hf" / "preprocessor_config.json").is_file()
    sft_rows = (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
    assert len(sft_rows) == 40
    rl_rows = [json.loads(r) for r in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rl_rows if "actor/pg_loss" in r]) == 6
    assert "synthetic_task: colors" in (tmp_path / "rl" / "config.yaml").read_text()
    sft, rl = _val(tmp_path / "rl", last=False), _val(tmp_path / "rl", last=True)
    assert rl[0] >= sft[0] + 0.15, (sft, rl)  # greedy accuracy on held-out images
    assert "after SFT + RL (GRPO)" in done.stdout and f"{100 * rl[0]:.1f}%" in done.stdout
