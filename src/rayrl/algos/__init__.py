"""The RL algorithm core: pure tensor functions, registered by name for the config.

Tensors are ``[batch, response_len]`` with a ``response_mask`` (1 for real response
tokens); nothing here knows about Ray, workers or models.

- :mod:`~rayrl.algos.advantages`: ``ADV_ESTIMATORS`` (gae, grpo, dr_grpo, rloo,
  reinforce_plus_plus, reinforce_plus_plus_baseline, remax, gpg) and
  ``compute_advantages``; :mod:`~rayrl.algos.token_baseline` registers
  optimal_token_baseline.
- :mod:`~rayrl.algos.losses`: ``POLICY_LOSSES`` (ppo, gspo, reinforce/gpg, geo_mean,
  cispo, sapo) and ``value_loss``.
- :mod:`~rayrl.algos.pf_ppo`: PF-PPO's score-weighted resampling of a batch.
- :mod:`~rayrl.algos.aggregation`: loss aggregation modes that keep a mini-batch's loss
  and gradient independent of micro-batch and data-parallel splits (read its docstring).
- :mod:`~rayrl.algos.correction`: truncated importance weights for rollout/training
  log-prob mismatch.
- :mod:`~rayrl.algos.rejection`: ``REJECTION_OPTIONS`` and the rejection mask that drops
  tokens or responses whose rollout/training log-probs diverge too much.
- :mod:`~rayrl.algos.kl`: KL estimators, KL reward penalty, KL loss, controllers.
- :mod:`~rayrl.algos.entropy`: chunked log-probs and entropy from logits.
- :mod:`~rayrl.algos.dapo`: overlong penalty, truncation masking, group filtering.
- :mod:`~rayrl.algos.masked`, :mod:`~rayrl.algos.groups`: masked and per-group statistics.
"""

from rayrl.algos.advantages import (
    ADV_ESTIMATORS,
    broadcast_scores,
    compute_advantages,
    dr_grpo_advantages,
    expand_advantages,
    gae_advantages,
    gpg_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    sequence_scores,
    token_rewards,
)
from rayrl.algos.aggregation import AGG_MODES, LossAggregation, aggregate_loss, aggregate_rows
from rayrl.algos.correction import is_batch_norm_factor, truncated_is_weights
from rayrl.algos.dapo import filter_groups, find_truncated, mask_truncated, overlong_penalty
from rayrl.algos.entropy import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits
from rayrl.algos.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_divergence,
    kl_loss,
    make_kl_controller,
)
from rayrl.algos.losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    cispo_policy_loss,
    geo_mean_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    reinforce_policy_loss,
    sapo_policy_loss,
    value_loss,
)
from rayrl.algos.masked import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    token_and_seq_counts,
)
from rayrl.algos.pf_ppo import PF_PPO_WEIGHTS, pf_ppo_resample, pf_ppo_weights
from rayrl.algos.rejection import (
    REJECTION_OPTIONS,
    RejectionRule,
    parse_rejection,
    rejection_mask,
)
from rayrl.algos.token_baseline import optimal_token_baseline_advantages, path_variance_weights
from rayrl.registry import Registry, UnknownNameError

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "PF_PPO_WEIGHTS",
    "POLICY_LOSSES",
    "REJECTION_OPTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "LossAggregation",
    "PolicyLossConfig",
    "Registry",
    "RejectionRule",
    "UnknownNameError",
    "aggregate_loss",
    "aggregate_rows",
    "apply_kl_penalty",
    "cispo_policy_loss",
    "broadcast_scores",
    "compute_advantages",
    "expand_advantages",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "filter_groups",
    "find_truncated",
    "gae_advantages",
    "geo_mean_policy_loss",
    "gpg_advantages",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_divergence",
    "kl_loss",
    "log_probs_and_entropy",
    "log_probs_from_logits",
    "make_kl_controller",
    "mask_truncated",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "optimal_token_baseline_advantages",
    "overlong_penalty",
    "parse_rejection",
    "path_variance_weights",
    "pf_ppo_resample",
    "pf_ppo_weights",
    "ppo_policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "reinforce_policy_loss",
    "rejection_mask",
    "remax_advantages",
    "rloo_advantages",
    "sapo_policy_loss",
    "sequence_scores",
    "token_and_seq_counts",
    "token_rewards",
    "is_batch_norm_factor",
    "truncated_is_weights",
    "value_loss",
]
