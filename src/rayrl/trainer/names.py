"""Names in a config that pick a registered implementation, checked before Ray starts.

`check_names(cfg)` looks every such name up in the registry that serves it (advantage
estimators, policy losses, KL estimators and controllers, PF-PPO reweight methods, loss
aggregations, LR schedules, rollout engines, tool-call formats, environments, trackers,
synthetic tasks, rollout rejection options with their thresholds) and raises
`ConfigError` with the key, a "did you mean" and the valid names. It runs when the
command line loads a config and again when a trainer is built, so a misspelt name costs
seconds, not a cluster start. `check_sft_names` does the same for `rayrl sft`'s config.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rayrl.algos import (
    ADV_ESTIMATORS,
    AGG_MODES,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    PF_PPO_WEIGHTS,
    POLICY_LOSSES,
    parse_rejection,
)
from rayrl.config.errors import ConfigError
from rayrl.config.pref import PrefConfig
from rayrl.config.schema import RayRLConfig
from rayrl.config.sft import SFTConfig
from rayrl.data import SYNTHETIC_TASKS, VISUAL_TASKS
from rayrl.envs import ENVIRONMENTS, TOOL_PARSERS
from rayrl.registry import Registry
from rayrl.rewards.managers import REWARD_MANAGERS
from rayrl.rollout import AUTO, ROLLOUT_ENGINES
from rayrl.train.optim import LR_SCHEDULES
from rayrl.trainer.data import LOADERS
from rayrl.trainer.tracking import TRACKERS


def _named(cfg: RayRLConfig) -> Iterable[tuple[str, str, Registry[Any]]]:
    """(config key, value, registry) for every registry-backed name of a config."""
    arr, alg = cfg.actor_rollout_ref, cfg.algorithm
    actor = "actor_rollout_ref.actor"
    yield "algorithm.adv_estimator", alg.adv_estimator, ADV_ESTIMATORS
    yield "algorithm.kl_penalty", alg.kl_penalty, KL_ESTIMATORS
    yield "algorithm.kl_ctrl.type", alg.kl_ctrl.type, KL_CONTROLLERS
    yield "algorithm.pf_ppo.reweight_method", alg.pf_ppo.reweight_method, PF_PPO_WEIGHTS
    yield f"{actor}.policy_loss.loss_mode", arr.actor.policy_loss.loss_mode, POLICY_LOSSES
    yield f"{actor}.kl_loss_type", arr.actor.kl_loss_type, KL_ESTIMATORS
    yield f"{actor}.loss_agg_mode", arr.actor.loss_agg_mode, AGG_MODES
    yield "critic.loss_agg_mode", cfg.critic.loss_agg_mode, AGG_MODES
    yield f"{actor}.optim.lr_scheduler_type", arr.actor.optim.lr_scheduler_type, LR_SCHEDULES
    yield "critic.optim.lr_scheduler_type", cfg.critic.optim.lr_scheduler_type, LR_SCHEDULES
    yield "actor_rollout_ref.rollout.name", arr.rollout.name, ROLLOUT_ENGINES
    yield "data.loader", cfg.data.loader, LOADERS
    yield "reward.reward_manager.name", cfg.reward.reward_manager.name, REWARD_MANAGERS
    multi_turn, agent = arr.rollout.multi_turn, arr.rollout.agent.default_agent_loop
    yield "actor_rollout_ref.rollout.multi_turn.format", multi_turn.format, TOOL_PARSERS
    if not any(c in agent for c in ".:/"):  # else a user's class, loaded by the workers
        yield "actor_rollout_ref.rollout.agent.default_agent_loop", agent, ENVIRONMENTS
    for tracker in cfg.trainer.logger:
        yield "trainer.logger", tracker, TRACKERS


def check_names(cfg: RayRLConfig) -> None:
    """Raise ConfigError for the first name no registry knows."""
    for key, value, registry in _named(cfg):
        if value not in registry and not (registry is ROLLOUT_ENGINES and value == AUTO):
            raise ConfigError(f"{key}={value!r}: {registry.unknown_message(value, key)}")
    task, tasks = cfg.data.synthetic_task, (*SYNTHETIC_TASKS, *VISUAL_TASKS)
    if not cfg.data.train_files and task not in tasks:
        raise ConfigError(
            f"data.synthetic_task={task!r} is not one of {', '.join(tasks)} "
            "(used when data.train_files is empty)"
        )
    check_rejection(cfg)


def check_rejection(cfg: RayRLConfig) -> None:
    """`algorithm.rollout_correction.rollout_rs`: known options, each with a threshold
    (`rayrl.algos.rejection`)."""
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_rs is None:
        return
    try:
        parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_sft_names(cfg: SFTConfig | PrefConfig, visual: bool = True) -> None:
    """`rayrl sft`'s registry-backed names: the LR schedule, trackers, synthetic task
    (`rayrl rm`'s and `rayrl dpo`'s too, whose pairs have no images: `visual=False`)."""
    named: list[tuple[str, str, Registry[Any]]] = [
        ("optim.lr_scheduler", cfg.optim.lr_scheduler, LR_SCHEDULES)
    ]
    named += [("trainer.logger", tracker, TRACKERS) for tracker in cfg.trainer.logger]
    for key, value, registry in named:
        if value not in registry:
            raise ConfigError(f"{key}={value!r}: {registry.unknown_message(value, key)}")
    task = cfg.data.synthetic_task
    tasks = (*SYNTHETIC_TASKS, *(VISUAL_TASKS if visual else ()))
    if not cfg.data.train_files and task not in tasks:
        raise ConfigError(
            f"data.synthetic_task={task!r} is not one of {', '.join(tasks)} "
            "(used when data.train_files is empty)"
        )


def check_pref_names(cfg: PrefConfig) -> None:
    """`rayrl rm`'s and `rayrl dpo`'s names: `rayrl sft`'s and the objective."""
    from rayrl.algos.preference import PREFERENCE_LOSSES

    check_sft_names(cfg, visual=False)
    name = cfg.objective.name
    if name is not None and name not in PREFERENCE_LOSSES:
        raise ConfigError(
            f"objective.name={name!r}: {PREFERENCE_LOSSES.unknown_message(name, 'objective.name')}"
        )
