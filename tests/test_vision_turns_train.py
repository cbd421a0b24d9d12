"""A vision-language policy in multi-turn and asynchronous rollouts through `rayrl train`
(issue 48), with the vision demo's config (`demo_vision`: the synthetic `colors` task,
the hf engine, GRPO) on the tiny Qwen2.5-VL, one step each, on real Ray:

- multi-turn, synchronous (the hybrid actor's rollout): every turn answered by the
  built-in ``look`` tool with an image (`vision_turn_cases.LookEnvironment`);
- ``rollout.mode=async``, single turns: the prompts' images go to the replica and
  come back with its samples;
- async x multi-turn x images together.

Each step trains on the rollout's exact tokens (``rollout/token_mismatch`` 0, no loss on
tool tokens) and the actor's probabilities of the response tokens are the rollout's
(``training/rollout_probs_diff_max``, verl's |p_rollout - p_actor|: about 1e-9 in fp32
on a CPU; a training forward without the observations' images gives about 2e-4, so
the bound is `PROBS_DIFF`).
"""

from __future__ import annotations

import json

import pytest

from rayrl.cli.main import main
from vision_cases import sharp_vision_model
from vision_turn_cases import ENVIRONMENT, ending_turns_often

pytestmark = pytest.mark.slow

MT = "actor_rollout_ref.rollout.multi_turn"
PROBS_DIFF = 1e-6
ONE_STEP = [
    "data.train_batch_size=2",
    "data.synthetic_size=8",
    "data.synthetic_val_size=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "trainer.total_training_steps=1",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.device=cpu",
    "trainer.logger=[jsonl]",
]
ASYNC = [
    "actor_rollout_ref.rollout.mode=async",
    "rollout.n_gpus_per_node=1",
    "async_training.trigger_parameter_sync_step=1",
    "async_training.staleness_threshold=0",
    "async_training.partial_rollout=false",
]
TURNS = [
    "data.max_response_length=64",
    f"{MT}.enable=true",
    f"{MT}.tools=[look]",
    f"{MT}.max_assistant_turns=3",
    f"actor_rollout_ref.rollout.agent.default_agent_loop={ENVIRONMENT}",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny Qwen2.5-VL, its turns ending often (one id in 20 is an EOS)."""
    root = tmp_path_factory.mktemp("vl-turns-train")
    return ending_turns_often(sharp_vision_model(root), root / "eos")


def _step(model, out, *extra: str) -> dict:
    args = ["train", "-c", "demo_vision", f"actor_rollout_ref.model.path={model}"]
    assert main([*args, *ONE_STEP, f"trainer.output_dir={out}", *extra]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "timing_s/step" in row]
    assert len(steps) == 1
    return steps[0]


def _episodes_trained_exactly(step: dict) -> None:
    assert step["tool/look/calls"] > 0 and step["tool/look/errors"] == 0
    assert step["multi_turn/num_turns/max"] >= 3  # an observation between two turns
    assert step["rollout/token_mismatch"] == 0 and step["multi_turn/loss_on_tool_tokens"] == 0
    assert step["training/rollout_probs_diff_max"] < PROBS_DIFF


def test_multi_turn_episodes_shown_images_train_one_step(ray_local, model, tmp_path):
    step = _step(model, tmp_path / "run", *TURNS)
    _episodes_trained_exactly(step)


def test_an_async_step_carries_the_prompts_images_to_the_replica(ray_local, model, tmp_path):
    step = _step(model, tmp_path / "run", *ASYNC)
    assert step["async/replicas"] == 1 and step["async/staleness/max"] == 0
    assert step["training/rollout_probs_diff_max"] < PROBS_DIFF


def test_async_multi_turn_episodes_shown_images_train_one_step(ray_local, model, tmp_path):
    step = _step(model, tmp_path / "run", *ASYNC, *TURNS)
    assert step["async/replicas"] == 1
    _episodes_trained_exactly(step)


def test_an_async_replica_on_the_native_engine_rolls_out_the_prompts_images(
    ray_local, model, tmp_path
):
    """The native engine's vision tower on an asynchronous replica: the images reach its
    prefill (the actor's log-probs are the rollout's), the tower's weights every sync."""
    step = _step(model, tmp_path / "run", *ASYNC, "actor_rollout_ref.rollout.name=native")
    assert step["async/replicas"] == 1 and step["async/staleness/max"] == 0
    assert step["training/rollout_probs_diff_max"] < PROBS_DIFF
