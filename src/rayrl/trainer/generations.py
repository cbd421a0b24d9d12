"""What was generated, kept: a step's samples as JSON Lines (verl's
`trainer.rollout_data_dir` and `trainer.validation_data_dir`).

With `trainer.rollout_data_dir` set, every training step writes the samples it trained
to `<rollout_data_dir>/<step>.jsonl`; with `trainer.validation_data_dir` set, every
validation writes all of its samples to `<validation_data_dir>/<step>.jsonl`. `step` is
the global step, as in metrics.jsonl (the first training step is 1, a validation before
training is 0); a step run again (a replay, a resume) rewrites its file. Relative
directories are taken from the working directory, as verl does (as
`trainer.output_dir` is).

One object per sample, with verl's names (its `_dump_generations`) where it has them:

- `input`: the prompt, decoded; `output`: the response, decoded (for a multi-turn
  episode all of it: the model's turns and the tool answers between them);
- `gts`: the ground truth, when the data gives one; `score`: the sample's score
  (the overlong penalty included); the reward function's extra keys (`acc`, ...),
  beside them as verl writes them;
- `step`; `uid`: the prompt's id (the samples of one prompt share it);
- `weight_version`: the policy that sampled the oldest of the row's response tokens
  (version v: the policy after v training steps). Asynchronous training's batches
  carry each token's version (`rollout_versions`); a synchronous training step's
  samples come from version step - 1, a validation's from version step;
- `turns` and `num_turns`, for multi-turn episodes: the trajectory (the chat messages,
  tool calls and tool answers as the rollout recorded them) and its turn count.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from rayrl.batch import Batch
from rayrl.trainer.run_dir import RunDirError

# The per-token policy versions of asynchronous training's samples ([rows, response])
VERSIONS = "rollout_versions"


def oldest_versions(versions: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """Each row's oldest policy version among its response tokens (`mask`); a row
    without any, the oldest of the whole row."""
    mask = mask.bool()
    newest = torch.iinfo(versions.dtype).max
    masked = versions.masked_fill(~mask, newest).min(-1).values
    whole = versions.min(-1).values
    return cast("list[int]", torch.where(mask.any(-1), masked, whole).tolist())


def generation_rows(
    batch: Batch, decode: Callable[..., list[str]], *, step: int, version: int
) -> list[dict[str, Any]]:
    """One dict per sample of `batch` (the fields of the module docstring). `batch`
    holds the generated samples (`prompts`, `responses`, `attention_mask`, `uid`)
    and their `scores`; `decode` is the tokenizer's `batch_decode`; `version` is the
    policy version of rows that carry no per-token versions."""
    inputs, outputs = _texts(batch, decode)
    if VERSIONS in batch:
        versions = oldest_versions(batch[VERSIONS], batch["response_mask"])
    else:
        versions = [version] * len(batch)
    truths = batch.get("ground_truth")
    extras = batch.get("reward_extra")
    rows = []
    for i, score in enumerate(batch["scores"].tolist()):
        row: dict[str, Any] = {"input": inputs[i], "output": outputs[i]}
        if truths is not None:
            row["gts"] = truths[i]
        row.update(score=score, step=step, uid=batch["uid"][i], weight_version=versions[i])
        extra = extras[i] if extras is not None else None
        for key, value in (extra or {}).items():  # never in place of a field above
            row.setdefault(key, value)
        rows.append(row)
    if "trajectory" in batch:
        counts = batch.get("num_turns", [None] * len(batch))
        for row, turns, count in zip(rows, batch["trajectory"], counts, strict=True):
            row.update(turns=turns, num_turns=len(turns) if count is None else int(count))
    return rows


def write_training_step(
    directory: GenerationsDir, batch: Batch, decode: Callable[..., list[str]], index: int
) -> dict[str, float]:
    """The samples a training step trained (`index`: its 0-based index, so global step
    index + 1, sampled by policy version `index` unless the batch says otherwise) as
    `<index + 1>.jsonl`; its time as `timing_s/dump_rollout_generations` (verl's)."""
    start = time.perf_counter()
    directory.write(index + 1, generation_rows(batch, decode, step=index + 1, version=index))
    return {"timing_s/dump_rollout_generations": time.perf_counter() - start}


def _texts(batch: Batch, decode: Callable[..., list[str]]) -> tuple[list[str], list[str]]:
    """The prompts (left-padded) and the responses (right-padded), decoded without
    their padding and special tokens."""
    prompts, responses = batch["prompts"], batch["responses"]
    mask = batch["attention_mask"].bool()
    width = prompts.shape[1]
    prompt_ids = [row[m].tolist() for row, m in zip(prompts, mask[:, :width], strict=True)]
    response_ids = [row[m].tolist() for row, m in zip(responses, mask[:, width:], strict=True)]
    texts = decode(prompt_ids + response_ids, skip_special_tokens=True)
    return texts[: len(prompt_ids)], texts[len(prompt_ids) :]


class GenerationsDir:
    """A directory of `<step>.jsonl` files, named by its config key for errors.

    Args:
        path: the configured directory (relative: from the working directory).
        key: its config key (`trainer.rollout_data_dir`), named when it cannot be written.
    """

    def __init__(self, path: str | Path, key: str) -> None:
        self.path = Path(path).expanduser().absolute()
        self.key = key

    def prepare(self) -> GenerationsDir:
        """Create the directory (before the run starts: a bad path stops it early)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self._error(err) from None
        return self

    def write(self, step: int, rows: list[dict[str, Any]]) -> Path:
        """`rows` as `<step>.jsonl`, replacing what a previous run of the step wrote."""
        file = self.path / f"{step}.jsonl"
        text = "".join(json.dumps(row, ensure_ascii=False, default=_plain) + "\n" for row in rows)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            part = file.with_name(file.name + ".part")
            part.write_text(text, encoding="utf-8")
            part.replace(file)
        except OSError as err:
            raise self._error(err) from None
        return file

    def _error(self, err: OSError) -> RunDirError:
        return RunDirError(
            f"cannot write {self.key}={self.path}: {err.strerror or err} "
            f"({err.filename or self.path}); set {self.key} to a directory this user can "
            "write, or to null to keep no generations"
        )


def generations_dir(path: str | None, key: str) -> GenerationsDir | None:
    """The `GenerationsDir` of a configured key (None: the key is null or empty)."""
    return GenerationsDir(path, key) if path else None


def read_generations(
    path: Path, steps: int, per_step: int
) -> list[tuple[int, list[dict[str, Any]]]]:
    """The first `per_step` samples of each of the last `steps` steps written to `path`
    (`<step>.jsonl` files), oldest step first; nothing when there are none."""
    files = sorted((int(f.stem), f) for f in path.glob("*.jsonl") if f.stem.isdigit())
    found = []
    for step, file in files[-steps:] if steps > 0 else []:
        with open(file, encoding="utf-8") as f:
            lines = [line for _, line in zip(range(per_step), f, strict=False)]
        found.append((step, [json.loads(line) for line in lines if line.strip()]))
    return found


def _plain(value: Any) -> Any:
    """What JSON cannot hold as it is: arrays and tensors as lists, the rest as text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
