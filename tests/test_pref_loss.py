"""The preference objectives against the published formulas, written out by hand on a
fixed batch of log-probs (DPO, Rafailov et al. 2023, eq. 7; conservative DPO's label
smoothing; IPO, Azar et al. 2023, eq. 17 as TRL computes it; Bradley-Terry), TRL's
metrics, and the engine-side loss: its per-micro-batch shares add up to the batch's
mean whatever the split."""

from __future__ import annotations

import math

import pytest
import torch

from rayrl.algos.preference import PREFERENCE_LOSSES, pair_metrics, preference_loss
from rayrl.batch import Batch
from rayrl.workers.pref import pair_loss_fn

# Summed log-probs of four pairs: the policy's and the reference's, chosen and rejected.
CHOSEN = [-12.5, -7.25, -30.0, -3.5]
REJECTED = [-14.0, -6.0, -29.5, -9.75]
REF_CHOSEN = [-13.0, -7.0, -31.25, -4.0]
REF_REJECTED = [-13.5, -6.5, -29.0, -8.0]
LENGTHS_C = [5, 3, 9, 2]
LENGTHS_R = [6, 3, 8, 4]


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _hand_dpo(beta: float, smoothing: float) -> tuple[list[float], list[float], list[float]]:
    losses, rc, rr = [], [], []
    for c, r, c0, r0 in zip(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, strict=True):
        h = beta * ((c - c0) - (r - r0))
        losses.append(-(1 - smoothing) * _log_sigmoid(h) - smoothing * _log_sigmoid(-h))
        rc.append(beta * (c - c0))
        rr.append(beta * (r - r0))
    return losses, rc, rr


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize(("beta", "smoothing"), [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)])
def test_dpo_matches_the_published_formula(beta, smoothing):
    losses, rc, rr = preference_loss(
        "dpo",
        _t(CHOSEN),
        _t(REJECTED),
        _t(REF_CHOSEN),
        _t(REF_REJECTED),
        beta=beta,
        label_smoothing=smoothing,
    )
    want, want_c, want_r = _hand_dpo(beta, smoothing)
    assert losses.tolist() == pytest.approx(want, abs=1e-12)
    assert rc.tolist() == pytest.approx(want_c, abs=1e-12)
    assert rr.tolist() == pytest.approx(want_r, abs=1e-12)
    metrics = pair_metrics(losses, rc, rr)
    assert float(metrics["loss"]) == pytest.approx(sum(want) / 4, abs=1e-12)
    assert float(metrics["rewards/chosen"]) == pytest.approx(sum(want_c) / 4, abs=1e-12)
    assert float(metrics["rewards/rejected"]) == pytest.approx(sum(want_r) / 4, abs=1e-12)
    margins = [c - r for c, r in zip(want_c, want_r, strict=True)]
    assert float(metrics["rewards/margins"]) == pytest.approx(sum(margins) / 4, abs=1e-12)
    assert float(metrics["rewards/accuracies"]) == sum(m > 0 for m in margins) / 4


def test_sigmoid_is_an_alias_of_dpo_and_no_reference_is_an_error():
    assert PREFERENCE_LOSSES.canonical("sigmoid") == "dpo"
    with pytest.raises(ValueError, match="reference"):
        preference_loss("dpo", _t(CHOSEN), _t(REJECTED))


def test_ipo_matches_the_published_formula_on_token_means():
    """IPO on length-normalised log-ratios (TRL divides each by its token count); its
    rewards are the summed log-ratios' (as TRL logs them)."""
    beta = 0.1
    losses, rc, rr = preference_loss(
        "ipo",
        _t(CHOSEN),
        _t(REJECTED),
        _t(REF_CHOSEN),
        _t(REF_REJECTED),
        beta=beta,
        chosen_tokens=_t(LENGTHS_C),
        rejected_tokens=_t(LENGTHS_R),
    )
    want = [
        ((c - c0) / nc - (r - r0) / nr - 1 / (2 * beta)) ** 2
        for c, r, c0, r0, nc, nr in zip(
            CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, LENGTHS_C, LENGTHS_R, strict=True
        )
    ]
    assert losses.tolist() == pytest.approx(want, abs=1e-12)
    _, want_c, want_r = _hand_dpo(beta, 0.0)
    assert rc.tolist() == pytest.approx(want_c, abs=1e-12)
    assert rr.tolist() == pytest.approx(want_r, abs=1e-12)


def test_robust_dpo_matches_the_published_formula():
    beta, e = 0.1, 0.2
    losses, _, _ = preference_loss(
        "robust",
        _t(CHOSEN),
        _t(REJECTED),
        _t(REF_CHOSEN),
        _t(REF_REJECTED),
        beta=beta,
        label_smoothing=e,
    )
    want = []
    for c, r, c0, r0 in zip(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, strict=True):
        h = beta * ((c - c0) - (r - r0))
        want.append((-(1 - e) * _log_sigmoid(h) + e * _log_sigmoid(-h)) / (1 - 2 * e))
    assert losses.tolist() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bradley_terry_on_scores(smoothing):
    scores_c, scores_r = [1.5, -0.25, 0.0, 2.0], [0.5, 0.75, 0.0, -1.0]
    losses, rc, rr = preference_loss("bt", _t(scores_c), _t(scores_r), label_smoothing=smoothing)
    want = [
        -(1 - smoothing) * _log_sigmoid(c - r) - smoothing * _log_sigmoid(r - c)
        for c, r in zip(scores_c, scores_r, strict=True)
    ]
    assert losses.tolist() == pytest.approx(want, abs=1e-12)
    assert rc.tolist() == scores_c and rr.tolist() == scores_r
    assert float(pair_metrics(losses, rc, rr)["rewards/accuracies"]) == 0.5  # ties lose


def _micro(rows: list[int], per_token: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor):
    batch = Batch(
        {
            "response_mask": mask[rows],
            "pair_role": torch.tensor([1, 0] * (len(rows) // 2)),
            "ref_logps": ref[rows],
        }
    )
    batch.meta["global_seq_count"] = float(len(per_token))
    return {"log_probs": per_token[rows]}, batch


@pytest.mark.parametrize("name", ["dpo", "ipo", "robust"])
def test_engine_loss_shares_add_up_to_the_batch_mean(name):
    """`pair_loss_fn` on a batch of interleaved pairs, whole or in two micro-batches:
    the loss (and each metric) is the objective's mean over the pairs."""
    torch.manual_seed(0)
    per_token = -torch.rand(8, 5, dtype=torch.float64) * 3
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in (5, 3, 2, 4, 5, 5, 1, 3)])
    seq = (per_token * mask).sum(-1)
    tokens = mask.sum(-1).double()
    ref = seq + torch.linspace(-1, 1, 8, dtype=torch.float64)
    fn = pair_loss_fn(name, beta=0.2, label_smoothing=0.1)
    whole, metrics = fn(*_micro(list(range(8)), per_token, mask, ref))
    losses, rc, rr = preference_loss(
        name,
        seq[0::2],
        seq[1::2],
        ref[0::2],
        ref[1::2],
        beta=0.2,
        label_smoothing=0.1,
        chosen_tokens=tokens[0::2],
        rejected_tokens=tokens[1::2],
    )
    assert float(whole) == pytest.approx(float(losses.mean()), abs=1e-12)
    assert float(metrics["rewards/margins"]) == pytest.approx(float((rc - rr).mean()), abs=1e-12)
    assert float(metrics["logps/chosen"]) == pytest.approx(float(seq[0::2].mean()), abs=1e-12)
    parts = [fn(*_micro(rows, per_token, mask, ref)) for rows in ([0, 1, 2, 3], [4, 5, 6, 7])]
    assert sum(float(p[0]) for p in parts) == pytest.approx(float(whole), abs=1e-12)
    for key in metrics:
        total = sum(float(p[1][key]) for p in parts)
        assert total == pytest.approx(float(metrics[key]), abs=1e-12), key


def test_engine_loss_refuses_rows_that_are_not_whole_pairs():
    per_token = torch.zeros(4, 2)
    batch = Batch(
        {
            "response_mask": torch.ones(4, 2),
            "pair_role": torch.tensor([1, 1, 0, 0]),
            "ref_logps": torch.zeros(4),
        }
    )
    batch.meta["global_seq_count"] = 4.0
    with pytest.raises(ValueError, match="pairs"):
        pair_loss_fn("dpo", 0.1, 0.0)({"log_probs": per_token}, batch)
