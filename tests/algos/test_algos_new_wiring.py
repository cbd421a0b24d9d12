"""The new algorithms through the product: their names pass `rayrl config show` and pick
their registry entries; their parameters (clip ratios, SAPO's temperatures, PF-PPO's
method) reach the functions through the actor's loss and the trainer's advantage stage;
PF-PPO's draw is a pure function of run seed and step (a replayed step draws the same
rows); and the losses give the same mini-batch loss and gradient norm through the real
training engine whatever the micro-batch size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algos_testlib import config_show

from engine_cases import OPTIM, ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.algos import (
    ADV_ESTIMATORS,
    PF_PPO_WEIGHTS,
    POLICY_LOSSES,
    LossAggregation,
    PolicyLossConfig,
    compute_advantages,
    gpg_advantages,
    is_batch_norm_factor,
    optimal_token_baseline_advantages,
    pf_ppo_resample,
    sapo_policy_loss,
    truncated_is_weights,
)
from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.train.engine import TrainEngine
from rayrl.trainer.advantage import AdvantageStage
from rayrl.trainer.names import check_names
from rayrl.workers.losses import actor_loss_fn

ACTOR = "actor_rollout_ref.actor"
SMALL = [
    "data.train_batch_size=2",
    "data.max_response_length=4",
    f"{ACTOR}.ppo_mini_batch_size=1",
    f"{ACTOR}.ppo_micro_batch_size_per_gpu=1",
    "critic.ppo_mini_batch_size=1",
    "critic.ppo_micro_batch_size_per_gpu=1",
]


# -------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "source, override, key, registry",
    [
        ("grpo", "algorithm.adv_estimator=gpg", "adv_estimator", ADV_ESTIMATORS),
        ("grpo", f"{ACTOR}.policy_loss.loss_mode=geo_mean", "loss_mode", POLICY_LOSSES),
        ("grpo", f"{ACTOR}.policy_loss.loss_mode=cispo", "loss_mode", POLICY_LOSSES),
        ("grpo", f"{ACTOR}.policy_loss.loss_mode=sapo", "loss_mode", POLICY_LOSSES),
        ("grpo", f"{ACTOR}.policy_loss.loss_mode=gpg", "loss_mode", POLICY_LOSSES),
        ("ppo", "algorithm.pf_ppo.reweight_method=max_random", "reweight_method", PF_PPO_WEIGHTS),
    ],
)
def test_new_names_pass_config_show_and_reach_their_registry(
    capsys, source, override, key, registry
):
    code, out, err = config_show(capsys, source, override, "algorithm.use_pf_ppo=true")
    value = override.split("=")[1]
    assert code == 0, err
    assert f"{key}: {value}" in out and "use_pf_ppo: true" in out
    cfg = load_config(source, [override])
    check_names(cfg)
    assert value in registry and registry.get(value) is not None


def test_verl_defaults_of_the_new_keys():
    cfg = load_config("grpo")
    assert (cfg.actor_rollout_ref.actor.tau_pos, cfg.actor_rollout_ref.actor.tau_neg) == (1.0, 1.05)
    assert cfg.algorithm.use_pf_ppo is False
    assert (cfg.algorithm.pf_ppo.reweight_method, cfg.algorithm.pf_ppo.weight_pow) == ("pow", 2.0)


@pytest.mark.parametrize(
    "source, overrides, message",
    [
        (
            "grpo",
            ["algorithm.adv_estimator=optimal_token_baseline"],
            "set actor_rollout_ref.actor.calculate_sum_pi_squared=true",
        ),
        (
            "grpo",
            [
                f"{ACTOR}.calculate_sum_pi_squared=true",
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.bypass_mode=true",
            ],
            "bypass_mode=true skips",
        ),
        ("ppo", ["algorithm.pf_ppo.reweight_method=maxmin"], "Did you mean 'max_min'"),
        (
            "grpo",
            [f"{ACTOR}.policy_loss.loss_mode=sapo", f"{ACTOR}.tau_neg=0"],
            "tau_neg=0",
        ),
        (
            "grpo",
            ["algorithm.rollout_correction.rollout_is_batch_normalize=true"],
            "rollout_is is null",
        ),
    ],
)
def test_bad_settings_are_refused_with_the_key(capsys, source, overrides, message):
    code, _, err = config_show(capsys, source, *overrides)
    assert code == 2 and message in err


def test_optimal_token_baseline_is_registered_and_loads_with_its_column(capsys):
    assert ADV_ESTIMATORS.get("optimal_token_baseline") is optimal_token_baseline_advantages
    code, _, err = config_show(
        capsys,
        "grpo",
        "algorithm.adv_estimator=optimal_token_baseline",
        f"{ACTOR}.calculate_sum_pi_squared=true",
    )
    assert code == 0, err


def test_pf_ppo_without_gae_warns_that_it_has_no_effect(capsys):
    code, _, err = config_show(capsys, "grpo", "algorithm.use_pf_ppo=true")
    assert code == 0
    assert "config warning" in err and "use_pf_ppo=true has no effect" in err


# -------------------------------------------------------------- actor's loss


def _micro_batch(seed: int = 0) -> tuple[Batch, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    log_probs = -torch.rand(3, 4, generator=g) - 0.1
    batch = Batch.from_dict(
        {
            "response_mask": mask,
            "old_log_probs": log_probs + 0.3 * torch.randn(3, 4, generator=g),
            "advantages": torch.randn(3, 1, generator=g).expand(3, 4).contiguous(),
        }
    )
    return batch, log_probs


@pytest.mark.parametrize("loss_mode", ["sapo", "geo_mean", "cispo", "gpg"])
def test_the_actor_loss_passes_the_configured_parameters(loss_mode):
    overrides = [
        f"{ACTOR}.policy_loss.loss_mode={loss_mode}",
        f"{ACTOR}.clip_ratio_low=0.05",
        f"{ACTOR}.clip_ratio_high=0.15",
        f"{ACTOR}.tau_pos=0.6",
        f"{ACTOR}.tau_neg=2.5",
        f"{ACTOR}.use_kl_loss=false",
    ]
    cfg = load_config("grpo", overrides).actor_rollout_ref.actor
    mb, log_probs = _micro_batch()
    loss, metrics = actor_loss_fn(cfg)({"log_probs": log_probs}, mb)
    params = PolicyLossConfig(clip_ratio_low=0.05, clip_ratio_high=0.15, tau_pos=0.6, tau_neg=2.5)
    fn = POLICY_LOSSES.get(loss_mode)
    args = (log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"])
    expected, _ = fn(*args, config=params, agg=LossAggregation("token-mean"))
    default, _ = fn(*args, agg=LossAggregation("token-mean"))
    assert float(loss) == pytest.approx(float(expected), abs=1e-7)
    assert metrics["actor/pg_loss"] == pytest.approx(float(expected), abs=1e-7)
    if loss_mode != "gpg":  # GPG's loss has no parameter
        assert abs(float(default) - float(expected)) > 1e-4


def test_sapo_through_the_actor_averages_over_responses_whatever_the_mode():
    cfg = load_config(
        "grpo",
        [
            f"{ACTOR}.policy_loss.loss_mode=sapo",
            f"{ACTOR}.loss_agg_mode=seq-mean-token-sum",
            f"{ACTOR}.use_kl_loss=false",
        ],
    ).actor_rollout_ref.actor
    mb, log_probs = _micro_batch(1)
    loss, _ = actor_loss_fn(cfg, max_response_length=4)({"log_probs": log_probs}, mb)
    args = (log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"])
    expected, _ = sapo_policy_loss(*args, agg=LossAggregation("seq-mean-token-mean"))
    assert float(loss) == pytest.approx(float(expected), abs=1e-7)


@pytest.mark.parametrize("loss_mode", ["geo_mean", "sapo", "cispo"])
def test_engine_loss_and_gradient_do_not_depend_on_the_micro_batch_size(
    tiny_model_dir,  # noqa: F811
    loss_mode,
):
    cfg = load_config(
        "grpo", [f"{ACTOR}.policy_loss.loss_mode={loss_mode}", f"{ACTOR}.use_kl_loss=false"]
    ).actor_rollout_ref.actor
    batch = ragged_batch(8, seed=3)
    batch["advantages"] = batch["advantages"][:, :1].expand(8, batch["advantages"].shape[1])
    batch["old_log_probs"] = TrainEngine(tiny_model_dir).forward(batch)["log_probs"] + 0.05
    runs = {}
    for micro in (8, 3, 1):
        engine = TrainEngine(tiny_model_dir, optim=OPTIM)
        runs[micro] = engine.train_step(batch, actor_loss_fn(cfg), micro_batch_size=micro)
    for micro in (3, 1):
        for key in ("loss", "grad_norm", "actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac"):
            assert runs[micro][key] == pytest.approx(runs[8][key], rel=1e-4, abs=1e-7), key


# ---------------------------------------------------------- advantage stage


def scored_batch(scores, uids, step=3, width=4) -> Batch:
    """One row per sample, its score on the last real token, lengths 1..width."""
    n = len(scores)
    lengths = [1 + i % width for i in range(n)]
    mask = torch.tensor([[1] * k + [0] * (width - k) for k in lengths])
    token_scores = torch.zeros(n, width)
    for i, (k, s) in enumerate(zip(lengths, scores, strict=True)):
        token_scores[i, k - 1] = s
    uid = np.empty(n, dtype=object)
    uid[:] = list(uids)
    return Batch(
        {
            "response_mask": mask,
            "token_level_scores": token_scores,
            "scores": torch.tensor(scores, dtype=torch.float32),
            "values": torch.linspace(-1, 1, n * width).reshape(n, width),
            "row": torch.arange(n),
        },
        {"uid": uid},
        {"step": step},
    )


def test_gpg_through_the_advantage_stage():
    cfg = load_config("grpo", [*SMALL, "algorithm.adv_estimator=gpg"])
    batch = scored_batch([1.0, 0.0, 5.0, 3.0], ["a", "a", "b", "b"])
    AdvantageStage(cfg)(batch)
    expected, _ = gpg_advantages(batch["token_level_scores"], batch["response_mask"], batch["uid"])
    torch.testing.assert_close(batch["advantages"], expected)


GAE = [*SMALL, "algorithm.use_kl_in_reward=false"]


def _pf_ppo_cfg(*overrides: str):
    return load_config("ppo", [*GAE, "algorithm.use_pf_ppo=true", *overrides])


PF_SCORES = [0.1, -2.0, 0.0, 1.5, 0.3, 3.0, -0.2, 0.8]


def test_pf_ppo_resamples_whole_rows_after_gae():
    cfg = _pf_ppo_cfg()
    batch = scored_batch(PF_SCORES, [f"p{i}" for i in range(8)])
    before = {k: v.clone() for k, v in batch.tensors.items()}
    uids = batch["uid"].copy()
    metrics = AdvantageStage(cfg)(batch)
    rows = batch["row"]
    assert len(batch) == 8 and len(set(rows.tolist())) < 8  # drawn with replacement
    for key in ("token_level_scores", "response_mask", "values", "scores"):
        assert torch.equal(batch[key], before[key][rows]), key
    assert list(batch["uid"]) == [uids[i] for i in rows.tolist()]
    # the advantages were computed before the draw, on the original rows
    plain = scored_batch(PF_SCORES, [f"p{i}" for i in range(8)])
    AdvantageStage(load_config("ppo", GAE))(plain)
    assert torch.equal(batch["advantages"], plain["advantages"][rows])
    # extreme scores win under weights |score|^2: rows 1 and 5 hold most of the weight
    assert sum(int(r) in (1, 5) for r in rows) >= 5
    assert metrics["pf_ppo/unique_fraction"] == len(set(rows.tolist())) / 8


def test_pf_ppo_draw_is_a_function_of_seed_and_step():
    """A replayed step (same seed, same step, same batch) draws bitwise the same rows;
    another step or another run seed draws others."""

    def drawn(step, *overrides):
        batch = scored_batch(PF_SCORES, [f"p{i}" for i in range(8)], step=step)
        AdvantageStage(_pf_ppo_cfg(*overrides))(batch)
        return batch

    first, replay = drawn(3), drawn(3)
    assert first.equals(replay)
    assert torch.equal(first["advantages"], replay["advantages"])
    others = [drawn(4)["row"], drawn(3, "trainer.seed=2")["row"]]
    assert all(not torch.equal(first["row"], other) for other in others)
    # the draw is the one pf_ppo_resample makes from the run's (seed, step) stream
    cfg = _pf_ppo_cfg("algorithm.pf_ppo.reweight_method=max_min")
    batch = scored_batch(PF_SCORES, [f"p{i}" for i in range(8)], step=3)
    AdvantageStage(cfg)(batch)
    assert set(batch["row"].tolist()) <= {1, 5}  # the lowest and highest scores only


def test_pf_ppo_with_another_estimator_leaves_the_batch_as_it_is():
    cfg = load_config("grpo", [*SMALL, "algorithm.use_pf_ppo=true"], warn=lambda m: None)
    batch = scored_batch(PF_SCORES, ["a", "a", "b", "b", "c", "c", "d", "d"])
    metrics = AdvantageStage(cfg)(batch)
    assert batch["row"].tolist() == list(range(8)) and "pf_ppo/unique_fraction" not in metrics


def test_pf_ppo_needs_the_step():
    batch = scored_batch(PF_SCORES, [f"p{i}" for i in range(8)])
    batch.meta.clear()
    with pytest.raises(ValueError, match="meta 'step'"):
        AdvantageStage(_pf_ppo_cfg())(batch)


def test_the_stage_feeds_the_optimal_token_baseline_its_inputs():
    """Given `sum_pi_squared` in the batch (the log-prob pass's, with
    actor.calculate_sum_pi_squared), the stage passes it, the old log-probs and the
    rollout-correction weights."""
    cfg = load_config(
        "grpo",
        [
            *SMALL,
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.adv_estimator=optimal_token_baseline",
            f"{ACTOR}.calculate_sum_pi_squared=true",
        ],
    )
    batch = scored_batch([1.0, 0.0, 5.0, 3.0, 2.0, 2.5], ["a", "a", "a", "b", "b", "b"])
    g = torch.Generator().manual_seed(0)
    batch["old_log_probs"] = -torch.rand(6, 4, generator=g)
    batch["rollout_log_probs"] = batch["old_log_probs"] + 0.3 * torch.randn(6, 4, generator=g)
    batch["sum_pi_squared"] = torch.rand(6, 4, generator=g)
    AdvantageStage(cfg)(batch)
    mask = batch["response_mask"]
    weights, _ = truncated_is_weights(batch["old_log_probs"], batch["rollout_log_probs"], mask)
    expected, _ = compute_advantages(
        "optimal_token_baseline",
        token_level_rewards=batch["token_level_scores"],
        response_mask=mask,
        index=batch["uid"],
        old_log_probs=batch["old_log_probs"],
        sum_pi_squared=batch["sum_pi_squared"],
        rollout_is_weights=weights,
    )
    torch.testing.assert_close(batch["advantages"], expected)
    unweighted, _ = optimal_token_baseline_advantages(
        batch["token_level_scores"],
        mask,
        batch["uid"],
        batch["old_log_probs"],
        batch["sum_pi_squared"],
    )
    assert (unweighted - expected).abs().max() > 1e-4


def test_pf_ppo_resample_is_what_the_stage_draws():
    """The stage's draw is `pf_ppo_resample` on the row scores, with the stream seeded from
    the run seed and the step (so the algorithm, not the stage, decides the rows)."""
    import random

    cfg = _pf_ppo_cfg()
    batch = scored_batch(PF_SCORES, [f"p{i}" for i in range(8)], step=7)
    AdvantageStage(cfg)(batch)
    seed = random.Random(f"{cfg.trainer.seed}:pf_ppo:7").getrandbits(63)
    rows = pf_ppo_resample(torch.tensor(PF_SCORES), "pow", 2.0, torch.Generator().manual_seed(seed))
    assert torch.equal(batch["row"], rows)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_batch_normalize_divides_the_weights_by_their_batch_mean(level):
    """verl's rollout_is_batch_normalize: the advantage stage puts the mean of the whole
    batch's truncated weights (over tokens, or over responses) beside the rows, and the
    actor's loss divides every weight by it."""
    rc = "algorithm.rollout_correction"
    cfg = load_config(
        "grpo",
        [
            *SMALL,
            f"{rc}.rollout_is={level}",
            f"{rc}.rollout_is_batch_normalize=true",
            f"{ACTOR}.use_kl_loss=false",
        ],
    )
    batch = scored_batch([1.0, 0.0, 5.0, 3.0], ["a", "a", "b", "b"])
    g = torch.Generator().manual_seed(0)
    batch["old_log_probs"] = -torch.rand(4, 4, generator=g) - 0.1
    batch["rollout_log_probs"] = batch["old_log_probs"] + 0.4 * torch.randn(4, 4, generator=g)
    metrics = AdvantageStage(cfg)(batch)
    mask = batch["response_mask"].bool()
    weights, _ = truncated_is_weights(
        batch["old_log_probs"], batch["rollout_log_probs"], mask, cap=2.0, level=level
    )
    if level == "token":
        factor = float(weights[mask].mean())
    else:
        factor = float(
            torch.stack([w[m].mean() for w, m in zip(weights, mask, strict=True)]).mean()
        )
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor, rel=1e-6)
    torch.testing.assert_close(batch["rollout_is_norm"], torch.full((4,), factor))
    loss_fn = actor_loss_fn(
        cfg.actor_rollout_ref.actor, correction=cfg.algorithm.rollout_correction
    )
    outputs = {"log_probs": batch["old_log_probs"] + 0.05}
    normalised, _ = loss_fn(outputs, batch)
    kept = [k for k in [*batch.tensors, *batch.non_tensors] if k != "rollout_is_norm"]
    plain, _ = loss_fn(outputs, batch.select(*kept))
    assert float(normalised) * factor == pytest.approx(float(plain), rel=1e-5)  # linear in w
    assert is_batch_norm_factor(torch.zeros(2, 3), torch.ones(2, 3)) == 1.0


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_bypass_mode_trains_against_the_rollouts_log_probs(loss_type):
    """verl's bypass mode: the old log-probs are the rollout's. reinforce: -A * log_prob
    weighted by the truncated current/rollout ratio, normalised over the micro-batch;
    ppo_clip: the configured PPO loss on the ratio to the rollout, with no weight."""
    rc = "algorithm.rollout_correction"
    cfg = load_config(
        "grpo",
        [
            *SMALL,
            f"{rc}.bypass_mode=true",
            f"{rc}.loss_type={loss_type}",
            f"{rc}.rollout_is=sequence",
            f"{rc}.rollout_is_batch_normalize=true",
            f"{ACTOR}.use_kl_loss=false",
        ],
    )
    mb, log_probs = _micro_batch()
    mb["rollout_log_probs"] = mb["old_log_probs"]  # what the trainer sets in bypass mode
    loss_fn = actor_loss_fn(
        cfg.actor_rollout_ref.actor, correction=cfg.algorithm.rollout_correction
    )
    loss, _ = loss_fn({"log_probs": log_probs}, mb)
    args = (log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"])
    agg = LossAggregation("token-mean")
    if loss_type == "reinforce":
        weights, _ = truncated_is_weights(
            log_probs, mb["rollout_log_probs"], mb["response_mask"], cap=2.0, level="sequence"
        )
        weights = weights / is_batch_norm_factor(weights, mb["response_mask"], "sequence")
        expected, _ = POLICY_LOSSES.get("reinforce")(*args, agg=agg, is_weights=weights)
    else:
        expected, _ = POLICY_LOSSES.get("vanilla")(*args, agg=agg)
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    with pytest.raises(Exception, match="bypass_mode=true takes the rollout's log-probs"):
        load_config(
            "grpo",
            [
                *SMALL,
                f"{rc}.bypass_mode=true",
                "actor_rollout_ref.rollout.calculate_log_probs=false",
            ],
        )
