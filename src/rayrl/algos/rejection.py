"""Rollout rejection sampling: tokens, or whole responses, whose training-engine and
rollout-engine log-probs diverge too much leave the loss (verl's
``algorithm.rollout_correction.rollout_rs``, a hard trust region; truncated importance
sampling, `rayrl.algos.correction`, only caps the weights).

From each token's log-ratio ``log r = log pi_train - log pi_rollout`` (clamped to +-20)
come three estimates of the divergence: ``k1 = -log r``, ``k2 = (log r)^2 / 2`` and
``k3 = r - 1 - log r``. An option names one estimate and where it is judged:

- ``token_k1``, ``token_k2``, ``token_k3``: each token by itself;
- ``seq_sum_k*``, ``seq_mean_k*``: the sum or mean over the response's tokens, and the
  whole response is kept or dropped;
- ``seq_max_k2``, ``seq_max_k3``: the response's largest token estimate.

A k1 option keeps what lies between ``log(lower)`` and ``log(upper)``; the others keep
what is at most ``upper``. Options are comma-separated (``"token_k1,seq_max_k3"``,
repeats ignored) and a token stays only if every option keeps it.

The threshold (``rollout_rs_threshold``) is one number or a comma-separated list of
one entry per option (one entry serves every option). An entry of a k1 option is
``lower_upper`` (``"0.5_2.0"``) or just ``upper``, the lower bound then being
``1/upper``; the other options take one positive number.

`rejection_mask` returns the response mask with the rejected tokens zeroed and verl's
metrics (``rollout_rs_masked_fraction``, ``rollout_rs_<option>_mean``, ...; the trainer
adds the ``rollout_corr/`` prefix). `rejection_shares` gives the masked fractions as
shares of a mini-batch, for a loss that applies the rejection per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rayrl.algos.masked import masked_mean, masked_sum
from rayrl.registry import Registry

__all__ = [
    "REJECTION_OPTIONS",
    "RejectionRule",
    "Verdict",
    "judge",
    "kept",
    "parse_rejection",
    "rejection_mask",
    "rejection_shares",
]

KEY = "algorithm.rollout_correction"
LOG_RATIO_BOUND = 20.0  # the log-ratio is clamped to +-this before any estimate


@dataclass(frozen=True)
class RejectionOption:
    """Where an option judges (``token``, ``seq_sum``, ``seq_mean``, ``seq_max``) and
    which estimate (``k1``, ``k2``, ``k3``)."""

    level: str
    estimate: str


REJECTION_OPTIONS: Registry[RejectionOption] = Registry(
    "rollout rejection option", config_key=f"{KEY}.rollout_rs"
)
for _level in ("token", "seq_sum", "seq_mean", "seq_max"):
    for _kind in ("k1", "k2", "k3"):
        if (_level, _kind) != ("seq_max", "k1"):
            REJECTION_OPTIONS.add(f"{_level}_{_kind}", RejectionOption(_level, _kind))


@dataclass(frozen=True)
class RejectionRule:
    """One option with its bounds on the estimate: for k1 the logs of the ratio bounds
    (``lower`` and ``upper``), for k2 and k3 ``upper`` alone (``lower`` None)."""

    option: str
    upper: float
    lower: float | None = None

    @property
    def level(self) -> str:
        return REJECTION_OPTIONS.get(self.option).level

    @property
    def estimate(self) -> str:
        return REJECTION_OPTIONS.get(self.option).estimate


# --------------------------------------------------------------------------- parsing


def _option_names(rollout_rs: str) -> list[str]:
    """The options of a comma-separated ``rollout_rs``, repeats dropped, in order."""
    if not isinstance(rollout_rs, str):
        raise ValueError(
            f"{KEY}.rollout_rs={rollout_rs!r} must be a string of comma-separated options "
            f"such as token_k1 or seq_mean_k3 (valid: {', '.join(REJECTION_OPTIONS.names())})"
        )
    names = [part.strip() for part in rollout_rs.split(",") if part.strip()]
    if not names:
        raise ValueError(
            f"{KEY}.rollout_rs={rollout_rs!r} names no option; give one or more of "
            f"{', '.join(REJECTION_OPTIONS.names())}, comma-separated, or null to turn it off"
        )
    for name in names:
        if name not in REJECTION_OPTIONS:
            raise ValueError(
                f"{KEY}.rollout_rs={rollout_rs!r}: {REJECTION_OPTIONS.unknown_message(name)}"
            )
    return list(dict.fromkeys(names))


def _threshold_entries(threshold: str | float | None, options: list[str]) -> list[str]:
    """One threshold text per option."""
    key = f"{KEY}.rollout_rs_threshold"
    if threshold is None:
        raise ValueError(
            f"{KEY}.rollout_rs={','.join(options)} needs {key}: give one number for every "
            "option, or one per option, comma-separated (a k1 option takes lower_upper, "
            "e.g. 0.5_2.0)"
        )
    if isinstance(threshold, bool) or not isinstance(threshold, str | int | float):
        raise ValueError(f"{key}={threshold!r} must be a number or a string of numbers")
    texts = [str(threshold)] if not isinstance(threshold, str) else threshold.split(",")
    entries = [text.strip() for text in texts if text.strip()]
    if len(entries) not in (1, len(options)):
        raise ValueError(
            f"{key}={threshold!r} gives {len(entries)} thresholds for the {len(options)} "
            f"options of rollout_rs ({', '.join(options)}); give one for all of them or "
            f"exactly {len(options)}, in the same order"
        )
    return entries * len(options) if len(entries) == 1 else entries


def _number(text: str, option: str, threshold: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value <= 0:
        raise ValueError(
            f"{KEY}.rollout_rs_threshold: the entry {threshold!r} of option {option} must be "
            f"a positive number (got {text!r})"
        )
    return value


def _rule(option: str, entry: str) -> RejectionRule:
    """The bounds of one option from its threshold entry."""
    if REJECTION_OPTIONS.get(option).estimate != "k1":
        if "_" in entry:
            raise ValueError(
                f"{KEY}.rollout_rs_threshold: option {option} takes one upper bound, not "
                f"{entry!r} (lower_upper is for the k1 options)"
            )
        return RejectionRule(option, upper=_number(entry, option, entry))
    lower_text, upper_text = entry.split("_", 1) if "_" in entry else (None, entry)
    upper = _number(upper_text, option, entry)
    lower = 1.0 / upper if lower_text is None else _number(lower_text, option, entry)
    if lower > upper:
        raise ValueError(
            f"{KEY}.rollout_rs_threshold: option {option} has lower bound {lower:g} above "
            f"its upper bound {upper:g} ({entry!r}); write lower_upper with lower <= upper "
            "(one number u alone means 1/u_u, so it must be at least 1)"
        )
    return RejectionRule(option, upper=math.log(upper), lower=math.log(lower))


def parse_rejection(
    rollout_rs: str, rollout_rs_threshold: str | float | None
) -> tuple[RejectionRule, ...]:
    """The rules of ``rollout_rs`` with ``rollout_rs_threshold`` (module docstring);
    ValueError naming the key for a bad option or threshold."""
    options = _option_names(rollout_rs)
    entries = _threshold_entries(rollout_rs_threshold, options)
    return tuple(_rule(option, entry) for option, entry in zip(options, entries, strict=True))


# --------------------------------------------------------------------------- judging


@dataclass(frozen=True)
class Verdict:
    """What one rule found: the estimate per token (at the sequence levels each
    response's value on all its tokens), per response (None at the token level), and
    which tokens it keeps (bool, padding included)."""

    rule: RejectionRule
    token_stat: Tensor
    seq_stat: Tensor | None
    keep: Tensor


def _estimate(log_ratio: Tensor, name: str) -> Tensor:
    safe = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if name == "k1":
        return -safe
    if name == "k2":
        return 0.5 * safe**2
    return torch.exp(safe) - 1.0 - safe


def _per_response(values: Tensor, mask: Tensor, level: str) -> Tensor:
    """A response's sum, mean or largest value over its tokens (0 for an empty one)."""
    if level == "seq_sum":
        return masked_sum(values, mask, dim=-1)
    if level == "seq_mean":
        return masked_mean(values, mask, dim=-1)
    largest = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(largest == float("-inf"), torch.zeros_like(largest), largest)


def _within(rule: RejectionRule, values: Tensor) -> Tensor:
    inside = values <= rule.upper
    return inside & (values >= rule.lower) if rule.lower is not None else inside


def judge(
    log_ratio: Tensor, response_mask: Tensor, rules: tuple[RejectionRule, ...]
) -> list[Verdict]:
    """Each rule's verdict on a ``[batch, response_len]`` log-ratio (training minus
    rollout log-probs)."""
    verdicts = []
    with torch.no_grad():
        for rule in rules:
            token_stat = _estimate(log_ratio.detach(), rule.estimate)
            if rule.level == "token":
                verdicts.append(Verdict(rule, token_stat, None, _within(rule, token_stat)))
                continue
            seq_stat = _per_response(token_stat, response_mask, rule.level)
            keep = _within(rule, seq_stat).unsqueeze(-1).expand_as(token_stat)
            verdicts.append(
                Verdict(rule, seq_stat.unsqueeze(-1).expand_as(token_stat), seq_stat, keep)
            )
    return verdicts


def kept(verdicts: list[Verdict], response_mask: Tensor) -> Tensor:
    """The response mask (its dtype) without the tokens any verdict rejects."""
    keep = torch.ones_like(response_mask, dtype=torch.bool)
    for verdict in verdicts:
        keep = keep & verdict.keep
    return (response_mask * keep.to(response_mask.dtype)).to(response_mask.dtype)


# --------------------------------------------------------------------------- metrics


def _per_response_values(verdict: Verdict, mask: Tensor, rows: Tensor) -> Tensor:
    """Each response's value (the token estimates' mean at the token level), for the
    responses with a real token."""
    if verdict.seq_stat is not None:
        return verdict.seq_stat[rows]
    return masked_mean(verdict.token_stat, mask, dim=-1)[rows]


def _spread_metrics(verdict: Verdict, mask: Tensor, rows: Tensor) -> dict[str, Tensor]:
    """The estimate's mean, max, min, out-of-bounds fractions and clamped std."""
    rule, stat = verdict.rule, verdict.token_stat
    lower = rule.lower if rule.lower is not None else 0.0
    seqs, valid = _per_response_values(verdict, mask, rows), mask.bool()
    out = {"mean": masked_mean(stat, mask)}
    if verdict.seq_stat is not None:
        out["max"], out["min"] = seqs.max(), seqs.min()
        out["fraction_high"] = (seqs > rule.upper).float().mean()
        low = (seqs < lower).float().mean()
    else:
        out["max"] = stat.masked_fill(~valid, float("-inf")).max()
        out["min"] = stat.masked_fill(~valid, float("inf")).min()
        out["fraction_high"] = masked_mean((stat > rule.upper).float(), mask)
        low = masked_mean((stat < lower).float(), mask)
    out["fraction_low"] = low if rule.lower is not None else torch.zeros(())
    out["std"] = torch.zeros(())
    if mask.sum() > 1:
        clamped = stat.clamp(min=lower, max=rule.upper)
        var = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
        out["std"] = var.clamp(min=0.0).sqrt()
    return out


def _sequence_metrics(verdict: Verdict, mask: Tensor, rows: Tensor) -> dict[str, Tensor]:
    """The per-response values' summary and the fraction of responses out of bounds."""
    rule, seqs = verdict.rule, _per_response_values(verdict, mask, rows)
    out = {
        "seq_mean": seqs.mean(),
        "seq_std": seqs.std() if seqs.numel() > 1 else torch.zeros(()),
        "seq_max": seqs.max(),
        "seq_min": seqs.min(),
        "seq_max_deviation": seqs.abs().max(),
        "seq_fraction_high": (seqs > rule.upper).float().mean(),
    }
    if rule.lower is not None:
        out["seq_fraction_low"] = (seqs < rule.lower).float().mean()
    return out


def _masked_fractions(keep: Tensor, mask: Tensor, rows: Tensor) -> dict[str, Tensor]:
    """The fraction of real tokens rejected, and of responses that lost any."""
    dropped = mask.bool() & ~keep
    tokens = masked_mean(dropped.to(torch.float64), mask)
    seqs = (dropped.any(dim=-1) & rows).to(torch.float64).sum() / rows.sum().clamp(min=1)
    return {"masked_fraction": tokens, "seq_masked_fraction": seqs}


def rejection_mask(
    log_ratio: Tensor, response_mask: Tensor, rules: tuple[RejectionRule, ...]
) -> tuple[Tensor, dict[str, float]]:
    """The response mask with every rejected token zeroed (``response_mask``'s dtype)
    and verl's metrics: per option ``rollout_rs_<option>_{mean,max,min,std,
    fraction_high,fraction_low,seq_*,masked_fraction,seq_masked_fraction}``, overall
    ``rollout_rs_masked_fraction`` (of real tokens) and ``rollout_rs_seq_masked_fraction``
    (of responses). A batch without a real token comes back as it is, without metrics."""
    valid = response_mask.bool()
    if log_ratio.shape[0] == 0 or not bool(valid.any()):
        return response_mask, {}
    verdicts = judge(log_ratio, response_mask, rules)
    rows = valid.any(dim=-1)
    metrics: dict[str, float] = {}
    for v in verdicts:
        found = _spread_metrics(v, response_mask, rows)
        found.update(_sequence_metrics(v, response_mask, rows))
        found.update(_masked_fractions(v.keep, response_mask, rows))
        metrics.update({f"rollout_rs_{v.rule.option}_{k}": float(x) for k, x in found.items()})
    mask = kept(verdicts, response_mask)
    dropped = valid & ~mask.bool()
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(dropped.double(), response_mask))
    metrics["rollout_rs_seq_masked_fraction"] = float(dropped.any(dim=-1).double().mean())
    return mask, metrics


def rejection_shares(
    verdicts: list[Verdict], response_mask: Tensor, token_count: float, seq_count: float
) -> dict[str, Tensor]:
    """The masked fractions of `rejection_mask` as this micro-batch's shares of a
    mini-batch of ``token_count`` real tokens in ``seq_count`` responses (summed over
    the micro-batches they are the mini-batch's fractions)."""
    valid = response_mask.bool()
    keep = torch.ones_like(valid)
    shares: dict[str, Tensor] = {}
    for v in verdicts:
        dropped = valid & ~v.keep
        keep = keep & v.keep
        name = f"rollout_rs_{v.rule.option}"
        shares[f"{name}_masked_fraction"] = dropped.sum() / max(token_count, 1.0)
        shares[f"{name}_seq_masked_fraction"] = dropped.any(-1).sum() / max(seq_count, 1.0)
    dropped = valid & ~keep
    shares["rollout_rs_masked_fraction"] = dropped.sum() / max(token_count, 1.0)
    shares["rollout_rs_seq_masked_fraction"] = dropped.any(-1).sum() / max(seq_count, 1.0)
    return shares
