"""Synthetic visual tasks in verl's row format: an image per row, drawn here, so demos
and tests of vision-language RL need no download.

- `colors`: a square of one colour (its shade drawn near the colour's own), "What colour
  is the image?" with the colour's name as the ground truth ("red"); scored by the
  `words` scorer (the response's last word).
- `count_squares`: a white canvas with one to `MAX_SQUARES` black squares, "How many
  squares are in the image?" with the count as the ground truth ("3"); scored by the
  `arithmetic` scorer (the response's last number).

Each row holds its image as PNG bytes in the `images` column (`data.image_key`'s
default, an entry `rayrl.data.images` opens) and an `<image>` placeholder before its
question, as verl's geo3k rows do; `extra_info.question` names what the image shows,
so held-out rows are told apart from the training ones. With `images=False` the rows
are the same questions with neither the image nor its placeholder: a control whose
prompts say nothing of the answer (`data.synthetic_images=false`). Rows are
deterministic for a seed; drawing them needs Pillow (the `vision` extra).

`image_demonstrations` gives SFT rows (`question` with its placeholder, `answer`,
`images`) for the same pictures, right with probability `correct_rate`, else the task's
typical mistake (`colors`: a neighbouring colour, `MISTAKES`; `count_squares`: one too
many), as `rayrl.data.synthetic.demonstrations` does for the text tasks.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rayrl.data.images import require_pillow

IMAGE = "<image>"
SIDE = 56  # pixels: 4 image tokens for Qwen2.5-VL's 28-pixel merged patches
COLORS = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 40),
    "black": (15, 15, 15),
    "white": (245, 245, 245),
    "orange": (240, 140, 20),
    "purple": (130, 40, 170),
}
# the demonstrator's typical mistake of a colour: always the same other colour
MISTAKES = {
    "red": "orange",
    "orange": "yellow",
    "yellow": "green",
    "green": "blue",
    "blue": "purple",
    "purple": "red",
    "black": "white",
    "white": "black",
}
SHADE = 12  # each channel of a colour's shade within this of its own
MAX_SQUARES = 4
SQUARE = 8  # pixels per side of a drawn square


@dataclass(frozen=True)
class Picture:
    """A task instance: the image, the question, its answer, and what the image shows."""

    image: Any
    question: str
    answer: str
    shows: str


def _colors(rng: random.Random) -> Picture:
    name = rng.choice(sorted(COLORS))
    shade = tuple(min(255, max(0, c + rng.randint(-SHADE, SHADE))) for c in COLORS[name])
    image = require_pillow().new("RGB", (SIDE, SIDE), shade)
    question = "What colour is the image? Answer with one word."
    return Picture(image, question, name, f"a square of colour {shade}")


def _count_squares(rng: random.Random) -> Picture:
    count = rng.randint(1, MAX_SQUARES)
    image = require_pillow().new("RGB", (SIDE, SIDE), (255, 255, 255))
    from PIL import ImageDraw

    draw = ImageDraw.Draw(image)
    cells = SIDE // (SQUARE * 2)  # a grid of free cells: squares never touch
    spots = rng.sample([(x, y) for x in range(cells) for y in range(cells)], count)
    for x, y in spots:
        left, top = x * SQUARE * 2 + SQUARE // 2, y * SQUARE * 2 + SQUARE // 2
        draw.rectangle([left, top, left + SQUARE - 1, top + SQUARE - 1], fill=(0, 0, 0))
    question = "How many squares are in the image? Answer with the number only."
    return Picture(image, question, str(count), f"{count} squares at {sorted(spots)}")


IMAGE_TASKS: dict[str, Callable[[random.Random], Picture]] = {
    "colors": _colors,
    "count_squares": _count_squares,
}


def _png(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _pictures(task: str, size: int, seed: int) -> list[Picture]:
    if task not in IMAGE_TASKS:
        raise ValueError(
            f"unknown synthetic visual task {task!r}; choose one of {', '.join(IMAGE_TASKS)}"
        )
    rng = random.Random(f"{task}:{seed}")
    return [IMAGE_TASKS[task](rng) for _ in range(size)]


def image_rows(task: str, size: int, seed: int = 0, images: bool = True) -> list[dict[str, Any]]:
    """`size` prompt rows of a synthetic visual task, the same for the same seed; with
    `images=False`, without their images and placeholders (module docstring)."""
    rows = []
    for i, picture in enumerate(_pictures(task, size, seed)):
        shown = {"images": [{"bytes": _png(picture.image)}]} if images else {}
        rows.append(
            {
                "data_source": task,
                "prompt": [
                    {"role": "user", "content": f"{IMAGE if images else ''}{picture.question}"}
                ],
                **shown,
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": picture.answer},
                "extra_info": {"index": i, "question": picture.shows},
            }
        )
    return rows


def mistake(task: str, answer: str) -> str:
    """The demonstrator's typical wrong answer (module docstring)."""
    return MISTAKES[answer] if task == "colors" else str(int(answer) + 1)


def image_demonstrations(
    task: str, size: int, seed: int = 0, correct_rate: float = 1.0, images: bool = True
) -> list[dict[str, Any]]:
    """SFT rows (`question`, `answer`, `images`) for the pictures of `image_rows(task,
    size, seed)`: each answer right with probability `correct_rate`, else `mistake`;
    `extra_info.correct` says which."""
    choose = random.Random(f"{seed}:demonstrations")
    out = []
    for row in image_rows(task, size, seed, images):
        truth = row["reward_model"]["ground_truth"]
        right = choose.random() < correct_rate
        extra = {**row["extra_info"], "correct": right, "ground_truth": truth}
        shown = {"images": row["images"]} if images else {}
        out.append(
            {
                "data_source": task,
                "question": row["prompt"][0]["content"],
                "answer": truth if right else mistake(task, truth),
                **shown,
                "extra_info": extra,
            }
        )
    return out
