"""The (prompt, response) pairs an SFT run trains and validates on.

From `data.train_files` / `data.val_files` (parquet, verl's SFT columns, the first
`train_max_samples` / `val_max_samples` rows when set); with no train files, from
demonstrations of the synthetic task `data.synthetic_task` (right at the rate
`data.synthetic_correct_rate`), validated on the task's held-out questions with right
answers. With `data.multiturn.enable` rows are conversations (`messages_key`); the
synthetic task's demonstrations then are whole conversations (a tool task's tool calls
and tool responses included), its held-out rows the right ones. A visual task's
(`colors`, `count_squares`) rows hold their images (`data.image_key`; none with
`data.synthetic_images=false`), read with the model's image processor
(`rayrl.trainer.data.model_vision_processor`) as `rayrl train` reads its prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rayrl.config.sft import SFTConfig
from rayrl.data import RowSource, read_rows_with_sources
from rayrl.data.sft import SFTDataset
from rayrl.data.synthetic import (
    TOOL_TASKS,
    VISUAL_TASKS,
    Problem,
    conversation,
    demonstrations,
    held_out_rows,
)


def _dataset(
    cfg: SFTConfig,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    sources: Sequence[RowSource] | None = None,
    vision: Any = None,
) -> SFTDataset:
    d = cfg.data
    return SFTDataset(
        rows,
        tokenizer,
        prompt_key=d.prompt_key,
        response_key=d.response_key,
        prompt_dict_keys=d.prompt_dict_keys,
        response_dict_keys=d.response_dict_keys,
        max_length=d.max_length,
        truncation=d.truncation,
        chat_template_kwargs=d.apply_chat_template_kwargs,
        sources=sources,
        multiturn=d.multiturn.enable,
        messages_key=d.multiturn.messages_key,
        tools_key=d.multiturn.tools_key,
        vision=vision,
        image_key=d.image_key,
    )


def _files(cfg: SFTConfig, tokenizer: Any, files: list[str], limit: int, vision: Any) -> SFTDataset:
    rows, sources = read_rows_with_sources(files)
    if limit > 0:
        rows, sources = rows[:limit], sources[:limit]
    return _dataset(cfg, tokenizer, rows, sources, vision)


def synthetic_sft_rows(cfg: SFTConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training demonstrations, held-out rows with right answers) of the synthetic task,
    in the config's prompt/response columns."""
    d, seed = cfg.data, cfg.trainer.seed
    if d.synthetic_task in VISUAL_TASKS:
        from rayrl.data.synthetic_images import image_demonstrations

        rate, images = d.synthetic_correct_rate, d.synthetic_images
        train = image_demonstrations(d.synthetic_task, d.synthetic_size, seed, rate, images)
    else:
        train = demonstrations(d.synthetic_task, d.synthetic_size, seed, d.synthetic_correct_rate)
    held_out = held_out_rows(
        d.synthetic_task, d.synthetic_size, d.synthetic_val_size, seed, d.synthetic_images
    )
    if d.multiturn.enable:
        return _conversations(cfg, train, held_out)
    val = [
        {
            "question": r["prompt"][0]["content"],
            "answer": r["reward_model"]["ground_truth"],
            **({"images": r["images"]} if "images" in r else {}),
        }
        for r in held_out
    ]
    rename = {"question": d.prompt_key, "answer": d.response_key, "images": d.image_key}
    return (
        [{rename.get(k, k): v for k, v in row.items()} for row in train],
        [{rename[k]: v for k, v in row.items()} for row in val],
    )


def _conversations(
    cfg: SFTConfig, train: list[dict[str, Any]], held_out: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The synthetic demonstrations and right held-out answers as conversations."""
    key = cfg.data.multiturn.messages_key
    tool_task = cfg.data.synthetic_task in TOOL_TASKS

    def chat(question: str, answer: str) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]

    demos = [{key: r.get("messages") or chat(r["question"], r["answer"])} for r in train]
    val = []
    for row in held_out:
        answer = row["reward_model"]["ground_truth"]
        if tool_task:  # the right use of the tool
            messages = conversation(Problem(row["extra_info"]["question"], answer, answer), True)
        else:
            messages = chat(row["prompt"][0]["content"], answer)
        val.append({key: messages})
    return demos, val


def load_sft_datasets(
    cfg: SFTConfig, tokenizer: Any, vision: Any = None
) -> tuple[SFTDataset, SFTDataset | None]:
    """(training pairs, validation pairs or None); whether they fill a batch is the run's
    check (`rayrl.trainer.data.require_batch`), after it has listed the rows set aside.
    ``vision``: the model's image processor, for prompts with images."""
    d = cfg.data
    if d.train_files:
        train = _files(cfg, tokenizer, d.train_files, d.train_max_samples, vision)
        val = (
            _files(cfg, tokenizer, d.val_files, d.val_max_samples, vision) if d.val_files else None
        )
    else:
        train_rows, val_rows = synthetic_sft_rows(cfg)
        train = _dataset(cfg, tokenizer, train_rows, vision=vision)
        val = _dataset(cfg, tokenizer, val_rows, vision=vision) if val_rows else None
    return train, (val if val is not None and len(val) else None)
