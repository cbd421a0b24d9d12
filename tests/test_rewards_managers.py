"""verl's reward managers in rayrl (`reward.reward_manager.name`), with real spawned
scoring processes: `batch` calls a batched compute_score once with the lists of all
samples, `dapo` reports a plain-number score as `acc` too, `naive`/`prime` score one
sample per call; `reward_kwargs` reach every call. Plus the trackers' missing-package
message for swanlab."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rayrl.rewards import make_scorer, spec_from_config
from rayrl.rewards.loader import RewardFunctionError

REWARDS = """
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return float(solution_str == ground_truth) + bonus

def batched(data_sources, solution_strs, ground_truths, extra_infos=None, bonus=0.0):
    pid = os.getpid()  # one process makes every score of a call
    return [
        {"score": float(s == g) + bonus, "pid": pid, "n": len(solution_strs)}
        for s, g in zip(solution_strs, ground_truths)
    ]

def batched_wrong_length(data_sources, solution_strs, ground_truths, extra_infos=None):
    return [1.0]
"""

ITEMS = [
    {"data_source": "t", "solution_str": a, "ground_truth": b, "extra_info": None}
    for a, b in (("1", "1"), ("2", "3"), ("4", "4"))
]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def test_batch_calls_the_function_once_with_the_lists_and_kwargs(reward_file):
    spec = spec_from_config(str(reward_file), "batched", {"bonus": 0.5})
    scorer = make_scorer("batch", spec, num_workers=4, timeout_s=5.0)
    try:
        results = scorer.score(ITEMS)
        assert [r.score for r in results] == [1.5, 0.5, 1.5]
        assert {r.extra["n"] for r in results} == {3}  # one call saw all three samples
        assert len({r.extra["pid"] for r in results}) == 1
        assert scorer.stats()["calls"] == 3
    finally:
        scorer.close()


def test_batch_with_a_wrong_answer_fails_each_sample_and_builtins_score_one_by_one(reward_file):
    scorer = make_scorer("batch", (str(reward_file), "batched_wrong_length"), 1, 5.0)
    try:
        results = scorer.score(ITEMS)
        assert all(r.score == 0.0 and "list of 3 scores" in r.error for r in results)
    finally:
        scorer.close()
    builtin = make_scorer("batch", None, 1, 5.0)  # no file: the built-in scorers, per sample
    try:
        (result,) = builtin.score(
            [{"data_source": "gsm8k", "solution_str": "#### 7", "ground_truth": "7"}]
        )
        assert result.ok and result.score == 1.0
    finally:
        builtin.close()


def test_dapo_reports_a_number_as_acc_and_naive_does_not(reward_file):
    spec = spec_from_config(str(reward_file), "compute_score")
    for manager, acc in (("dapo", [1.0, 0.0, 1.0]), ("naive", None)):
        scorer = make_scorer(manager, spec, num_workers=2, timeout_s=5.0)
        try:
            results = scorer.score(ITEMS)
        finally:
            scorer.close()
        assert [r.score for r in results] == [1.0, 0.0, 1.0]
        assert [r.extra.get("acc") for r in results] == (acc or [None] * 3)


def test_bad_managers_specs_and_kwargs_fail_at_construction(reward_file):
    with pytest.raises(LookupError, match="Did you mean 'batch'"):
        make_scorer("bach", None, 1, 5.0)
    with pytest.raises(RewardFunctionError, match="takes no argument"):
        make_scorer("naive", spec_from_config(str(reward_file), "compute_score", {"x": 1}), 1, 5.0)
    with pytest.raises(RewardFunctionError, match="data_sources"):
        make_scorer("batch", (str(reward_file), "compute_score"), 1, 5.0)
    with pytest.raises(RewardFunctionError, match="built-in scorers take no extra"):
        make_scorer("naive", spec_from_config(None, "compute_score", {"x": 1}), 1, 5.0)


def test_swanlab_missing_names_the_extra_to_install(monkeypatch):
    from rayrl.trainer.tracking import TrackerUnavailable, check_trackers

    monkeypatch.setitem(sys.modules, "swanlab", None)  # what Python does for a missing package
    with pytest.raises(TrackerUnavailable, match=r"pip install 'rayrl\[swanlab\]'"):
        check_trackers(["console", "swanlab"])
