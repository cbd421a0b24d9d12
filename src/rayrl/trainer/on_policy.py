"""The on-policy shortcut: a step whose actor update is one optimizer step skips the
separate pass that computes `old_log_probs`.

With `ppo_epochs == 1` and the step's samples in one mini-batch, the update's forward
runs on exactly the weights that sampled the responses (the rollout's, after the last
sync) and computes the log-probs of the same tokens; dropout is off in every rayrl
model (`rayrl.train.loading`), so its detached log-probs *are* the old ones,
bitwise. The actor then uses them in place of `old_log_probs` (the ratio is exactly 1,
as in verl's and TRL's on-policy paths) and `timing_s/old_log_prob` is 0.

The separate pass still runs whenever something needs `old_log_probs` before the
update, or the update is not a single step on them:

- several PPO epochs or mini-batches (the later ones are off-policy);
- the KL penalty in the reward (`algorithm.use_kl_in_reward` reads old vs ref
  log-probs to shape the rewards before the advantages);
- rollout rejection (`algorithm.rollout_correction.rollout_rs`: tokens dropped from the
  advantages by old vs rollout log-probs) and the batch-normalised importance weights
  (`rollout_is_batch_normalize`: the whole batch's mean weight, before the update);
  plain truncated importance weights (`rollout_is` token or sequence) need no pass: the
  loss computes them from the forward's own detached log-probs, and the update reports
  verl's `training/rollout_probs_diff_*` from them as the pass would;
- an advantage estimator that reads them (the optimal token baseline), or
  `actor.calculate_sum_pi_squared` (each token's sum of squared probabilities, which
  only the pass returns);
- dynamic sampling (`algorithm.filter_groups`: the batch is assembled over several
  generation rounds and trimmed, so its size is not known when the step starts);
- a critic (PPO with GAE): such runs keep the separate pass, as verl's do;
- routing replay R2 (`actor.router_replay.mode`): the pass records the routing of a
  mixture of experts that the update replays.
"""

from __future__ import annotations

import inspect

from rayrl.algos.advantages import ADV_ESTIMATORS
from rayrl.config.schema import RayRLConfig
from rayrl.config.validate import critic_enabled


def separate_pass_reason(cfg: RayRLConfig, samples: int) -> str | None:
    """Why a step of `samples` samples needs the separate old-log-prob pass, or None
    when the actor update's own log-probs serve (the shortcut)."""
    a, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    mini_batch = a.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    if a.ppo_epochs != 1:
        return f"{a.ppo_epochs} PPO epochs"
    if samples > mini_batch:
        return f"{samples} samples make several mini-batches of {mini_batch}"
    if alg.use_kl_in_reward:
        return "the KL penalty in the reward reads them"
    correction = alg.rollout_correction
    if correction.rollout_is is not None and correction.rollout_is_batch_normalize:
        return "rollout correction normalises its weights over the whole batch"
    if correction.rollout_rs is not None:
        return "rollout rejection sampling compares them with the rollout's"
    if "old_log_probs" in inspect.signature(ADV_ESTIMATORS.get(alg.adv_estimator)).parameters:
        return f"the advantage estimator {alg.adv_estimator} reads them"
    if a.calculate_sum_pi_squared:
        return "actor.calculate_sum_pi_squared: the pass returns each token's sum_pi_squared"
    if alg.filter_groups.enable:
        return "dynamic sampling assembles the batch over several rounds"
    if critic_enabled(cfg):
        return "a critic is trained (PPO with GAE keeps the separate pass)"
    if a.router_replay.mode == "R2":
        return "router_replay.mode=R2 records in it the routing the update replays"
    return None
