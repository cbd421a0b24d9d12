"""A response budget too small for tool turns (`rayrl.trainer.tool_budget`): when most
episodes of a step end cut right after a tool call, a warning names
data.max_response_length and what a tool turn took, once per run; a step the budget
does not cut (or cuts in a few episodes, or where the model rambles after its answer)
says nothing. The synchronous step calls it (a stubbed generate call)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np

from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.rollout.agent.episodes import EVENT_KEYS
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.tool_budget import ToolBudget
from rayrl.workers.context import StageResult

CALL, ANSWER = [1] * 15, [0] * 12  # a call's turn and the tool's answer: 27 tokens


def episodes(records: list[tuple[list[int], str, int]]) -> Batch:
    """A multi-turn rollout's columns for episodes of (sampled record, finish reason,
    tool calls)."""

    def column(values) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            out[i] = value
        return out

    return Batch(
        non_tensors={
            "num_turns": column([3] * len(records)),
            "finish_reason": column([reason for _, reason, _ in records]),
            "tool_stats": column(
                [
                    {"calculator": {"calls": n, "errors": 0, "timeouts": 0, "latency_s": 0.0}}
                    for _, _, n in records
                ]
            ),
            "multi_turn_events": column([dict.fromkeys(EVENT_KEYS, 0)] * len(records)),
            "rollout_sampled": column([np.array(s, dtype=np.uint8) for s, _, _ in records]),
        }
    )


def test_tool_turns_cut_by_the_budget_in_most_episodes_are_said_once(caplog):
    cut_after_answer = (CALL + ANSWER + [1] * 5, "length", 1)  # 32 tokens: 5 left
    answer_did_not_fit = (CALL + [1] * 3, "length", 1)  # stopped at 18 of 32
    answered = (CALL + ANSWER + [1] * 4, "stop", 1)
    batch = episodes([answer_did_not_fit] + [cut_after_answer] * 5 + [answered] * 2)
    budget = ToolBudget(32)
    with caplog.at_level(logging.WARNING, logger="rayrl.trainer"):
        said = budget.check(batch)
        assert budget.check(batch) is None  # once per run
    assert said is not None and caplog.text.count("data.max_response_length=32") == 1
    assert "cut a tool turn short in 6 of 8 episodes" in said
    assert "took 27 tokens (the assistant's call 15, the tool's answer 12), leaving 5" in said
    last_did_not_fit = episodes([cut_after_answer] * 3 + [answer_did_not_fit] * 2)
    said = ToolBudget(32).check(last_did_not_fit)
    assert "took 18 tokens and the tool's answer did not fit in the 14 left" in said


def test_a_budget_that_holds_the_tool_turns_says_nothing():
    cut = (CALL + ANSWER + [1] * 5, "length", 1)
    answered = (CALL + ANSWER + [1] * 4, "stop", 1)
    assert ToolBudget(32).check(episodes([cut] * 4 + [answered] * 4)) is None  # half: not most
    rambling = (CALL + ANSWER + [1] * 229, "length", 1)  # 256 tokens, cut long after
    assert ToolBudget(256).check(episodes([rambling] * 8)) is None
    no_tools = ([1] * 32, "length", 0)  # cut, but no tool was called
    assert ToolBudget(32).check(episodes([no_tools] * 8)) is None


def test_the_step_checks_its_episodes(tmp_path, caplog):
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config(
        "grpo",
        [f"{mt}.enable=true", f"{mt}.tools=[calculator]", f"trainer.output_dir={tmp_path}"],
    )
    trainer = PPOTrainer(cfg)  # grpo's budget: 32 tokens
    batch = episodes([(CALL + ANSWER + [1] * 5, "length", 1)] * 4)
    trainer._roles = lambda: SimpleNamespace(actor=SimpleNamespace(generate=None))
    trainer._balanced = lambda rows, metrics, stage, parts: rows
    trainer._parts = lambda layout: 1
    trainer._kept = lambda method, driver=None: method
    trainer._balanced_samples = lambda done, metrics: StageResult(batch)
    calls = SimpleNamespace(run=lambda *args, **kwargs: None)
    ctx = SimpleNamespace(but=lambda **changes: None)
    with caplog.at_level(logging.WARNING, logger="rayrl.trainer"):
        trainer._generate(Batch(), ctx, calls, {}, {})
    assert "cut a tool turn short in 4 of 4 episodes" in caplog.text
