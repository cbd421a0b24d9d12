"""The trainer's controller-side stages without Ray: advantages over prompt groups, the
adaptive KL controller, ReMax's greedy baseline, DAPO's overlong penalty, truncation
masking and dynamic sampling, and the critic's warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.trainer.advantage import AdvantageStage, greedy_baselines, shape_rewards
from rayrl.trainer.dynamic_sampling import DynamicSamplingError, fill_batch


def _cfg(*overrides: str):
    return load_config(
        "grpo",
        [
            "data.train_batch_size=2",
            "data.max_response_length=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            *overrides,
        ],
    )


def _objects(values) -> np.ndarray:
    values = list(values)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def scored_batch(uids, scores, lengths=None, finish=None, extra=None) -> Batch:
    """Samples of prompts `uids` (one row each) with a score on the last real token."""
    n, width = len(uids), 4
    lengths = lengths or [width] * n
    mask = torch.tensor([[1] * k + [0] * (width - k) for k in lengths])
    token_scores = torch.zeros(n, width)
    for i, (k, s) in enumerate(zip(lengths, scores, strict=True)):
        token_scores[i, k - 1] = s
    return Batch(
        {
            "response_mask": mask,
            "token_level_scores": token_scores,
            "scores": torch.tensor(scores, dtype=torch.float32),
            "input_ids": torch.arange(n * 6).reshape(n, 6),
        },
        {
            "uid": _objects(uids),
            "sample_uid": _objects(f"{u}/{i}" for i, u in enumerate(uids)),
            "finish_reason": _objects(finish or ["stop"] * n),
            "reward_extra": _objects(extra or [{}] * n),
        },
    )


def test_grpo_advantages_compare_the_samples_of_each_prompt():
    batch = scored_batch(["a", "a", "b", "b"], [1.0, 0.0, 5.0, 3.0])
    AdvantageStage(_cfg())(batch)
    adv = batch["advantages"][:, 0]
    # each prompt's group on its own: (score - group mean) / group std (Bessel) = +-0.7071
    torch.testing.assert_close(
        adv, torch.tensor([0.7071, -0.7071, 0.7071, -0.7071]), atol=1e-3, rtol=0
    )


def test_huge_scores_keep_the_advantages_and_their_logged_spread():
    """Scores of 1e30 on some samples: the stage's advantages and the metrics that show
    them (verl's critic/advantages/mean, max, min) keep their usual size."""
    batch = scored_batch(["a", "a", "b", "b"], [1e30, 0.0, 0.0, 0.0])
    metrics = AdvantageStage(_cfg())(batch)
    assert metrics["critic/advantages/max"] == pytest.approx(0.7071, abs=1e-3)
    assert metrics["critic/advantages/min"] == pytest.approx(-0.7071, abs=1e-3)
    assert metrics["critic/returns/max"] == pytest.approx(0.7071, abs=1e-3)
    assert abs(metrics["critic/advantages/mean"]) < 1e-6


def test_adaptive_kl_controller_steers_the_reward_penalty():
    cfg = _cfg(
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.1",
        "algorithm.kl_ctrl.target_kl=0.01",
        "algorithm.kl_ctrl.horizon=10",
        "algorithm.kl_penalty=k1",
    )
    stage = AdvantageStage(cfg)
    coefs = []
    for _ in range(3):
        batch = scored_batch(["a", "a", "b", "b"], [1.0, 0.0, 5.0, 3.0])
        batch["old_log_probs"] = torch.full((4, 4), -1.0)
        batch["ref_log_prob"] = torch.full((4, 4), -1.5)  # KL 0.5, far above the target
        coefs.append(stage(batch)["actor/reward_kl_penalty_coeff"])
        penalty = batch["token_level_scores"] - batch["token_level_rewards"]
        assert float(penalty[0, 0]) == pytest.approx(0.5 * coefs[-1], rel=1e-5)
    # each step: coef *= 1 + clip(0.5 / 0.01 - 1, -0.2, 0.2) * 4 samples / 10
    assert coefs == pytest.approx([0.1, 0.108, 0.11664], rel=1e-5)


def test_adaptive_kl_without_kl_in_reward_is_refused():
    with pytest.raises(Exception, match="use_kl_in_reward=true"):
        _cfg("algorithm.kl_ctrl.type=adaptive")


def test_remax_subtracts_each_prompts_greedy_score():
    cfg = _cfg("algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.n=2")
    batch = scored_batch(["a", "a", "b", "b"], [1.0, 0.0, 5.0, 3.0])
    greedy = scored_batch(["b", "a"], [4.5, 0.25])
    batch["reward_baselines"] = greedy_baselines(batch, greedy)
    AdvantageStage(cfg)(batch)
    torch.testing.assert_close(batch["advantages"][:, 0], torch.tensor([0.75, -0.25, 0.5, -1.5]))


def test_overlong_penalty_and_truncated_samples_masking():
    cfg = _cfg(
        "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=2",
        "reward_model.overlong_buffer.penalty_factor=1.0",
        "reward_model.overlong_buffer.log=true",
        "algorithm.mask_truncated_samples=true",
    )
    batch = scored_batch(
        ["a", "a", "b", "b"],
        [1.0, 1.0, 0.0, 1.0],
        lengths=[2, 3, 4, 1],
        finish=["stop", "stop", "length", "stop"],
    )
    metrics = shape_rewards(cfg, batch)
    # L = 4, buffer 2: no penalty up to length 2, then -(length - 2) / 2
    torch.testing.assert_close(batch["scores"], torch.tensor([1.0, 0.5, -1.0, 1.0]))
    assert float(batch["token_level_scores"][1, 2]) == 0.5
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.375)
    out = AdvantageStage(cfg)(batch)
    assert out["response_length/masked_truncated"] == 1
    assert batch["response_mask"][2].sum() == 0 and batch["response_mask"][3].sum() == 1


def test_dynamic_sampling_keeps_varying_groups_until_the_batch_is_full():
    cfg = _cfg(
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "actor_rollout_ref.rollout.n=2",
        "algorithm.filter_groups.max_num_gen_batches=3",
    )
    acc = [{"acc": v} for v in (1, 1, 0, 1)]  # prompt a: all right (dropped); b varies
    first = scored_batch(["a", "a", "b", "b"], [1, 1, 0, 1], extra=acc)
    rounds = []

    def next_round(r: int) -> Batch:
        rounds.append(r)
        extra = [{"acc": v} for v in (0, 1, 0, 0, 1, 0)]
        return scored_batch(
            [f"c{r}", f"c{r}", f"d{r}", f"d{r}", f"e{r}", f"e{r}"], [0, 1, 0, 0, 1, 0], extra=extra
        )

    batch, metrics = fill_batch(cfg, first, next_round)
    assert rounds == [1]
    assert list(batch["uid"]) == ["b", "b", "c1", "c1"]  # exactly train_batch_size groups
    assert metrics["train/num_gen_batches"] == 2
    assert metrics["train/kept_group_ratio"] == pytest.approx(3 / 5)


def test_rounds_of_other_prompt_widths_pad_a_routing_record_as_unrouted():
    """Each generation round pads its prompts to its own longest: stacked, a narrower
    round's routing record is padded on the left with the no-routing mark (expert 0
    would be a routing), aligned with its input_ids."""
    from rayrl.algos.routing import ROUTES, unrouted
    from rayrl.trainer.dynamic_sampling import concat_left_padded

    def round_of(width: int, expert: int) -> Batch:
        ids = torch.ones(2, width + 3, dtype=torch.long)
        return Batch({"input_ids": ids, ROUTES: torch.full((2, width + 3, 2, 2), expert).byte()})

    both = concat_left_padded([round_of(4, 1), round_of(2, 3)])
    routes, ids = both[ROUTES], both["input_ids"]
    assert routes.shape == (4, 7, 2, 2) and ids.shape == (4, 7)
    assert bool((routes[2:, :2] == unrouted(torch.uint8)).all()) and not ids[2:, :2].any()
    assert bool((routes[2:, 2:] == 3).all()) and bool((routes[:2] == 1).all())


def test_dynamic_sampling_fails_past_its_bound_with_the_numbers():
    cfg = _cfg(
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=score",
        "actor_rollout_ref.rollout.n=2",
        "algorithm.filter_groups.max_num_gen_batches=2",
    )
    same = scored_batch(["a", "a", "b", "b"], [1, 1, 0, 0])
    with pytest.raises(
        DynamicSamplingError, match=r"kept 0 of 2 prompt groups after 2 generation rounds"
    ):
        fill_batch(cfg, same, lambda r: scored_batch([f"x{r}"] * 2, [1, 1]))


def test_critic_warmup_holds_the_actor_for_its_steps(tmp_path):
    from rayrl.models import build_tiny_model
    from rayrl.trainer.ppo import PPOTrainer

    model = build_tiny_model(tmp_path / "m", layers=1, hidden=32)
    cfg = load_config("ppo", [f"actor_rollout_ref.model.path={model}", "trainer.critic_warmup=2"])
    trainer = PPOTrainer(cfg)
    learns = [trainer.actor_learns(step) for step in range(4)]
    assert learns == [False, False, True, True]


def test_with_the_kl_penalty_in_the_reward_advantages_come_from_the_penalised_rewards():
    """GAE must see the rewards after the KL penalty, not the raw scores: a per-token
    penalty that differs between samples changes their advantages."""
    from rayrl.algos import compute_advantages

    cfg = load_config(
        "ppo",
        [
            "data.train_batch_size=2",
            "data.max_response_length=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "critic.ppo_mini_batch_size=1",
            "critic.ppo_micro_batch_size_per_gpu=1",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.kl_coef=0.5",
            "algorithm.kl_penalty=k1",
        ],
    )
    batch = scored_batch(["a", "a", "b", "b"], [1.0, 0.0, 5.0, 3.0])
    batch["values"] = torch.zeros(4, 4)
    batch["old_log_probs"] = torch.full((4, 4), -1.0)
    batch["ref_log_prob"] = torch.tensor([[-1.0] * 4, [-2.0] * 4, [-1.5] * 4, [-1.0] * 4])
    AdvantageStage(cfg)(batch)
    penalised = batch["token_level_rewards"]
    assert not torch.equal(penalised, batch["token_level_scores"])
    kwargs = dict(response_mask=batch["response_mask"], index=batch["uid"], values=batch["values"])
    kwargs.update(gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam)
    want, _ = compute_advantages("gae", token_level_rewards=penalised, **kwargs)
    raw, _ = compute_advantages("gae", token_level_rewards=batch["token_level_scores"], **kwargs)
    torch.testing.assert_close(batch["advantages"], want)
    assert not torch.allclose(batch["advantages"], raw)


def test_each_stage_is_sent_only_the_columns_it_reads():
    from rayrl.trainer.stages import only_reads
    from rayrl.workers.actor import update_actor_reads
    from rayrl.workers.critic import UPDATE_CRITIC_READS
    from rayrl.workers.log_prob_pass import LOG_PROB_READS
    from rayrl.workers.reward import SCORE_READS

    n, p, r = 2, 3, 4
    ints = torch.ones(n, p + r, dtype=torch.long)
    floats = torch.zeros(n, r)
    batch = Batch(
        {
            "prompts": ints[:, :p],
            "responses": ints[:, p:],
            "response_mask": ints[:, p:],
            "input_ids": ints,
            "attention_mask": ints,
            "position_ids": ints,
            "rollout_log_probs": floats,
            "old_log_probs": floats,
            "ref_log_prob": floats,
            "advantages": floats,
            "returns": floats,
            "values": floats,
        },
        {"uid": ["a", "b"], "data_source": ["x", "x"], "ground_truth": ["1", "2"]},
        meta={"step": 3},
    )
    engine = {"input_ids", "attention_mask", "position_ids", "response_mask"}
    sent = only_reads(batch, LOG_PROB_READS)  # the rollout's log-probs for the probs sums
    assert set(sent.keys()) == engine | {"rollout_log_probs"} and sent.meta == {"step": 3}
    assert sent["input_ids"].data_ptr() == ints.data_ptr()  # shared, not copied
    scored = set(only_reads(batch, SCORE_READS).keys())
    assert scored == {"responses", "response_mask", "data_source", "ground_truth"}
    critic = set(only_reads(batch, UPDATE_CRITIC_READS).keys())
    assert critic == engine | {"values", "returns"}
    kl = set(update_actor_reads(_cfg("actor_rollout_ref.actor.use_kl_loss=true")))
    # the rollout's log-probs: an on-policy update reports verl's probs-diff from them;
    # the rows' images where prompts have them (a vision-language policy's)
    read = {"advantages", "old_log_probs", "ref_log_prob", "rollout_log_probs"}
    assert engine | read | {"multi_modal_inputs"} == kl
    plain = set(update_actor_reads(_cfg("actor_rollout_ref.actor.use_kl_loss=false")))
    assert plain == kl - {"ref_log_prob"}
    unrecorded = _cfg("actor_rollout_ref.rollout.calculate_log_probs=false")
    assert set(update_actor_reads(unrecorded)) == kl - {"rollout_log_probs"}
    corrected = update_actor_reads(_cfg("algorithm.rollout_correction.rollout_is=token"))
    assert {"rollout_log_probs", "rollout_is_norm"} <= set(corrected)
