"""On-policy distillation composed with the other modes: multi-turn episodes with tools
and asynchronous training (replicas at staleness 0) train exactly what the synchronous
run trains, teacher log-probs included, with LoRA (the hybrid engine serves the episodes
through the adapted model: a PeftModel used to be refused there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from async_cases import EXACT, SMALL, end_turns_often
from rayrl.config import load_config
from rayrl.models import build_tiny_model
from rayrl.testing.chaos import deterministic, final_weights
from rayrl.trainer.async_ppo import AsyncPPOTrainer
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run

pytestmark = pytest.mark.slow
LORA = "actor_rollout_ref.model.lora_rank=8"
RUN = [  # the async tests' small multi-turn run, two steps, with distillation
    *SMALL,
    "trainer.total_training_steps=2",
    "distillation.enabled=true",
    "distillation.distillation_loss.use_policy_gradient=true",
    "distillation.distillation_loss.loss_mode=k1",
]


def _fit(models: tuple[str, str], out: Path, extra: list[str], trainer_cls) -> list[dict]:
    student, teacher = models
    cfg = load_config(
        "grpo",
        [
            *RUN,
            *extra,
            f"trainer.output_dir={out}",
            f"actor_rollout_ref.model.path={student}",
            f"distillation.teacher_models.teacher_model.model_path={teacher}",
        ],
    )
    run = Run(trainer_cls(cfg, print_fn=lambda _: None))
    try:
        run.setup()
        return run.fit()
    finally:
        run.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("distill-modes")
    student = str(build_tiny_model(root / "student", layers=2, hidden=64, seed=4))
    end_turns_often(student, share=1 / 6)  # turns of about 6 tokens: tool calls
    teacher = str(build_tiny_model(root / "teacher", layers=3, hidden=96, seed=5))
    return student, teacher


def test_async_multi_turn_lora_distillation_trains_what_the_synchronous_run_does(
    ray_local, models, tmp_path
):
    sync = _fit(models, tmp_path / "sync", [LORA], PPOTrainer)
    got = _fit(models, tmp_path / "async", [LORA, *EXACT], AsyncPPOTrainer)
    assert len(sync) == len(got) == 2
    for want, row in zip(sync, got, strict=True):
        same = deterministic(want)
        assert {k: row.get(k) for k in same} == same
        assert row["distillation/abs_loss"] > 0 and row["multi_turn/num_turns/mean"] > 2
    assert sync[0]["actor/grad_norm"] > 0  # a step that trains: the adapters' init matters
    weights, mine = final_weights(tmp_path / "sync"), final_weights(tmp_path / "async")
    assert all(torch.equal(weights[k], mine[k]) for k in weights)


def test_lora_runs_of_one_seed_train_alike(ray_local, models, tmp_path):
    """The adapters' random matrices come from the run's seed: two runs of one seed take
    the same gradients (they used to draw them from whatever state the process had)."""
    first = _fit(models, tmp_path / "a", [LORA], PPOTrainer)
    second = _fit(models, tmp_path / "b", [LORA], PPOTrainer)
    assert first[0]["actor/grad_norm"] > 0
    assert [r["actor/grad_norm"] for r in first] == [r["actor/grad_norm"] for r in second]
