"""The reward role scaled out, through the product path (`Run(PPOTrainer)`, GRPO with two
actor ranks on a real local Ray, a tiny model from config, a reward function that gives
extras and fails on some samples):

three reward workers (`reward.workers_per_node=3`), one of them SIGKILLed in the middle
of a step's scoring, end a run exactly as one reward worker does (final weights
bitwise, every deterministic metric, the reward's included): the killed worker is
replaced (the replay's record names it, with a new pid) and the step replayed. After
the run, the three score a batch exactly as one reward worker in this process does
(scores, token scores, errors, extras, row order), each taking the rows the trainer's
node split gives it. (One run serves both: a second would double the test's time.)
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import start_local_ray
from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.testing.chaos import compare_runs, final_weights
from rayrl.testing.faults import Fault, inject
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run
from rayrl.trainer.scoring import reward_rows
from rayrl.workers import RewardWorker
from rayrl.workers.reward import reward_metrics
from workers_cases import local_worker

pytestmark = pytest.mark.slow

REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    n = len(solution_str)
    if n % 5 == 1:
        raise ValueError(f"no answer in {n} characters")
    return {"score": (n % 7) / 7.0, "acc": float(n % 2), "chars": n}
"""

RUN = [
    "data.train_batch_size=4",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=2",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.logger=[jsonl]",
    "reward.max_error_rate=1.0",
    "reward.num_workers=1",
]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    return path


def _run(out: Path, reward_file: Path, extra: list[str], before_fit=None, after_fit=None) -> dict:
    cfg = load_config(
        "grpo",
        [*RUN, *extra, f"custom_reward_function.path={reward_file}", f"trainer.output_dir={out}"],
    )
    run = Run(PPOTrainer(cfg, print_fn=lambda line: None))
    checked = None
    try:
        run.setup()
        if before_fit is not None:
            before_fit(run)
        history = run.fit()
        checked = after_fit(run) if after_fit is not None else None
    finally:
        run.shutdown()
    return {
        "history": history,
        "ledger": run.replay.ledger,
        "weights": final_weights(out),
        "recoveries": run.replay.recoveries,
        "checked": checked,
    }


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory, reward_file):
    start_local_ray()
    return _run(tmp_path_factory.mktemp("one"), reward_file, ["reward.workers_per_node=1"])


def _same_run(clean: dict, other: dict) -> None:
    compared = compare_runs(clean, other)
    assert compared["weights_identical"], compared
    assert compared["metrics_identical"], compared["metrics_differ"]
    assert compared["ledger_identical"], compared


def _responses(tokenizer, texts: list[str]) -> Batch:
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    responses = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        responses[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
    return Batch.from_dict(
        {
            "responses": responses,
            "response_mask": mask,
            "data_source": ["arithmetic"] * len(ids),
            "ground_truth": ["7"] * len(ids),
        }
    )


TEXTS = ["7", "it is 7", "x", "the answer is 12", "no", "maybe 3 or 7", "seven"]


def _score_like_one_worker(run: Run) -> dict:
    """Score TEXTS through the trainer (split over its reward workers by node) and with
    one reward worker in this process; what each gave, and how the rows were split."""
    trainer = run.trainer
    roles = trainer.roles
    batch = _responses(trainer.tokenizer, TEXTS)
    split = reward_rows(batch, roles.hybrid, roles.reward)
    single = local_worker(RewardWorker, config=trainer.cfg, tokenizer_path=trainer.model_path)
    try:
        alone = single.score(batch)
    finally:
        single.source.close()
    return {
        "scored": trainer.score(batch),
        "alone": alone,
        "sizes": [len(part) for part in split.parts],
        "nodes": (
            [b.node_id for b in roles.hybrid.bundles],
            [b.node_id for b in roles.reward.bundles],
        ),
    }


def test_three_reward_workers_one_killed_mid_step_score_and_train_as_one(
    tmp_path, reward_file, one_worker
):
    """Three reward workers, rank 1 SIGKILLed 0.2 s into the first step's scoring (in its
    own process): replaced, and the run ends as the one-worker run, bitwise."""

    def kill_rank_one(run: Run) -> None:
        reward = run.trainer.roles.reward
        assert reward.world_size == 3 and reward is not run.trainer.roles.hybrid
        inject(reward, Fault("compute_score", "kill", ranks=(1,), after_s=0.2))

    three = _run(
        tmp_path,
        reward_file,
        ["reward.workers_per_node=3"],
        before_fit=kill_rank_one,
        after_fit=_score_like_one_worker,
    )
    _same_run(one_worker, three)
    [recovery] = three["recoveries"]
    [replaced] = recovery["replaced"]
    assert replaced["group"].endswith("/reward") and replaced["rank"] == 1
    assert replaced["new_pid"] != replaced["old_pid"]
    assert "compute_score" in recovery["stage"]
    assert any(row["reward/errors"] > 0 for row in three["history"])  # failures were scored
    assert all("reward/chars/mean" in row for row in three["history"])
    checked = three["checked"]
    actor_nodes, reward_nodes = checked["nodes"]
    assert len(reward_nodes) == 3 and set(reward_nodes) == set(actor_nodes)
    assert checked["sizes"] == [3, 2, 2]  # the node's 7 rows over its 3 reward workers
    scored, alone = checked["scored"], checked["alone"]
    for key in ("scores", "token_level_scores"):
        assert torch.equal(scored[key], alone[key]), key
    assert list(scored["reward_error"]) == list(alone["reward_error"])
    assert list(scored["reward_extra"]) == list(alone["reward_extra"])
    assert [e.get("chars") for e in scored["reward_extra"]] == [
        None if len(t) % 5 == 1 else len(t) for t in TEXTS
    ]  # row order kept
    clock = "reward/elapsed_s/"
    assert {k: v for k, v in reward_metrics(scored).items() if not k.startswith(clock)} == {
        k: v for k, v in reward_metrics(alone).items() if not k.startswith(clock)
    }
    assert isinstance(scored["reward_extra"], np.ndarray)
