"""`rayrl demo`'s pipeline at a reduced size, on the real roles: the base model is
validated, SFT's HF export starts the RL run, the three accuracies are reported, and
RL moves the held-out reward the right way. (The demo's full-size gain, >= 15 points,
is what `bench/e2e_cpu.py` measures.)"""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console

from rayrl.cli.demo_cmd import DemoPlan, accuracy_table, run_pipeline

pytestmark = pytest.mark.slow

# SFT at a higher learning rate, so that 300 steps get it to answer with one of the two
# numbers (the full demo: 800 steps at 3e-3); then 10 GRPO steps.
SHARED = ["data.synthetic_size=256", "data.synthetic_val_size=64"]
SFT = [
    "trainer.total_training_steps=300",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "optim.lr=1e-2",
]
RL = ["trainer.total_training_steps=10", "trainer.test_freq=10"]


def test_demo_pipeline_reports_accuracies_and_rl_helps(ray_local, tmp_path):
    plan = DemoPlan(tmp_path, seed=1, shared=SHARED, sft=SFT, rl=RL)
    text = io.StringIO()
    result = run_pipeline(plan, Console(file=text, width=160))
    acc, reward = result.accuracy, result.reward
    assert set(acc) == {"base", "sft", "rl"} and all(0.0 <= a <= 1.0 for a in acc.values())
    assert acc["base"] == 0.0  # random weights answer nothing
    assert reward["rl"] > reward["sft"], (acc, reward)  # RL's direction on held-out questions
    assert len(result.sft_history) == 300 and len(result.rl_history) == 10
    assert all(math.isfinite(m["actor/pg_loss"]) for m in result.rl_history)
    # The RL stage started from SFT's export; the base stage only validated.
    rl_config = (tmp_path / "rl" / "config.yaml").read_text()
    assert f"path: {tmp_path / 'sft' / 'hf'}" in rl_config
    assert not (tmp_path / "base" / "checkpoints").exists()
    table = io.StringIO()
    Console(file=table, width=160).print(accuracy_table(result))
    assert (
        "after SFT + RL (GRPO)" in table.getvalue()
        and f"{100 * acc['rl']:.1f}%" in table.getvalue()
    )
