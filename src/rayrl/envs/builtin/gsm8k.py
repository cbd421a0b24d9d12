"""The ``gsm8k_answer`` tool: checks a GSM8K answer against the row's ground truth.

The rayrl counterpart of verl's GSM8K example tool (``calc_gsm8k_reward``): the row's
``tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`` is the expected number;
each call submits an ``answer`` and hears whether it is right; the episode's reward
(`reward`) is 1.0 when the last submitted answer was right, else 0.0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from rayrl.envs.registry import TOOLS
from rayrl.envs.tool import Tool

__all__ = ["Gsm8kAnswer"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _value(text: Any) -> Decimal | None:
    found = _NUMBER.findall(str(text))
    if not found:
        return None
    try:
        return Decimal(found[-1].replace(",", ""))
    except InvalidOperation:
        return None


@TOOLS.register("gsm8k_answer")
class Gsm8kAnswer(Tool):
    """Submits an answer; says whether it equals the ground truth."""

    name = "calc_gsm8k_reward"
    description = "Check your answer to the math problem: 1.0 if it is correct, 0.0 if not."
    parameters = {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "The answer, a number."}},
        "required": ["answer"],
    }

    def create(self, create_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return {"ground_truth": create_kwargs.get("ground_truth"), "reward": 0.0}

    def execute(self, arguments: dict[str, Any], state: dict[str, Any]) -> str:
        answer, truth = _value(arguments["answer"]), _value(state.get("ground_truth"))
        if truth is None:
            return "Error: this problem has no ground truth (tools_kwargs create_kwargs)."
        state["reward"] = 1.0 if answer is not None and answer == truth else 0.0
        return f"Current parsed answer={arguments['answer']} reward={state['reward']}"

    def reward(self, state: dict[str, Any]) -> float:
        return float(state.get("reward", 0.0))
