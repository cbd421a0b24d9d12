"""A step as stages (`rayrl.trainer.stages`): a group stage sends the columns it reads
and joins the ones it keeps; the PPO trainer's list follows its config and roles."""

from __future__ import annotations

import pytest
import torch

from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.trainer.ride_along import Riding
from rayrl.trainer.roles import Roles
from rayrl.trainer.stage_calls import StageCalls
from rayrl.trainer.stages import GroupStage, LocalStage, run_stages, update_stage
from rayrl.trainer.step_state import StepState


class Future:
    def __init__(self, value) -> None:
        self.value = value

    def get(self, timeout=None, collect=None):
        return self.value


class Method:
    """A group method stand-in: records what each call was sent; returns `result(sent)`."""

    def __init__(self, result) -> None:
        self.result, self.sent = result, []
        self._owner = type("G", (), {"name": "actor"})()

    def remote(self, *args):
        self.sent.append(args)
        return Future(self.result(*args))

    def keeping(self, driver=None):
        return self


def _samples() -> Batch:
    batch = Batch({"input_ids": torch.ones(2, 3), "response_mask": torch.ones(2, 2)})
    batch.meta["step"] = 0
    return batch


def _state(batch: Batch) -> StepState:
    state = StepState.begin(batch, StageCalls())
    state.batch = batch
    return state


def test_a_group_stage_sends_its_reads_and_joins_what_it_keeps():
    def log_probs(sent):
        n = len(sent)
        return Batch({"old_log_probs": torch.zeros(n, 2), "entropy": torch.ones(n, 2)})

    method = Method(log_probs)
    state = _state(_samples())
    stage = GroupStage("old", method, ("response_mask", "absent"), keep=("old_log_probs",))
    stage.run(state)
    (sent,) = method.sent[0]
    assert set(sent.keys()) == {"response_mask"}  # not input_ids; an absent read left out
    assert set(state.samples.keys()) == {"input_ids", "response_mask", "old_log_probs"}
    assert "old" in state.timing


def test_an_update_stage_is_sent_the_context_returns_metrics_and_may_sit_out_a_step():
    method = Method(lambda sent, ctx: {"actor/loss": float(ctx.step)})
    state = _state(_samples())
    state.ctx = state.ctx.but(step=3)
    learns = update_stage("update_actor", method, ("input_ids",), when=lambda s: s.ctx.step >= 2)
    run_stages([learns], state)
    assert state.metrics == {"actor/loss": 3.0}
    assert set(method.sent[0][0].keys()) == {"input_ids"} and method.sent[0][1].step == 3
    state.ctx = state.ctx.but(step=1)
    learns.run(state)
    assert len(method.sent) == 1  # the warm-up step did not call it


def test_a_local_stage_is_timed_under_its_key_only_when_given():
    state = _state(_samples())
    run_stages([LocalStage("a", lambda s: None, "adv"), LocalStage("b", lambda s: None)], state)
    assert set(state.timing) == {"adv"}


def _trainer(tmp_path, *overrides: str, critic: bool = False, riding: Riding = Riding()):
    from rayrl.models import build_tiny_model
    from rayrl.trainer.ppo import PPOTrainer

    model = build_tiny_model(tmp_path / "m", layers=1, hidden=32)
    name = "ppo" if critic else "grpo"
    no_kl = "actor_rollout_ref.actor.use_kl_loss=false"  # grpo's config has it on
    cfg = load_config(name, [f"actor_rollout_ref.model.path={model}", no_kl, *overrides])
    trainer = PPOTrainer(cfg)
    group = type("Group", (), {"__getattr__": lambda self, name: Method(lambda *a: None)})()
    roles = Roles(group, group, group if critic else None, group, [])  # type: ignore[arg-type]
    trainer.roles, trainer.riding = roles, riding
    return trainer


@pytest.mark.parametrize(
    "overrides, critic, riding, names",
    [
        ((), False, Riding(), ["gen", "reward_start", "old_log_prob", "reward", "adv"]),
        ((), False, Riding(scores=True), ["gen", "scores_ridden", "old_log_prob", "adv"]),
        (
            ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"),
            False,
            Riding(),
            ["gen", "dynamic_sampling", "old_log_prob", "adv"],
        ),
        (
            ("algorithm.adv_estimator=remax",),
            False,
            Riding(),
            ["gen", "reward_start", "gen_baseline", "old_log_prob", "reward", "adv"],
        ),
        (
            ("actor_rollout_ref.actor.use_kl_loss=true",),
            False,
            Riding(),
            ["gen", "reward_start", "old_log_prob", "ref", "reward", "adv"],
        ),
        (
            ("actor_rollout_ref.actor.use_kl_loss=true",),
            False,
            Riding(scores=True, ref=True),
            ["gen", "scores_ridden", "old_log_prob", "adv"],
        ),
        (
            ("algorithm.use_kl_in_reward=false",),
            True,
            Riding(),
            ["gen", "reward_start", "old_log_prob", "values", "reward", "adv", "update_critic"],
        ),
    ],
)
def test_the_ppo_step_runs_the_stages_its_config_and_roles_need(
    tmp_path, overrides, critic, riding, names
):
    trainer = _trainer(tmp_path, *overrides, critic=critic, riding=riding)
    assert [stage.name for stage in trainer.stages()] == [*names, "update_actor"]
