"""Synthetic tasks in verl's row format, so demos and tests need no download.

- `arithmetic`: "What is 12+7?" with ground truth "19".
- `larger`: "Which is larger, 31 or 47?" with ground truth "47" (numbers 0-49).
- `multiply`: "What is 457*823?" with ground truth "376111" (factors 317-999, so the
  product has six digits): a task for an agent. Its rows name verl's `tool_agent`
  (`agent_name`), so a multi-turn rollout lets the model call the `calculator` tool;
  a tiny model cannot multiply, but can learn to call the tool and copy its answer.

The visual tasks `colors` ("What colour is the image?") and `count_squares` ("How many
squares are in the image?") draw an image per row (`rayrl.data.synthetic_images`).

`arithmetic` and `larger` are scored by the built-in `arithmetic` scorer (the last
number of the response must equal the ground truth), `multiply` by the `multiply`
scorer (1 for the exact product, else 0). Rows are deterministic for a seed.

`demonstrations` gives supervised (prompt, response) rows for the same questions, in
the columns of verl's SFT trainer (`question`, `answer`), from a demonstrator that is
right with probability `correct_rate` and otherwise makes the task's typical mistake
(`larger`: it names the smaller number; `arithmetic`: it is off by one). The demo
fine-tunes on such imperfect demonstrations, then lets RL with the exact reward do
better than the demonstrator. The demonstrations of `multiply` are conversations
(`messages`, for multi-turn SFT): right ones call the calculator with the two factors
and copy its answer; the mistake is to answer at once with a guess (the product with
its last three digits rounded away, the way one estimates).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

INSTRUCTION = "Answer with the number only."
LARGER_MAX = 49
FACTORS = (317, 999)  # 317 * 317 = 100489: every product has six digits
TOOL_AGENT = "tool_agent"  # verl's agent_name of an episode with tools
CALCULATOR = "calculator"


@dataclass(frozen=True)
class Problem:
    """A task instance: the question, its answer and a demonstrator's typical mistake."""

    question: str
    answer: str
    mistake: str


def _arithmetic(rng: random.Random) -> Problem:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Problem(f"What is {a}{op}{b}?", str(value), str(value + 1))


def _larger(rng: random.Random) -> Problem:
    a, b = rng.sample(range(LARGER_MAX + 1), 2)
    return Problem(f"Which is larger, {a} or {b}?", str(max(a, b)), str(min(a, b)))


def _multiply(rng: random.Random) -> Problem:
    a, b = rng.randint(*FACTORS), rng.randint(*FACTORS)
    product = a * b
    return Problem(f"What is {a}*{b}?", str(product), str(round(product, -3)))


SYNTHETIC_TASKS: dict[str, Callable[[random.Random], Problem]] = {
    "arithmetic": _arithmetic,
    "larger": _larger,
    "multiply": _multiply,
}
TOOL_TASKS = ("multiply",)  # tasks whose rows run the tool agent
# tasks whose rows hold an image (`rayrl.data.synthetic_images`; Pillow draws them)
VISUAL_TASKS = ("colors", "count_squares")


def _problems(task: str, size: int, seed: int) -> list[Problem]:
    if task not in SYNTHETIC_TASKS:
        known = ", ".join([*SYNTHETIC_TASKS, *VISUAL_TASKS])
        raise ValueError(
            f"unknown synthetic task {task!r}; choose one of {known} (data.synthetic_task)"
        )
    rng = random.Random(seed)
    return [SYNTHETIC_TASKS[task](rng) for _ in range(size)]


def synthetic_rows(
    task: str = "arithmetic", size: int = 512, seed: int = 0, images: bool = True
) -> list[dict[str, Any]]:
    """`size` prompt rows of a synthetic task (a visual one's with their images unless
    `images=False`: `rayrl.data.synthetic_images`), the same for the same seed."""
    if task in VISUAL_TASKS:
        from rayrl.data.synthetic_images import image_rows

        return image_rows(task, size, seed, images)
    agent = {"agent_name": TOOL_AGENT} if task in TOOL_TASKS else {}
    return [
        {
            "data_source": task,
            "prompt": [{"role": "user", "content": f"{p.question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"index": i, "question": p.question},
            **agent,
        }
        for i, p in enumerate(_problems(task, size, seed))
    ]


def tool_call(name: str, **arguments: Any) -> str:
    """One tool call as the model writes it (hermes: JSON inside <tool_call> tags)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def conversation(p: Problem, right: bool) -> list[dict[str, Any]]:
    """A `multiply` demonstration: the calculator called and its answer copied, or a guess."""
    user = {"role": "user", "content": f"{p.question} {INSTRUCTION}"}
    if not right:
        return [user, {"role": "assistant", "content": p.mistake}]
    expression = p.question.removeprefix("What is ").removesuffix("?")
    return [
        user,
        {"role": "assistant", "content": tool_call(CALCULATOR, expression=expression)},
        {"role": "tool", "name": CALCULATOR, "content": p.answer},
        {"role": "assistant", "content": p.answer},
    ]


def held_out_rows(
    task: str, size: int, val_size: int, seed: int, images: bool = True
) -> list[dict[str, Any]]:
    """Validation rows of a synthetic task: drawn after the `size` training rows of
    `synthetic_rows(task, size, seed, images)`, minus any whose question those also ask."""
    rows = synthetic_rows(task, size + val_size, seed, images)
    seen = {_question(r) for r in rows[:size]}
    return [r for r in rows[size:] if _question(r) not in seen]


def _question(row: dict[str, Any]) -> str:
    """What a row asks: its prompt, and for a visual task what its image shows."""
    return f"{row['prompt']} {row['extra_info']['question']}"


def demonstrations(
    task: str = "larger", size: int = 512, seed: int = 0, correct_rate: float = 1.0
) -> list[dict[str, Any]]:
    """SFT rows (`question`, `answer`) for the questions of `synthetic_rows(task, size,
    seed)`: each answer is right with probability `correct_rate`, else the task's
    typical mistake. `extra_info.correct` says which. A tool task's rows also have the
    whole conversation under `messages` (`conversation`)."""
    choose = random.Random(f"{seed}:demonstrations")
    rows = []
    for i, p in enumerate(_problems(task, size, seed)):
        right = choose.random() < correct_rate
        row: dict[str, Any] = {
            "data_source": task,
            "question": f"{p.question} {INSTRUCTION}",
            "answer": p.answer if right else p.mistake,
            "extra_info": {"index": i, "correct": right, "ground_truth": p.answer},
        }
        if task in TOOL_TASKS:
            row["messages"] = conversation(p, right)
        rows.append(row)
    return rows


def _distractor(task: str, p: Problem, rng: random.Random) -> str:
    """A wrong answer other than the task's typical mistake, of one of three kinds: most
    often (60%) a near miss (`larger`: any other number of the range, often larger than the right one
    and not in the question; `arithmetic`: the value off by 2 to 5), a long number (3 to
    8 random digits), or the right answer with digits after it; so that no shortcut (a
    larger number, a longer one, one that starts right) ranks pairs as well as the
    right answer does."""
    kind = rng.random()
    if kind < 0.2:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 8)))
    if kind < 0.4:
        return p.answer + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
    if task == "larger":
        return str(rng.choice([n for n in range(LARGER_MAX + 1) if str(n) != p.answer]))
    if task == "arithmetic":
        return str(int(p.answer) + rng.choice([-5, -4, -3, -2, 2, 3, 4, 5]))
    return p.mistake


def preference_pairs(
    task: str = "larger",
    size: int = 512,
    seed: int = 0,
    val_size: int = 0,
    mistake_rate: float = 0.3,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Preference pairs of a synthetic task (`rayrl rm` and `rayrl dpo`'s demo data):
    `prompt` (the question with the instruction), `chosen` (the right answer) and
    `rejected` (a wrong one: with probability `mistake_rate` the task's typical mistake,
    for `larger` the smaller number; else another kind of wrong answer, `_distractor`:
    a reward model trained on the typical mistake alone learns "the larger number wins"
    and a policy it scores learns to write long numbers). The training
    pairs ask the questions of `synthetic_rows(task, size, seed)`; the `val_size`
    held-out pairs are drawn after them, minus any question the training pairs ask.
    Returns (training pairs, held-out pairs)."""
    if task in TOOL_TASKS:
        raise ValueError(f"synthetic preference pairs are single-turn; {task!r} uses a tool")
    problems = _problems(task, size + val_size, seed)
    rng = random.Random(f"{seed}:preference_pairs")

    def pair(i: int, p: Problem) -> dict[str, Any]:
        typical = rng.random() < mistake_rate
        return {
            "data_source": task,
            "prompt": f"{p.question} {INSTRUCTION}",
            "chosen": p.answer,
            "rejected": p.mistake if typical else _distractor(task, p, rng),
            "extra_info": {"index": i, "question": p.question, "typical_mistake": typical},
        }

    rows = [pair(i, p) for i, p in enumerate(problems)]
    train = rows[:size]
    seen = {p.question for p in problems[:size]}
    val = [
        {**row, "extra_info": {**row["extra_info"], "index": i}}
        for i, (row, p) in enumerate(zip(rows[size:], problems[size:], strict=True))
        if p.question not in seen
    ]
    return train, val
