"""On-policy distillation survives its teachers' loss: a teacher process SIGKILLed as it
scores is replaced mid-step and the run ends bitwise identical to a clean run, for
teachers on a pool of their own and for teachers in the actor's processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import start_local_ray
from rayrl.config import load_config
from rayrl.testing.chaos import compare_runs, final_weights
from rayrl.testing.faults import Fault, inject
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run

pytestmark = pytest.mark.slow
RUN = [
    "data.train_batch_size=2",
    "data.max_response_length=6",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=2",
    "trainer.total_training_steps=3",
    "trainer.val_before_train=false",
    "trainer.logger=[jsonl]",
    "distillation.enabled=true",
    "distillation.distillation_loss.use_task_rewards=false",  # the teacher's signal alone
]
OWN_POOL = ["distillation.nnodes=1", "distillation.n_gpus_per_node=2"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    from rayrl.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "m", layers=3, seed=2)


def _run(out: Path, teacher: Path, extra: list[str], kill_in: str | None = None) -> dict:
    cfg = load_config(
        "grpo",
        [
            *RUN,
            *extra,
            f"distillation.teacher_models.teacher_model.model_path={teacher}",
            f"trainer.output_dir={out}",
        ],
    )
    printed: list[str] = []
    run = Run(PPOTrainer(cfg, print_fn=printed.append))

    def on_step(step: int, _metrics: dict) -> None:  # step 2's scoring kills rank 1
        roles = run.trainer.roles
        if step == 1 and kill_in == "own":
            inject(roles.teacher, Fault("compute_teacher_log_prob", "kill", ranks=(1,)))
        elif step == 1 and kill_in == "hybrid":
            inject(roles.hybrid, Fault("compute_teacher_log_prob", "kill", ranks=(1,)))

    try:
        run.setup()
        history = run.fit(on_step=on_step)
    finally:
        run.shutdown()
    return {
        "history": history,
        "ledger": run.replay.ledger,
        "weights": final_weights(out),
        "recoveries": run.replay.recoveries,
        "printed": printed,
    }


@pytest.mark.parametrize(("where", "extra"), [("own", OWN_POOL), ("hybrid", [])])
def test_a_teacher_killed_as_it_scores_is_replaced_and_the_run_ends_bitwise(
    tmp_path, teacher, where, extra
):
    start_local_ray()
    clean = _run(tmp_path / "clean", teacher, extra)
    killed = _run(tmp_path / "killed", teacher, extra, kill_in=where)
    verdict = compare_runs(clean, killed)
    assert killed["recoveries"], killed["printed"]  # the kill happened and was recovered
    assert verdict["weights_identical"] and verdict["metrics_identical"], verdict
    assert verdict["ledger_identical"] and not verdict["trained_twice"], verdict
    assert clean["history"][-1]["distillation/abs_loss"] > 0
