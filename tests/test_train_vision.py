"""GRPO on a vision-language model through `rayrl train` (issue 48): the tiny Qwen2.5-VL
on a parquet of image prompts (the synthetic count_squares task), two steps with the hf
rollout, checkpoints, a resume, and HF exports (the run's and `rayrl export`'s) that
transformers loads as Qwen2.5-VL; its vision tower learns, or with actor.freeze_vision_tower stays as it was
while the language model learns."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from rayrl.cli.main import main
from rayrl.data import write_parquet
from rayrl.data.synthetic_images import image_rows
from rayrl.train.hf_export import export_checkpoint
from vision_cases import sharp_vision_model

pytestmark = pytest.mark.slow

# Rewards that differ between a prompt's samples, so GRPO's advantages are not all zero.
REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return (len(solution_str) % 7) / 6\n"
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl-train")
    reward = root / "reward.py"
    reward.write_text(REWARD)
    data = write_parquet(image_rows("count_squares", 8, seed=0), root / "train.parquet")
    return sharp_vision_model(root), data, reward


def _train(setup, out, *extra: str) -> int:
    model, data, reward = setup
    return main(
        [
            "train",
            "-c",
            "grpo",
            f"actor_rollout_ref.model.path={model}",
            f"data.train_files={data}",
            f"custom_reward_function.path={reward}",
            "data.train_batch_size=2",
            "data.max_response_length=6",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.device=cpu",
            f"trainer.output_dir={out}",
            *extra,
        ]
    )


def _towers(model_dir, exported):
    before, after = (
        Qwen2_5_VLForConditionalGeneration.from_pretrained(d) for d in (model_dir, exported)
    )
    moved = {
        part: any(
            not torch.equal(a, b)
            for a, b in zip(
                getattr(before.model, part).parameters(),
                getattr(after.model, part).parameters(),
                strict=True,
            )
        )
        for part in ("visual", "language_model")
    }
    return moved


def _steps(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "timing_s/step" in row]


def test_grpo_steps_train_the_vision_tower_checkpoint_resume_and_export(ray_local, setup, tmp_path):
    out = tmp_path / "run"
    assert _train(setup, out) == 0
    steps = _steps(out)
    assert len(steps) == 2 and all(s["actor/grad_norm"] > 0 for s in steps)
    # the rollout's log-probs are the actor's own (images and M-RoPE positions alike)
    assert all(s["training/rollout_probs_diff_max"] < 1e-5 for s in steps)
    assert (out / "checkpoints" / "global_step_2" / "actor").is_dir()
    assert (out / "hf" / "preprocessor_config.json").is_file()  # the export's processor
    assert _towers(setup[0], out / "hf") == {"visual": True, "language_model": True}
    offline = export_checkpoint(out / "checkpoints" / "global_step_2", tmp_path / "offline")
    assert _towers(out / "hf", offline) == {"visual": False, "language_model": False}
    # a third step resumes from the second's checkpoint
    assert _train(setup, out, "trainer.total_training_steps=3") == 0
    assert [s["step"] for s in _steps(out)] == [1, 2, 3]
    assert (out / "checkpoints" / "global_step_3").is_dir()


def test_a_frozen_vision_tower_stays_as_it_was(ray_local, setup, tmp_path):
    out = tmp_path / "frozen"
    assert _train(setup, out, "actor_rollout_ref.actor.freeze_vision_tower=true") == 0
    assert len(_steps(out)) == 2
    assert _towers(setup[0], out / "hf") == {"visual": False, "language_model": True}
