"""Running a trainer from the command line: set up with a status line, train under a
progress bar, always shut down, and say how long starting and stopping took."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rayrl.cli.common import plain_printer

if TYPE_CHECKING:
    from rich.console import Console

    from rayrl.trainer.contract import Trainer
    from rayrl.trainer.run import Run


class Stopped(Exception):  # noqa: N818 - the user's request, not an error
    """The run stopped early on Ctrl-C or SIGTERM, after writing a checkpoint;
    `exit_code` is the shell's code for that signal (130, 143)."""

    def __init__(self, step: int, exit_code: int) -> None:
        super().__init__(f"stopped after step {step}")
        self.step, self.exit_code = step, exit_code


def run_trainer(
    trainer: Trainer,
    out: Console,
    *,
    label: str,
    info: Callable[[dict], str],
    validate_only: bool = False,
) -> tuple[Run, list[dict]]:
    """`Run(trainer)` set up, fitted under a progress bar labelled `label` (each step's
    text from `info(metrics)`; none with `validate_only`), and shut down; the run and
    its per-step metrics. Raises `Stopped` after a Ctrl-C that ended the run early."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rayrl.trainer.run import Run

    run = Run(trainer, print_fn=plain_printer(out))
    where = f"model: {trainer.model_path}; run {run.name}; run directory {run.run_dir.root}"
    out.print(where, markup=False)  # paths may hold [brackets]
    try:
        start = time.perf_counter()
        with out.status("reserving resources and starting workers"):
            run.setup()
        out.print(f"ready in {time.perf_counter() - start:.2f} s (Ray, pools, workers, models)")
        if validate_only:
            with out.status("validating"):
                return run, run.fit()
        progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=out,
        )
        with progress:
            task = progress.add_task(label, total=run.total_steps(), info="")

            def on_step(step: int, metrics: dict) -> None:
                progress.update(task, completed=step + 1, info=info(metrics))

            history = run.fit(on_step=on_step)
    finally:
        start, started = time.perf_counter(), bool(run.session or run.pools or run.groups)
        run.shutdown()
        if started:  # nothing to say when the run failed before anything started
            out.print(f"stopped in {time.perf_counter() - start:.2f} s (workers, pools, Ray)")
    if run.stopped:
        raise Stopped(run.progress.global_step, run.exit_code)
    return run, history


def exit_code_of(work: Callable[[], Any]) -> int:
    """Run `work` (a command's training); the exit code, with errors a user can act on
    printed as one line instead of a traceback: bad data, a reward function, tool or
    environment the config names that cannot be loaded, an unusable run directory, a
    checkpoint that cannot be resumed, resources that cannot be had (2: nothing
    trained yet), a checkpoint that cannot be written or a reward failing past its error
    rate (1), a stop by Ctrl-C or SIGTERM (130, 143). A reward's error, raised in a
    worker, is found inside the worker error that carries it."""
    from rich.markup import escape

    from rayrl.cli.common import console
    from rayrl.cluster.guard import ResourceError
    from rayrl.config.errors import ConfigError
    from rayrl.data import DataError
    from rayrl.envs.errors import LoadError
    from rayrl.models.loading import ModelPathError, TokenizerMissingError
    from rayrl.rewards.budget import RewardErrorRateError
    from rayrl.rewards.loader import RewardFunctionError
    from rayrl.trainer.checkpoint import CheckpointWriteError
    from rayrl.trainer.resume import ResumeError
    from rayrl.trainer.run_dir import RunDirError
    from rayrl.trainer.run_lock import RunDirLockedError
    from rayrl.trainer.tracking import TrackerUnavailable
    from rayrl.workers.agent import ToolConfigError

    kinds = [
        (DataError, "data error", 2),
        (ToolConfigError, "config error", 2),  # before its cause: it names the key
        (ConfigError, "config error", 2),  # a check of the config against what it names
        ((RewardFunctionError, LoadError), "config error", 2),
        ((TokenizerMissingError, ModelPathError), "model error", 2),
        ((RunDirError, RunDirLockedError), "run directory error", 2),
        (ResumeError, "resume error", 2),
        (CheckpointWriteError, "checkpoint error", 1),
        (TrackerUnavailable, "tracker error", 2),
        (ResourceError, "resources error", 2),
        (RewardErrorRateError, "reward error", 1),
    ]
    try:
        work()
    except Stopped as stopped:
        return stopped.exit_code
    except Exception as exc:
        for types, label, code in kinds:
            found = _innermost(exc, types)
            if found is not None:
                text = escape(str(found))  # paths and values may hold [brackets]
                console(stderr=True).print(f"[bold red]{label}:[/] {text}", highlight=False)
                return code
        raise
    return 0


def _innermost(exc: BaseException | None, types: Any) -> BaseException | None:
    """The innermost of `exc` and its causes (a worker error's `cause`, Ray's remote
    error's `cause`, `raise ... from`) that is of `types`: the error as raised, not Ray's
    copy that carries the remote traceback in its text."""
    found, seen = None, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, types):
            found = exc
        inner = getattr(exc, "cause", None)
        exc = inner if isinstance(inner, BaseException) else exc.__cause__
    return found
