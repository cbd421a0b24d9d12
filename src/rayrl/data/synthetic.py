"""Synthetic tasks in verl's row format, so demos and tests need no download.

`arithmetic`: "What is 12+7?" with ground truth "19" (scored by the built-in
`arithmetic` reward). Rows are deterministic for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable

INSTRUCTION = "Answer with the number only."


def _arithmetic_row(rng: random.Random, index: int) -> dict:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a}{op}{b}?"
    return {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(value)},
        "extra_info": {"index": index, "question": question},
    }


SYNTHETIC_TASKS: dict[str, Callable[[random.Random, int], dict]] = {
    "arithmetic": _arithmetic_row,
}


def synthetic_rows(task: str = "arithmetic", size: int = 512, seed: int = 0) -> list[dict]:
    """`size` rows of a synthetic task, the same for the same seed."""
    if task not in SYNTHETIC_TASKS:
        raise ValueError(
            f"unknown synthetic task {task!r}; choose one of {', '.join(SYNTHETIC_TASKS)} "
            "(data.synthetic_task)"
        )
    rng = random.Random(seed)
    return [SYNTHETIC_TASKS[task](rng, i) for i in range(size)]
