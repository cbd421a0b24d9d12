"""Rows in verl's layout from local JSONL files (`rayrl data convert | gsm8k`).

verl's columns: `data_source` (picks the reward scorer), `prompt` (chat messages),
`ability`, `reward_model: {style: "rule", ground_truth}`, `extra_info: {split,
index, ...}`. Writing a JSONL file straight to parquet keeps its own column names,
which verl's loaders (and rayrl's) do not read; these functions map them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# verl's examples/data_preprocess/gsm8k.py instruction, appended to each question.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_SOURCE = "openai/gsm8k"
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The objects of a JSONL file; a bad line is an error naming its number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: a line must be a JSON object")
        rows.append(row)
    return rows


def _messages(value: Any, system: str | None, suffix: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        text = f"{value} {suffix}".strip() if suffix else value
        messages = [{"role": "user", "content": text}]
    elif isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        messages = [dict(m) for m in value]
    else:
        raise ValueError(f"a prompt must be a string or chat messages, got {type(value).__name__}")
    if system and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def convert_rows(
    rows: Iterable[dict[str, Any]],
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    data_source: str | None = None,
    ability: str = "general",
    split: str = "train",
    system: str | None = None,
    suffix: str = "",
) -> list[dict[str, Any]]:
    """Map rows with a question column and an answer column to verl's columns.

    The other columns of a row are kept in `extra_info`. `data_source` is required:
    it names the reward scorer (e.g. gsm8k, math, arithmetic, or your own's).
    """
    if not data_source:
        raise ValueError("data_source is required: it picks the reward scorer (--data-source)")
    out: list[dict[str, Any]] = []
    for index, row in enumerate(rows):
        for key in (prompt_key, answer_key):
            if key not in row:
                raise KeyError(
                    f"row {index} has no column {key!r} (columns: {', '.join(row)}); "
                    "name the right ones with --prompt-key / --answer-key"
                )
        extra = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        out.append(
            {
                "data_source": data_source,
                "prompt": _messages(row[prompt_key], system, suffix),
                "ability": ability,
                "reward_model": {"style": "rule", "ground_truth": str(row[answer_key])},
                "extra_info": {"split": split, "index": index, **extra},
            }
        )
    return out


def gsm8k_answer(answer: str) -> str:
    """The final number of a GSM8K solution ("... #### 1,234" -> "1234")."""
    found = _GSM8K_ANSWER.search(answer)
    if not found:
        raise ValueError(f"a GSM8K answer must end in '#### N'; got {answer[-60:]!r}")
    return found.group(1).replace(",", "")


def gsm8k_rows(rows: Iterable[dict[str, Any]], split: str = "train") -> list[dict[str, Any]]:
    """GSM8K rows (`question`, `answer` ending in `#### N`) in verl's layout, as verl's
    gsm8k preprocessing writes them."""
    out = []
    for index, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise KeyError(f"row {index}: a GSM8K row has 'question' and 'answer' columns")
        question, answer = row["question"], row["answer"]
        out.append(
            {
                "data_source": GSM8K_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": gsm8k_answer(answer)},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "answer": answer,
                    "question": question,
                },
            }
        )
    return out
