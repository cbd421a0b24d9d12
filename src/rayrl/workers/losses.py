"""The actor's and the critic's loss functions, built from the config and `rayrl.algos`.

Each builder returns a `loss_fn(outputs, micro_batch) -> (loss, metrics)` in the
training engine's contract: the loss is this micro-batch's share of the mini-batch
loss, using the mini-batch's global counts that the engine puts in `micro_batch.meta`.
Every metric is a share as well (a loss term as aggregated, a token mean as this
micro-batch's masked sum over the mini-batch's token count), so the engine's sum over
micro-batches and ranks is the mini-batch's value whatever the split. Metric names
follow verl (`actor/pg_loss`, `actor/entropy`, `critic/vf_loss`, ...).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rayrl.algos import (
    POLICY_LOSSES,
    LossAggregation,
    PolicyLossConfig,
    is_batch_norm_factor,
    kl_loss,
    truncated_is_weights,
    value_loss,
)
from rayrl.algos.distill import DistillSpec, distillation_loss
from rayrl.algos.probs_diff import PROBS_DIFF_COLUMNS, probs_diff_rows
from rayrl.algos.rejection import RejectionRule, judge, kept, parse_rejection, rejection_shares
from rayrl.batch import Batch
from rayrl.config.distill import DistillationConfig
from rayrl.config.schema import ActorConfig, CriticConfig, RolloutCorrectionConfig
from rayrl.train.loss_contract import LossFn, Peak
from rayrl.workers.routing import routing_sums


def _bypass_weights(
    correction: RolloutCorrectionConfig, log_prob: Tensor, rollout: Tensor, mask: Tensor
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """verl's bypass-mode weights: none for ppo_clip (the ratio to the rollout is the
    correction) or without ``rollout_is``; for reinforce the truncated ratio of this
    forward's probabilities to the rollout's, normalised over the micro-batch when asked."""
    if correction.loss_type != "reinforce" or correction.rollout_is is None:
        return None, {}
    level = correction.rollout_is
    weights, metrics = truncated_is_weights(
        log_prob.detach(), rollout, mask, cap=correction.rollout_is_threshold, level=level
    )
    if correction.rollout_is_batch_normalize:
        weights = weights / is_batch_norm_factor(weights, mask, level)
    return weights, metrics


def _bypass_rejection(
    rules: tuple[RejectionRule, ...], log_prob: Tensor, mb: Batch, mask: Tensor
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """verl's rollout rejection in bypass mode: this forward's (detached) log-probs
    against the rollout's, micro-batch by micro-batch. The policy loss goes without the
    rejected tokens but keeps the mini-batch's token count (as verl's); the metrics are
    the masked fractions, as shares of the mini-batch."""
    verdicts = judge(log_prob.detach() - mb["rollout_log_probs"], mask, rules)
    valid = mask.bool()
    tokens = mb.meta.get("global_token_count", valid.sum())
    seqs = mb.meta.get("global_seq_count", valid.any(-1).sum())
    shares = rejection_shares(verdicts, mask, float(tokens), float(seqs))
    return kept(verdicts, mask), {f"rollout_corr/{k}": _metric(v) for k, v in shares.items()}


def _decoupled_weights(
    correction: RolloutCorrectionConfig, level: str, old: Tensor, mb: Batch, mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The truncated weights of the old log-probs against the rollout's, over the
    response mask before rollout rejection (``rollout_is_mask``, as verl's) when the
    advantage stage rejected tokens, divided by the batch's mean when it gave one."""
    is_mask = mb.tensors.get("rollout_is_mask", mask)
    weights, metrics = truncated_is_weights(
        old,
        mb["rollout_log_probs"],
        is_mask,
        cap=correction.rollout_is_threshold,
        level=level,
    )
    if "rollout_is_norm" in mb:  # rollout_is_batch_normalize: the batch's mean
        weights = weights / mb["rollout_is_norm"].to(weights.dtype)[:, None]
    return weights, metrics


def probs_diff_sums(rollout: Tensor, actor: Tensor, mask: Tensor) -> dict[str, Any]:
    """This micro-batch's `probs_diff_rows` summed over its rows (``probs_diff/<column>``,
    shares the engine sums), their maximum as a `Peak`, and its real-token count
    (``probs_diff/tokens``): `probs_diff_metrics` of the totals is verl's metrics."""
    rows = probs_diff_rows(rollout, actor, mask)
    out: dict[str, Any] = {f"probs_diff/{k}": v.sum() for k, v in rows.items()}
    out[f"probs_diff/{PROBS_DIFF_COLUMNS[0]}"] = Peak(rows[PROBS_DIFF_COLUMNS[0]].max())
    out["probs_diff/tokens"] = mask.sum()
    return out


def _aggregation(mode: str, mb: Batch, norm_length: int | None) -> LossAggregation:
    return LossAggregation(
        mode,
        global_token_count=mb.meta.get("global_token_count"),
        global_seq_count=mb.meta.get("global_seq_count"),
        norm_length=norm_length,
    )


def _metric(value: Any) -> Tensor | float:
    """A metric as the engine sums it: a tensor stays on its device, detached (reading
    it here would make the host wait for the forward before it queues the backward;
    the engine reads every metric once, after the mini-batch)."""
    return value.detach() if isinstance(value, Tensor) else float(value)


def _token_share(mean: Any, mask: Tensor, mb: Batch) -> Tensor | float:
    """This micro-batch's share of a mini-batch token mean, from its own token mean."""
    total = mb.meta.get("global_token_count")
    if not total:
        return _metric(mean)
    return _metric(mean) * mask.sum().to(torch.float64) / float(total)


def actor_loss_fn(
    cfg: ActorConfig,
    max_response_length: int | None = None,
    correction: RolloutCorrectionConfig | None = None,
    *,
    on_policy: bool = False,
    distill: DistillSpec | None = None,
) -> LossFn:
    """PPO-family policy loss + optional entropy bonus + optional KL-to-reference loss,
    with truncated importance weights against the rollout's log-probs when
    ``correction.rollout_is`` names a level (token or sequence). ``on_policy``: the
    batch has no ``old_log_probs``; this forward's own (detached) stand in for them.

    With ``correction.bypass_mode`` (verl's) the old log-probs are the rollout's: with
    ``loss_type=ppo_clip`` the configured loss runs on that ratio with no other weight;
    with ``reinforce`` the loss is REINFORCE's ``-A * log_prob`` weighted by the truncated
    ratio of this forward's (detached) probabilities to the rollout's, divided by their
    mean over the micro-batch with ``rollout_is_batch_normalize``. Rollout rejection
    (``correction.rollout_rs``) then drops tokens from the policy loss by this forward's
    ratio to the rollout (`_bypass_rejection`); without bypass mode the advantage stage
    took them out of ``response_mask`` already.

    With ``distill`` (on-policy distillation, `rayrl.algos.distill`) the divergence to the
    teacher's log-probs (``teacher_log_prob``) is added, weighted by ``distill.weight``;
    without ``distill.with_task`` it is the whole loss (the task's terms still report)."""
    policy = POLICY_LOSSES.get(cfg.policy_loss.loss_mode)
    correction = correction if correction is not None else RolloutCorrectionConfig()  # none
    is_level = correction.rollout_is
    bypass = correction.bypass_mode
    rules: tuple[RejectionRule, ...] = ()
    if bypass and correction.rollout_rs is not None:
        rules = parse_rejection(correction.rollout_rs, correction.rollout_rs_threshold)
    if bypass and correction.loss_type == "reinforce":
        policy = POLICY_LOSSES.get("reinforce")
    clip = PolicyLossConfig(
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        tau_pos=cfg.tau_pos,
        tau_neg=cfg.tau_neg,
    )

    def loss_fn(outputs: dict[str, Tensor], mb: Batch) -> tuple[Tensor, dict[str, Tensor | float]]:
        mask = mb["response_mask"]
        agg = _aggregation(cfg.loss_agg_mode, mb, max_response_length)
        log_prob = outputs["log_probs"]
        # On-policy (one epoch, one mini-batch): this forward's log-probs are the old ones.
        old = log_prob.detach() if on_policy else mb["old_log_probs"]
        weights, metrics, pg_mask = None, {}, mask
        if bypass:
            weights, tis = _bypass_weights(correction, log_prob, mb["rollout_log_probs"], mask)
            metrics.update({f"actor/{k}": _token_share(v, mask, mb) for k, v in tis.items()})
            if rules:
                pg_mask, rejected = _bypass_rejection(rules, log_prob, mb, mask)
                metrics.update(rejected)
        elif is_level is not None and "rollout_log_probs" in mb:
            weights, tis = _decoupled_weights(correction, is_level, old, mb, mask)
            metrics.update({f"actor/{k}": _token_share(v, mask, mb) for k, v in tis.items()})
        if on_policy and "rollout_log_probs" in mb:  # what the separate pass would report
            metrics.update(probs_diff_sums(mb["rollout_log_probs"], old, mask))
        if on_policy:  # ... and its routing counts (`rayrl.workers.routing`)
            metrics.update(routing_sums(outputs))
        pg_loss, pg = policy(
            log_prob,
            old,
            mb["advantages"],
            pg_mask,
            config=clip,
            agg=agg,
            is_weights=weights,
        )
        loss = pg_loss
        metrics["actor/pg_loss"] = _metric(pg_loss)
        metrics.update({f"actor/{k}": _token_share(v, mask, mb) for k, v in pg.items()})
        if "entropy" in outputs:
            entropy = agg(outputs["entropy"], mask)
            if cfg.entropy_coeff:  # else the entropy is only reported
                loss = loss - cfg.entropy_coeff * entropy
            metrics["actor/entropy"] = _metric(entropy)
        if cfg.use_kl_loss:
            kl, _ = kl_loss(log_prob, mb["ref_log_prob"], mask, estimator=cfg.kl_loss_type, agg=agg)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = _metric(kl)
        if distill is not None:
            loss = _with_distillation(loss, log_prob, old, mb, agg, distill, metrics)
        return loss, metrics

    return loss_fn


def _with_distillation(
    loss: Tensor,
    log_prob: Tensor,
    old: Tensor,
    mb: Batch,
    agg: LossAggregation,
    spec: DistillSpec,
    metrics: dict[str, Tensor | float],
) -> Tensor:
    """The task's ``loss`` with the distillation term (or the term alone without
    ``spec.with_task``); its metrics under ``distillation/`` (verl's names)."""
    mask = mb["response_mask"]
    term, found = distillation_loss(log_prob, mb["teacher_log_prob"], old, mask, spec, agg)
    metrics["distillation/loss"] = _metric(term)
    metrics["distillation/loss_max"] = Peak(_metric(found.pop("loss_max")))
    metrics.update({f"distillation/{k}": _token_share(v, mask, mb) for k, v in found.items()})
    weighted = spec.weight * term
    return loss + weighted if spec.with_task else weighted


def distill_spec(cfg: DistillationConfig) -> DistillSpec | None:
    """The distillation term's settings, or None when distillation is off."""
    if not cfg.enabled:
        return None
    loss = cfg.distillation_loss
    return DistillSpec(
        loss_mode=loss.loss_mode,
        use_policy_gradient=loss.use_policy_gradient,
        loss_max_clamp=loss.loss_max_clamp,
        clip_ratio_low=loss.clip_ratio_low,
        clip_ratio_high=loss.clip_ratio_high,
        with_task=loss.use_task_rewards,
        coef=loss.distillation_loss_coef,
    )


def critic_loss_fn(cfg: CriticConfig, max_response_length: int | None = None) -> LossFn:
    """Clipped value loss against the returns."""

    def loss_fn(outputs: dict[str, Tensor], mb: Batch) -> tuple[Tensor, dict[str, Tensor | float]]:
        mask = mb["response_mask"]
        agg = _aggregation(cfg.loss_agg_mode, mb, max_response_length)
        loss, vm = value_loss(
            outputs["values"],
            mb["values"],
            mb["returns"],
            mask,
            cliprange_value=cfg.cliprange_value,
            agg=agg,
        )
        metrics = {"critic/vf_loss": _metric(loss)}
        metrics.update({f"critic/{k}": _token_share(v, mask, mb) for k, v in vm.items()})
        return loss, metrics

    return loss_fn


def sft_loss_fn() -> LossFn:
    """Supervised fine-tuning: the negative log-likelihood of the response tokens, a
    token mean over the whole batch (all micro-batches and ranks). Prompt tokens are
    not in ``log_probs`` at all: the engine scores the response columns only."""
    agg_mode = "token-mean"

    def loss_fn(outputs: dict[str, Tensor], mb: Batch) -> tuple[Tensor, dict[str, Tensor | float]]:
        return _aggregation(agg_mode, mb, None)(-outputs["log_probs"], mb["response_mask"]), {}

    return loss_fn
