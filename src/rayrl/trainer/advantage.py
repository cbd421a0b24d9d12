"""The step's stages on the controller between scoring and the updates: reward shaping,
truncation masking, the KL penalty with its controller, the rollout correction's batch
normaliser and rejection, advantages, and PF-PPO.

`shape_rewards` adds DAPO's soft overlong penalty to the scores as soon as they arrive
(so dynamic sampling and the metrics see the reward the policy is trained on).
`AdvantageStage` then masks responses cut at the length limit (DAPO), subtracts the KL
penalty whose coefficient the `algorithm.kl_ctrl` controller steers (fixed or
adaptive), masks the tokens that rollout rejection sampling rejects
(`algorithm.rollout_correction.rollout_rs`), and runs the configured estimator over
prompt groups (`uid`), with each
prompt's greedy reward as the baseline for ReMax. With `algorithm.use_pf_ppo` (and GAE,
as in verl) it then resamples the batch's rows by score (PF-PPO), drawing from a stream
seeded by the run's seed and the step, so a replayed step draws the same rows. All of it
is plain tensor work: no Ray, no workers.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rayrl.algos import (
    ADV_ESTIMATORS,
    aggregate_loss,
    aggregate_rows,
    apply_kl_penalty,
    compute_advantages,
    is_batch_norm_factor,
    make_kl_controller,
    overlong_penalty,
    parse_rejection,
    pf_ppo_resample,
    rejection_mask,
    truncated_is_weights,
)
from rayrl.batch import Batch
from rayrl.config.schema import RayRLConfig
from rayrl.rollout.contract import FINISH_LENGTH
from rayrl.trainer.metrics import spread
from rayrl.trainer.per_sequence import per_sequence_advantages


def shape_rewards(cfg: RayRLConfig, batch: Batch) -> dict[str, float]:
    """Add the overlong penalty (`reward_model.overlong_buffer`) to `token_level_scores`
    and `scores` in place; returns its metric when `overlong_buffer.log` is set."""
    buffer = cfg.reward_model.overlong_buffer
    if not buffer.enable:
        return {}
    mask = batch["response_mask"]
    lengths = mask.sum(-1)
    penalty = overlong_penalty(lengths, buffer.max_resp_len, buffer.len, buffer.penalty_factor).to(
        batch["scores"].dtype
    )
    last = (lengths - 1).clamp(min=0).long()
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    scores = batch["token_level_scores"].clone()
    scores[rows, last[rows]] += penalty[rows]
    batch["token_level_scores"], batch["scores"] = scores, batch["scores"] + penalty
    return {"reward/overlong_penalty/mean": float(penalty.mean())} if buffer.log else {}


# Scores this large are almost always a bug in the reward function (or a unit mix-up).
EXTREME_SCORE = 1e4


def warn_extreme_scores(scores: torch.Tensor, print_fn: Callable[[str], None]) -> bool:
    """Say so (a WARNING line) when some scores are beyond +-`EXTREME_SCORE`: GRPO's group
    statistics cope, but GAE, the KL penalty's balance and the logged rewards do not."""
    extreme = scores.abs() > EXTREME_SCORE
    if not bool(extreme.any()):
        return False
    print_fn(
        f"WARNING: reward: {int(extreme.sum())} of {len(scores)} scores are beyond "
        f"+-{EXTREME_SCORE:g} (largest magnitude {float(scores.abs().max()):.3g}); check "
        "the reward function's scale (custom_reward_function.path)"
    )
    return True


def greedy_baselines(batch: Batch, greedy: Batch) -> torch.Tensor:
    """Each sample's ReMax baseline ``[batch]``: the score of its prompt's greedy response."""
    by_uid = dict(zip(greedy["uid"], greedy["scores"].tolist(), strict=True))
    missing = sorted({u for u in batch["uid"] if u not in by_uid})
    if missing:
        raise ValueError(f"no greedy baseline for prompt uid(s) {missing[:3]}")
    return torch.tensor([by_uid[u] for u in batch["uid"]], dtype=torch.float32)


class AdvantageStage:
    """Truncation masking, KL penalty, advantages and returns for one config."""

    def __init__(self, cfg: RayRLConfig) -> None:
        self.cfg = cfg
        k, rc = cfg.algorithm.kl_ctrl, cfg.algorithm.rollout_correction
        self.kl_ctrl = make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.rejection_rules = (
            parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold) if rc.rollout_rs else ()
        )

    def __call__(self, batch: Batch) -> dict[str, float]:
        """Adds `token_level_rewards`, `advantages`, `returns` to `batch`; its metrics.
        As in verl, the rollout correction (importance weights, then rejection) comes
        after the KL penalty and before the advantages, which see the rejection's mask."""
        alg, metrics = self.cfg.algorithm, {}
        if alg.mask_truncated_samples:
            metrics.update(self._mask_truncated(batch))
        per_sequence = self.per_sequence and "response_mask" in batch.remote
        rewards = None if per_sequence else self._kl_penalty(batch, metrics)
        is_weights = None if per_sequence else self._rollout_is_weights(batch)
        metrics.update(self._rollout_is_norm(batch))
        metrics.update(self._reject(batch))
        if per_sequence:
            metrics.update(per_sequence_advantages(self.cfg, batch))
            return metrics
        adv, returns = compute_advantages(
            alg.adv_estimator,
            token_level_rewards=rewards,
            response_mask=batch["response_mask"],
            index=batch["uid"],
            values=batch.get("values"),
            reward_baselines=batch.get("reward_baselines"),
            gamma=alg.gamma,
            lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            old_log_probs=batch.get("old_log_probs"),
            sum_pi_squared=batch.get("sum_pi_squared"),
            rollout_is_weights=is_weights,
        )
        batch["token_level_rewards"], batch["advantages"], batch["returns"] = rewards, adv, returns
        if is_weights is not None:  # for the variance proxy metrics (trainer.metrics)
            batch["rollout_is_weights"] = is_weights
        if alg.use_pf_ppo and alg.adv_estimator == "gae":
            metrics.update(self._pf_ppo(batch))
        mask = batch["response_mask"]
        metrics.update(spread("critic/advantages", batch["advantages"], mask))
        metrics.update(spread("critic/returns", batch["returns"], mask))
        return metrics

    @property
    def per_sequence(self) -> bool:
        """Whether the advantages can be computed from one score per row on the
        controller and broadcast onto the tokens by the update's ranks: the estimator
        is one of those that allow it (``per_sequence``), no KL term is in the reward,
        and the step's token columns stay with the workers (`trainer.rows_on_workers`).
        A step then does so while its response mask is with the workers (a masking
        step that changed it on the controller leaves per-token advantages)."""
        alg = self.cfg.algorithm
        return (
            bool(ADV_ESTIMATORS.info(alg.adv_estimator).get("per_sequence"))
            and not alg.use_kl_in_reward
            and self.cfg.trainer.rows_on_workers
        )

    def _kl_penalty(self, batch: Batch, metrics: dict[str, float]) -> torch.Tensor:
        """The token rewards: the scores, less the KL penalty when it is in the reward
        (`algorithm.use_kl_in_reward`, whose controller it updates)."""
        alg, rewards = self.cfg.algorithm, batch["token_level_scores"]
        if not alg.use_kl_in_reward:
            return rewards
        rewards, kl = apply_kl_penalty(
            rewards,
            batch["old_log_probs"],
            batch["ref_log_prob"],
            batch["response_mask"],
            self.kl_ctrl.value,
            estimator=alg.kl_penalty,
        )
        self.kl_ctrl.update(float(kl["reward_kl_penalty"]), n_steps=len(batch))
        metrics.update({f"actor/{k}": float(v) for k, v in kl.items()})
        return rewards

    def _reject(self, batch: Batch) -> dict[str, float]:
        """verl's rollout rejection sampling (`algorithm.rollout_correction.rollout_rs`,
        `rayrl.algos.rejection`) on the old vs rollout log-probs: the rejected tokens
        leave `response_mask`, so the advantages, the critic's and the actor's losses
        and their token counts all go without them. The mask before it stays as
        `rollout_is_mask` when importance weights are on: verl computes them over it.
        Bypass mode rejects in the actor's loss instead, against the current policy."""
        rc = self.cfg.algorithm.rollout_correction
        if rc.rollout_rs is None or rc.bypass_mode:
            return {}
        missing = {"old_log_probs", "rollout_log_probs"} - set(batch.keys())
        if missing:
            raise ValueError(
                f"algorithm.rollout_correction.rollout_rs={rc.rollout_rs} needs the batch's "
                f"{sorted(missing)} (actor_rollout_ref.rollout.calculate_log_probs=true and "
                "the old log-prob pass)"
            )
        mask = batch["response_mask"]
        log_ratio = batch["old_log_probs"] - batch["rollout_log_probs"]
        kept, found = rejection_mask(log_ratio, mask, self.rejection_rules)
        if rc.rollout_is is not None:
            batch["rollout_is_mask"] = mask
        batch["response_mask"] = kept
        return {f"rollout_corr/{key}": value for key, value in found.items()}

    def _rollout_is_weights(self, batch: Batch) -> torch.Tensor | None:
        """The truncated importance weights of `algorithm.rollout_correction`, for the
        estimators that take them (the optimal token baseline); None when off."""
        rc, estimator = self.cfg.algorithm.rollout_correction, self.cfg.algorithm.adv_estimator
        takes = inspect.signature(ADV_ESTIMATORS.get(estimator)).parameters
        needed = {"old_log_probs", "rollout_log_probs"}
        if (
            rc.rollout_is is None
            or "rollout_is_weights" not in takes
            or not needed <= set(batch.keys())
        ):
            return None
        return self._truncated_weights(batch, rc.rollout_is)

    def _truncated_weights(self, batch: Batch, level: str) -> torch.Tensor:
        """`algorithm.rollout_correction`'s truncated importance weights of the batch
        (`level`: its `rollout_is`)."""
        rc = self.cfg.algorithm.rollout_correction
        weights, _ = truncated_is_weights(
            batch["old_log_probs"],
            batch["rollout_log_probs"],
            batch["response_mask"],
            cap=rc.rollout_is_threshold,
            level=level,
        )
        return weights

    def _rollout_is_norm(self, batch: Batch) -> dict[str, float]:
        """verl's `rollout_is_batch_normalize`: the mean of the whole batch's truncated
        importance weights, as a `rollout_is_norm` column (one value per row) that the
        actor's loss divides each weight by; none when off."""
        rc = self.cfg.algorithm.rollout_correction
        needed = {"old_log_probs", "rollout_log_probs"}
        if rc.rollout_is is None or not rc.rollout_is_batch_normalize or rc.bypass_mode:
            return {}  # bypass mode normalises in the loss, against the current policy
        if not needed <= set(batch.keys()):
            return {}
        weights = self._truncated_weights(batch, rc.rollout_is)
        factor = is_batch_norm_factor(weights, batch["response_mask"], rc.rollout_is)
        batch["rollout_is_norm"] = torch.full((len(batch),), factor)
        return {"rollout_corr/rollout_is_batch_norm_factor": factor}

    def _pf_ppo(self, batch: Batch) -> dict[str, float]:
        """PF-PPO: the batch's rows replaced, in place, by a draw with replacement weighted
        by each response's score (`algorithm.pf_ppo`), seeded by run seed and step."""
        if "step" not in batch.meta:
            raise ValueError("PF-PPO resampling needs the batch's meta 'step' (the training step)")
        pf, step = self.cfg.algorithm.pf_ppo, int(batch.meta["step"])
        seed = random.Random(f"{self.cfg.trainer.seed}:pf_ppo:{step}").getrandbits(63)
        rows = pf_ppo_resample(
            batch["token_level_scores"].sum(dim=-1),
            pf.reweight_method,
            pf.weight_pow,
            generator=torch.Generator().manual_seed(seed),
        )
        drawn = batch.index(rows).materialize()
        batch.remote.clear()
        batch.tensors.clear()
        batch.tensors.update(drawn.tensors)
        batch.non_tensors.clear()
        batch.non_tensors.update(drawn.non_tensors)
        return {"pf_ppo/unique_fraction": len(set(rows.tolist())) / max(len(rows), 1)}

    def _mask_truncated(self, batch: Batch) -> dict[str, float]:
        """DAPO: responses cut at the length limit take no part in the loss."""
        truncated = torch.from_numpy(np.asarray(batch["finish_reason"]) == FINISH_LENGTH)
        keep = (~truncated).unsqueeze(-1).to(batch["response_mask"].dtype)
        batch["response_mask"] = batch["response_mask"] * keep
        return {"response_length/masked_truncated": float(truncated.sum())}

    def state_dict(self) -> dict[str, dict[str, float]]:
        """What a checkpoint keeps: the KL controller's coefficient."""
        return {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])


def entropy_metric(cfg: RayRLConfig, old: Batch, batch: Batch) -> dict[str, float]:
    """`actor/entropy` of the sampling policy over the batch, aggregated as the loss is:
    from each row's entropy sum (`entropy_sum` of the log-prob pass) and length when
    the batch has them, else from the token entropies and the response mask."""
    mode, norm = cfg.actor_rollout_ref.actor.loss_agg_mode, cfg.data.max_response_length
    if "entropy_sum" in old and "response_length" in batch:
        counts = batch["response_length"]
        value = aggregate_rows(old["entropy_sum"], counts, mode, norm_length=norm)
    else:
        value = aggregate_loss(old["entropy"], batch["response_mask"], mode, norm_length=norm)
    return {"actor/entropy": float(value)}
