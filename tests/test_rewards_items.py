"""Reward items from verl-layout dataset columns, and batch summaries of results."""

from __future__ import annotations

import numpy as np
import pytest

from rayrl.rewards import RewardResult, compute_score, make_items, summarize


def test_make_items_reads_ground_truth_from_reward_model():
    items = make_items(
        ["openai/gsm8k", "countdown"],
        ["#### 72", "<answer>1+2</answer>"],
        [
            {"style": "rule", "ground_truth": "72"},
            {"style": "rule", "ground_truth": {"target": 3, "numbers": np.array([1, 2])}},
        ],
        extra_infos=[{"index": 0}, {"index": 1}],
        prompts=[[{"role": "user", "content": "q0"}], [{"role": "user", "content": "q1"}]],
    )
    assert items[0] == {
        "data_source": "openai/gsm8k",
        "solution_str": "#### 72",
        "ground_truth": "72",
        "extra_info": {"index": 0},
        "prompt": [{"role": "user", "content": "q0"}],
    }
    keys = ("data_source", "solution_str", "ground_truth", "extra_info")
    scores = [compute_score(**{k: it[k] for k in keys})["score"] for it in items]
    assert scores == [1.0, 1.0]
    assert make_items(["a"], ["x"], [{"ground_truth": 1}])[0]["extra_info"] is None


def test_make_items_errors_name_the_column_or_row():
    with pytest.raises(ValueError, match="1 values of data_source for 2 responses"):
        make_items(["a"], ["x", "y"], [{"ground_truth": 1}] * 2)
    with pytest.raises(ValueError, match="row 1 has reward_model=.*'ground_truth'"):
        make_items(["a", "b"], ["x", "y"], [{"ground_truth": 1}, {"style": "rule"}])


def test_summarize_results():
    results = [
        RewardResult(1.0, {"acc": 1.0, "pred": "7"}, elapsed_s=0.1),
        RewardResult(0.1, {"acc": 0.0}, elapsed_s=0.3),
        RewardResult(0.0, error="timed out after 2 s", elapsed_s=2.0),
    ]
    summary = summarize(results)
    assert summary["score/mean"] == pytest.approx(1.1 / 3)
    assert (summary["score/min"], summary["score/max"], summary["errors"]) == (0.0, 1.0, 1.0)
    assert summary["elapsed_s/mean"] == pytest.approx(0.8)
    assert summary["acc/mean"] == 0.5 and "pred/mean" not in summary
    assert summarize([]) == {}


def test_response_token_lists_keep_the_masked_tokens_of_each_row():
    """The reward decodes each response's own tokens: padding and (multi-turn) tool
    tokens outside `response_mask` are left out, wherever they are in the row."""
    import torch

    from rayrl.batch import Batch
    from rayrl.workers.reward import response_token_lists

    responses = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11], [12, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 1], [0, 0, 0, 0]])
    lists = response_token_lists(Batch({"responses": responses, "response_mask": mask}))
    assert lists == [[5, 6, 7], [8, 11], []]
    assert all(type(t) is int for row in lists for t in row)
