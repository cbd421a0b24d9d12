"""One error budget for every reward kind (`reward.max_error_rate`): a reward function
that fails on every sample (raises, returns NaN, None or a string), under each of
verl's reward managers, stops the run naming the function, the counts and the first
failures; under the rate the run goes on with the failed samples scoring 0."""

from __future__ import annotations

import textwrap

import pytest

from conftest import subprocess_pythonpath
from rayrl.config import load_config
from rayrl.rewards.budget import ErrorBudget, RewardErrorRateError
from rayrl.rewards.result import RewardResult, failed

REWARDS = """
def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("answer")

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")

def none(data_source, solution_str, ground_truth, extra_info=None):
    return None

def text(data_source, solution_str, ground_truth, extra_info=None):
    return "correct"

def batch_of_strings(data_sources, solution_strs, ground_truths, extra_infos=None):
    return ["1.0" for _ in solution_strs]
"""

# (reward manager, function in REWARDS, the reason each sample failed)
FAILING = [
    ("naive", "raises", "KeyError"),
    ("prime", "nan", "non-finite score"),
    ("dapo", "none", "got NoneType"),
    ("batch", "batch_of_strings", "str"),
]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_reward.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rayrl.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "m", layers=1, hidden=32)


def _batch(tokenizer, n: int):
    from workers_cases import forced_batch, prompts

    batch = prompts(tokenizer, n)
    return forced_batch(batch, token=5, length=3).union(batch.select("data_source", "ground_truth"))


def _worker(model_dir, overrides: list[str]):
    from rayrl.workers import RewardWorker
    from workers_cases import local_worker

    settings = [*overrides, "reward.num_workers=1"]
    return local_worker(
        RewardWorker, config=load_config("grpo", settings), tokenizer_path=str(model_dir)
    )


@pytest.mark.parametrize(("manager", "name", "reason"), FAILING)
def test_a_function_failing_on_every_sample_stops_under_each_manager(
    reward_file, model_dir, manager, name, reason
):
    """The reward worker scores the failed samples 0 with their reasons; the run's budget
    (the trainer's `RewardErrors`, which sees every reward worker's rows) stops the run."""
    from rayrl.trainer.scoring import RewardErrors

    function = [
        f"custom_reward_function.path={reward_file}",
        f"custom_reward_function.name={name}",
        f"reward.reward_manager.name={manager}",
    ]
    worker = _worker(model_dir, function)
    try:
        batch = _batch(worker.tokenizer, 4)
        out = worker.compute_score(batch)
    finally:
        worker.source.close()
    assert out["scores"].tolist() == [0.0] * 4
    assert all(reason in e for e in out["reward_error"])
    assert worker.stats()["errors"] == 4  # counted, not enforced, in the worker
    scored = batch.union(out)
    strict = RewardErrors(load_config("grpo", function))
    with pytest.raises(RewardErrorRateError) as info:
        strict.check(scored, worker.tokenizer.batch_decode)
    text = str(info.value)
    assert f"reward function {name} in {reward_file}" in text
    assert f"reward manager {manager}" in text
    assert "failed on 4 of 4 samples" in text and "reward.max_error_rate=0.5" in text
    assert text.count("    sample ") == 3 and reason in text  # the first three, with why
    assert "fix the function" in text and "raise reward.max_error_rate" in text
    tolerant = RewardErrors(load_config("grpo", [*function, "reward.max_error_rate=1.0"]))
    tolerant.check(scored, worker.tokenizer.batch_decode)
    assert tolerant.state_dict()["errors"] == 4


class Scripted:
    """A reward source answering each call with the next list of outcomes (True: ok)."""

    def __init__(self, calls: list[list[bool]]) -> None:
        self.calls = iter(calls)

    def score(self, items):
        return [
            RewardResult(1.0) if ok else failed(f"bad {item['solution_str']}")
            for ok, item in zip(next(self.calls), items, strict=True)
        ]


def _items(n: int, start: int = 0) -> list[dict]:
    return [
        {"data_source": "t", "solution_str": f"r{start + i}", "ground_truth": "1"} for i in range(n)
    ]


def test_the_rate_counts_samples_over_the_run_and_quotes_the_first_failures():
    calls = [[True, False, True, True], [False, True, False, True], [False, False, False, False]]
    budget = ErrorBudget(Scripted(calls), 0.5, reward="reward function f in f.py")
    budget.score(_items(4))  # 1 of 4
    budget.score(_items(4, 4))  # 3 of 8: under the rate, the run goes on
    assert budget.stats() == {"items": 8, "errors": 3, "outages": 0}
    with pytest.raises(RewardErrorRateError) as info:
        budget.score(_items(4, 8))  # 7 of 12 > 0.5
    text = str(info.value)
    assert text.startswith(
        "reward function f in f.py failed on 7 of 12 samples scored so far (58%)"
    )
    # the run's first three failures, by their sample number over the run
    assert "sample 1 (" in text and "sample 4 (" in text and "sample 6 (" in text
    assert "bad r1" in text and "bad r8" not in text


def test_a_rate_of_one_never_stops_and_the_rate_is_checked():
    budget = ErrorBudget(Scripted([[False] * 3]), 1.0)
    assert [r.score for r in budget.score(_items(3))] == [0.0] * 3
    with pytest.raises(ValueError, match=r"reward.max_error_rate=1.5 must be in \[0, 1\]"):
        ErrorBudget(Scripted([]), 1.5)


def test_the_config_names_the_policy_of_each_reward_kind(reward_file):
    from rayrl.config import ConfigError
    from rayrl.workers.reward import error_policy

    cfg = load_config("grpo", [f"custom_reward_function.path={reward_file}"])
    rate, key, reward, _ = error_policy(cfg)
    assert (rate, key) == (0.5, "reward.max_error_rate")
    assert f"compute_score in {reward_file}" in reward
    http = load_config(
        "grpo", ["reward.http.url=http://127.0.0.1:9/s", "reward.max_error_rate=0.2"]
    )
    assert error_policy(http)[:3] == (
        0.2,
        "reward.max_error_rate",
        "HTTP reward http://127.0.0.1:9/s",
    )
    own = load_config(
        "grpo", ["reward.http.url=http://127.0.0.1:9/s", "reward.http.max_error_rate=0.9"]
    )
    assert error_policy(own)[:2] == (0.9, "reward.http.max_error_rate")
    builtin = load_config("grpo", ["reward.reward_manager.name=dapo"])
    assert error_policy(builtin)[2] == "the built-in reward scorers (reward manager dapo)"
    model = load_config("grpo", ["reward_model.enable=true", "reward_model.model.path=/rm"])
    assert error_policy(model)[2] == "reward model /rm"
    for key in ("reward.max_error_rate", "reward.http.max_error_rate"):
        with pytest.raises(
            ConfigError, match=rf"{key}=-0.1 is out of range: use a value in \[0, 1\]"
        ):
            load_config("grpo", [f"{key}=-0.1"])


@pytest.mark.slow
def test_rayrl_train_stops_with_a_reward_error_when_the_function_always_fails(
    reward_file, tmp_path
):
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    cmd = [
        sys.executable,
        "-m",
        "rayrl.cli.main",
        "train",
        "-c",
        "grpo",
        "trainer.total_training_steps=2",
        "trainer.device=cpu",
        "data.train_batch_size=2",
        "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.val_before_train=false",
        "trainer.export_hf=false",
        f"custom_reward_function.path={reward_file}",
        "custom_reward_function.name=none",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "PYTHONPATH": subprocess_pythonpath(src), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert f"reward error: reward function none in {reward_file}" in done.stderr, out[-3000:]
    assert "failed on 4 of 4 samples" in done.stderr and "got NoneType" in done.stderr
    assert "Traceback" not in out, out[-3000:]
