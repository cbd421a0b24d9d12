"""`trainer.rows_on_workers`: GRPO steps whose token columns stay with the workers train
bitwise the same weights as steps that bring every column to the driver, and the
driver carries a small part of the bytes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import start_local_ray
from rayrl.config import load_config
from rayrl.controller import traffic
from rayrl.testing.chaos import deterministic, final_weights
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run

pytestmark = pytest.mark.slow

RUN = [
    "data.train_batch_size=4",
    "data.max_response_length=16",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # two mini-batches: old log-probs
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=true",  # the reference runs
    "trainer.n_gpus_per_node=2",
    "trainer.device=cpu",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.logger=[]",
    "reward.colocate=false",
]


def _run(out: Path, on_workers: bool) -> dict:
    cfg = load_config(
        "grpo", [*RUN, f"trainer.output_dir={out}", f"trainer.rows_on_workers={on_workers}"]
    )
    run = Run(PPOTrainer(cfg, print_fn=lambda line: None))
    try:
        run.setup()
        with traffic.counting() as seen:
            history = run.fit()
    finally:
        run.shutdown()
    return {"history": history, "weights": final_weights(out), "bytes": seen.total}


def test_kept_rows_train_the_same_weights_with_a_fraction_of_the_driver_bytes(tmp_path):
    start_local_ray()
    driver = _run(tmp_path / "driver", on_workers=False)
    kept = _run(tmp_path / "kept", on_workers=True)
    assert driver["weights"].keys() == kept["weights"].keys()
    for name, tensor in driver["weights"].items():
        assert tensor.equal(kept["weights"][name]), name
    for a, b in zip(driver["history"], kept["history"], strict=True):
        a, b = deterministic(a), deterministic(b)
        assert a.keys() == b.keys()
        for key, value in a.items():  # per-row sums instead of token columns: rounding
            assert math.isclose(value, b[key], rel_tol=1e-9, abs_tol=1e-12) or (
                math.isnan(value) and math.isnan(b[key])
            ), key
    assert kept["bytes"] < driver["bytes"] / 2
