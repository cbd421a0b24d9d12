"""Preference-pair objectives: the loss of a (chosen, rejected) pair, registered by name.

One function per objective, on per-pair tensors ``[pairs]``:

- ``bt`` (Bradley-Terry, a reward model's): ``chosen`` / ``rejected`` are the model's
  scores of the two responses; ``loss = -log sigmoid(chosen - rejected)``. The rewards
  are the scores themselves.
- ``dpo`` (sigmoid DPO, Rafailov et al. 2023; TRL's ``loss_type="sigmoid"``):
  ``chosen`` / ``rejected`` are the policy's summed log-probs of the two responses and
  ``ref_chosen`` / ``ref_rejected`` the frozen reference's. With
  ``logits = (chosen - ref_chosen) - (rejected - ref_rejected)``,
  ``loss = -log sigmoid(beta * logits)``.
- ``ipo`` (Azar et al. 2023, eq. 17; TRL's ``loss_type="ipo"``): each log-ratio
  divided by its response's token count (TRL's normalisation),
  ``loss = (logits - 1 / (2 beta))^2``;
- ``robust`` (Chowdhury et al. 2024; TRL's ``loss_type="robust"``): sigmoid DPO made
  unbiased under labels flipped with probability ``label_smoothing``.

``label_smoothing`` ``e`` of ``dpo`` and ``bt`` is conservative DPO's (OpenRLHF's
``--label_smoothing``): each label is taken as flipped with probability ``e``,
``loss = -(1 - e) log sigmoid(x) - e log sigmoid(-x)``. (TRL 1.16's ``sigmoid`` loss
ignores its ``label_smoothing``; its ``robust`` loss uses it, as ``robust`` here.)

Log-probs come in summed over each response's tokens. Every objective returns
``(losses, chosen_rewards, rejected_rewards)``, one value per pair; the rewards carry
no gradient (a policy's implicit rewards ``beta * (logp - ref_logp)`` of the summed
log-probs, TRL's ``rewards/chosen`` and ``rewards/rejected``, IPO's too).
`pair_metrics` gives TRL's metrics of a batch of pairs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from rayrl.registry import Registry

__all__ = [
    "PREFERENCE_LOSSES",
    "PairLossFn",
    "pair_metrics",
    "preference_loss",
    "sequence_logps",
    "split_pairs",
]

PairLossFn = Callable[..., tuple[Tensor, Tensor, Tensor]]

PREFERENCE_LOSSES: Registry[PairLossFn] = Registry("preference loss", "objective.name")


def _smoothed(x: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - e) log sigmoid(x) - e log sigmoid(-x)``."""
    loss = -F.logsigmoid(x) * (1.0 - label_smoothing)
    if label_smoothing:
        loss = loss - F.logsigmoid(-x) * label_smoothing
    return loss


@PREFERENCE_LOSSES.register("bt", aliases=("bradley_terry",), model="reward", reference=False)
def bt_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    *,
    beta: float = 1.0,
    label_smoothing: float = 0.0,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Bradley-Terry on a reward model's scores (``beta``, references and lengths unused)."""
    losses = _smoothed(chosen - rejected, label_smoothing)
    return losses, chosen.detach(), rejected.detach()


def _log_ratios(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor | None,
    ref_rejected: Tensor | None,
    beta: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(chosen log-ratio, rejected log-ratio, their rewards ``beta * ratio``)."""
    if ref_chosen is None or ref_rejected is None:
        raise ValueError("DPO and IPO need the reference model's log-probs of both responses")
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    return (
        chosen_ratio,
        rejected_ratio,
        beta * chosen_ratio.detach(),
        beta * rejected_ratio.detach(),
    )


@PREFERENCE_LOSSES.register("dpo", aliases=("sigmoid",), model="policy", reference=True)
def dpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sigmoid DPO (with ``label_smoothing``: conservative DPO, OpenRLHF's)."""
    c, r, chosen_r, rejected_r = _log_ratios(chosen, rejected, ref_chosen, ref_rejected, beta)
    return _smoothed(beta * (c - r), label_smoothing), chosen_r, rejected_r


@PREFERENCE_LOSSES.register("robust", model="policy", reference=True)
def robust_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Robust DPO (Chowdhury et al. 2024; TRL's ``robust``): an unbiased loss under labels
    flipped with probability ``label_smoothing``."""
    c, r, chosen_r, rejected_r = _log_ratios(chosen, rejected, ref_chosen, ref_rejected, beta)
    x, e = beta * (c - r), label_smoothing
    losses = (-(1 - e) * F.logsigmoid(x) + e * F.logsigmoid(-x)) / (1 - 2 * e)
    return losses, chosen_r, rejected_r


@PREFERENCE_LOSSES.register("ipo", model="policy", reference=True)
def ipo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """IPO: the squared distance of the log-ratio margin from ``1 / (2 beta)``, each
    log-ratio divided by its response's token count (TRL's normalisation; without the
    counts, the summed log-ratios). ``label_smoothing`` does not apply, as in TRL."""
    c, r, chosen_r, rejected_r = _log_ratios(chosen, rejected, ref_chosen, ref_rejected, beta)
    if chosen_tokens is not None and rejected_tokens is not None:
        c = c / chosen_tokens.clamp(min=1)
        r = r / rejected_tokens.clamp(min=1)
    return (c - r - 1.0 / (2.0 * beta)) ** 2, chosen_r, rejected_r


def preference_loss(
    name: str,
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The objective ``name``'s ``(losses, chosen_rewards, rejected_rewards)``."""
    fn = PREFERENCE_LOSSES.get(name)
    return fn(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        beta=beta,
        label_smoothing=label_smoothing,
        chosen_tokens=chosen_tokens,
        rejected_tokens=rejected_tokens,
    )


def pair_metrics(
    losses: Tensor, chosen_rewards: Tensor, rejected_rewards: Tensor
) -> dict[str, Tensor]:
    """TRL's DPOTrainer metrics of a batch of pairs, each a mean over the pairs:
    ``loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies`` (the
    share of pairs whose chosen reward is the higher, strictly) and ``rewards/margins``."""
    return {
        "loss": losses.detach().mean(),
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
    }


def sequence_logps(log_probs: Tensor, mask: Tensor) -> Tensor:
    """Per row: the summed log-probs of the masked tokens."""
    return (log_probs * mask).sum(-1)


def split_pairs(values: Tensor) -> tuple[Tensor, Tensor]:
    """(chosen, rejected) of rows laid out in pairs: chosen at even rows, rejected at odd."""
    if values.shape[0] % 2:
        raise ValueError(f"rows of preference pairs come in twos; got {values.shape[0]}")
    return values[0::2], values[1::2]
