"""Resuming a run: checking what is resumed before the roles load it.

- `intact_checkpoint`: the chosen step directory's files are checked against its
  manifest; a damaged one is named, and the newest intact step is offered (and taken,
  with a warning, under `trainer.resume_mode=auto`).
- `check_fingerprint`: the run's fingerprint (model, data files, batch geometry,
  algorithm) against the checkpoint's: differences are listed and refused, or, with
  `trainer.resume_check=warn`, reported and resumed anyway.
- `restore_from`: the roles and the driver's parts loaded; a file that fails to load
  is named with the step to go back to.
- `reposition`: the data position kept in rows (`Progress.sample`) mapped onto this
  run's batch size, so a resume with another `data.train_batch_size` neither skips nor
  repeats rows (or is refused where no whole batch starts at that row).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from rayrl.trainer.checkpoint import CheckpointManager
from rayrl.trainer.manifest import (
    CheckpointDamagedError,
    check_files,
    fingerprint_changes,
    read_manifest,
)
from rayrl.trainer.state import Progress


class ResumeError(RuntimeError):
    """The checkpoint cannot be resumed as it is; the message says why and what to do."""


def intact_checkpoint(
    checkpoints: CheckpointManager, path: Path, mode: str, print_fn: Callable[[str], None]
) -> Path:
    """`path`, or under `resume_mode=auto` the newest intact step before it when `path`
    is damaged (said as a warning); a damaged `resume_from_path` is refused."""
    try:
        check_files(path)
        return path
    except CheckpointDamagedError as err:
        damage = err
    older = [p for p in checkpoints.steps() if p != path and _step(p) < _step(path)]
    intact = next((p for p in reversed(older) if _is_intact(p)), None)
    offer = f"the last intact one is {intact}" if intact else "no earlier intact step exists"
    if mode != "auto" or intact is None:
        raise ResumeError(
            f"checkpoint {path} is damaged: {damage}; {offer}. Resume from it with "
            "trainer.resume_mode=resume_path trainer.resume_from_path=..., or start over "
            "with trainer.resume_mode=disable"
        )
    print_fn(f"WARNING: checkpoint {path} is damaged ({damage}); resuming from {intact}")
    return intact


def _step(path: Path) -> int:
    return int(path.name.rsplit("_", 1)[-1])


def _is_intact(path: Path) -> bool:
    try:
        check_files(path)
        return True
    except CheckpointDamagedError:
        return False


def check_fingerprint(
    path: Path, now: dict[str, Any], policy: str, print_fn: Callable[[str], None]
) -> None:
    """Refuse (policy "strict") or report ("warn") a resume whose run differs from the
    checkpoint's; checkpoints saved without a fingerprint resume as they are."""
    manifest = read_manifest(path)
    saved = (manifest or {}).get("fingerprint") or {}
    if not saved:
        return
    changes = fingerprint_changes(saved, now)
    if not changes:
        return
    listed = "\n  ".join(changes)
    if policy == "warn":
        print_fn(f"WARNING: resuming {path} although the run changed:\n  {listed}")
        return
    raise ResumeError(
        f"this run differs from the one that wrote {path}:\n  {listed}\nA resume would "
        "train something else than either run. Use another trainer.output_dir (or "
        "trainer.resume_mode=disable) for a new run, or set trainer.resume_check=warn to "
        "resume anyway"
    )


def restore_from(run: Any, path: Path) -> Progress:
    """`run.restore(path)`, with a load that fails named (file, step) and the step to
    go back to suggested."""
    try:
        return cast(Progress, run.restore(path))
    except Exception as err:  # noqa: BLE001 - whatever broke, the checkpoint is at fault
        earlier = [p for p in run.checkpoints.steps() if _step(p) < _step(path)]
        offer = (
            f"resume from {earlier[-1]} (trainer.resume_mode=resume_path "
            f"trainer.resume_from_path={earlier[-1]})"
            if earlier
            else "start over with trainer.resume_mode=disable"
        )
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ResumeError(f"checkpoint {path} failed to load: {first}; {offer}") from err


def reposition(progress: Progress, batch_size: int, print_fn: Callable[[str], None]) -> None:
    """Map the checkpoint's row position onto batches of `batch_size` (another
    `data.train_batch_size` than the checkpoint's), or refuse when no batch starts there."""
    if progress.sample < 0 or progress.sample == progress.batch * batch_size:
        return  # a legacy checkpoint (no row position), or the same batch size
    if progress.sample % batch_size:
        raise ResumeError(
            f"the checkpoint stands at row {progress.sample} of epoch {progress.epoch}, "
            f"not at the start of a batch of data.train_batch_size={batch_size}: resume with "
            f"a batch size dividing {progress.sample}, or the checkpoint's"
        )
    batch = progress.sample // batch_size
    print_fn(
        f"data.train_batch_size changed: the checkpoint's position (row {progress.sample} "
        f"of epoch {progress.epoch}) is batch {batch} of {batch_size} rows"
    )
    progress.batch = batch
