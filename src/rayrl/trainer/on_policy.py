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
- rollout correction (`algorithm.rollout_correction.rollout_is` / `rollout_rs`: weights
  or rejection from old vs rollout log-probs);
- dynamic sampling (`algorithm.filter_groups`: the batch is assembled over several
  generation rounds and trimmed, so its size is not known when the step starts);
- a critic (PPO with GAE): such runs keep the separate pass, as verl's do.
"""

from __future__ import annotations

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
    if alg.rollout_correction.rollout_is is not None:
        return "rollout correction weighs by them"
    if alg.rollout_correction.rollout_rs is not None:
        return "rollout rejection sampling compares them with the rollout's"
    if alg.filter_groups.enable:
        return "dynamic sampling assembles the batch over several rounds"
    if critic_enabled(cfg):
        return "a critic is trained (PPO with GAE keeps the separate pass)"
    return None
