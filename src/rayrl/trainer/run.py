"""One run lifecycle for every trainer: set up, resume, step, save, validate, export, stop.

    run = Run(PPOTrainer(cfg))        # or SFTTrainer(cfg), or any `Trainer`
    try:
        run.setup()                   # data, Ray, pools (checked together), roles
        history = run.fit()           # resume, steps, checkpoints, validation, export
    finally:
        run.shutdown()                # workers, pools, KV store; a Ray started here

`setup` checks the trackers and the debugger, writes the run directory's config, loads
the data (before anything is reserved, so bad data fails first), starts or joins Ray,
reserves every pool the trainer asks for in one check (bounded waits, clear errors)
and has the trainer start its roles.

`fit` resumes (`trainer.resume_mode`: the roles load their state, the driver's parts
theirs), then walks the data epoch by epoch from the saved position; each step runs
under step replay (`rayrl.trainer.replay`: a lost or hung worker is replaced and the
step run again, to the same end), then the checkpoint and validation when due. A
first Ctrl-C stops at a safe point with a checkpoint (`rayrl.trainer.interrupt`).
Metrics go to the trackers (`rayrl.trainer.tracking`) and `metrics.jsonl`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rayrl.batch import Batch
from rayrl.cluster import ray_private
from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import ResourcePool, reserve_pools
from rayrl.config.load import to_yaml
from rayrl.config.schema import RayRLConfig
from rayrl.config.sft import SFTConfig
from rayrl.controller import WorkerGroup
from rayrl.controller.usage import starved_stages
from rayrl.data import DataError
from rayrl.data.ray_loader import DATA_CPUS
from rayrl.data.rejected import summarize_rejected, write_rejected
from rayrl.trainer.checkpoint import CheckpointManager, load_states
from rayrl.trainer.contract import TrainData, Trainer
from rayrl.trainer.data import no_validation_notice, require_batch, truncation_notes
from rayrl.trainer.epochs import epoch_batches, total_steps
from rayrl.trainer.interrupt import StopOnInterrupt, StopRequested
from rayrl.trainer.metrics import controller_overhead, usage_metrics
from rayrl.trainer.profiling import StepProfiler
from rayrl.trainer.ray_session import RaySession, check_debugger, connect
from rayrl.trainer.replay import ReplayPolicy, Rewound, StepReplay
from rayrl.trainer.resources import resolve_device
from rayrl.trainer.resume import check_fingerprint, intact_checkpoint, reposition, restore_from
from rayrl.trainer.roles import group_env, print_placement
from rayrl.trainer.run_dir import RunDir, RunDirError
from rayrl.trainer.run_lock import RunLock
from rayrl.trainer.stage_calls import StageCalls
from rayrl.trainer.state import DriverRNG, Progress, Stateful, capture, restore
from rayrl.trainer.tracking import Tracking, check_trackers

log = logging.getLogger("rayrl.trainer")


class Run:
    """The lifecycle of one training run of `trainer` (module docstring).

    `print_fn` receives the run's messages (resume, dashboard, placement, warnings).
    """

    def __init__(self, trainer: Trainer, print_fn: Callable[[str], None] | None = None) -> None:
        self.trainer = trainer
        self.cfg = trainer.cfg
        self.print = print_fn or trainer.print
        t = self.cfg.trainer
        self.name = f"{t.experiment_name}-{trainer.kind}-{uuid.uuid4().hex[:6]}"
        self.run_dir = RunDir(Path(t.output_dir))
        self.checkpoints = CheckpointManager(self.run_dir.checkpoints, trainer.max_ckpt_to_keep)
        self.progress = Progress()
        prof = getattr(self.cfg, "global_profiler", None)  # rayrl sft's config has none
        self.profiler = StepProfiler(prof, self.run_dir.root, self.print)
        self.data: TrainData | None = None
        self.session: RaySession | None = None
        self.kv: KVStore | None = None
        self.pools: list[ResourcePool] = []
        self.groups: list[WorkerGroup] = []
        self.calls = StageCalls()  # the step's group calls, reused by a replay
        self.replay: StepReplay | None = None
        self.lock = RunLock(self.run_dir.root)
        self.stopped = False  # a Ctrl-C or SIGTERM ended fit() early, with a checkpoint
        self.exit_code = 0  # the shell's code for how it stopped (130, 143)
        self._start_states: dict[str, dict[str, Any]] = {}
        self._step_states: dict[str, dict[str, Any]] | None = (
            None  # driver parts at the step's start
        )
        self._step_span: tuple[float, float] | None = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ setup
    def setup(self) -> Run:
        """Check trackers and data, start or join Ray, reserve the pools (bounded waits,
        clear errors) and start the trainer's roles."""
        cfg, trainer = self.cfg, self.trainer
        check_trackers(cfg.trainer.logger)
        check_debugger(cfg)
        trainer.preflight()
        self._claim_run_dir()
        if not trainer.data_needs_ray:
            self.data = self._load_data()
        data_cpus = DATA_CPUS if trainer.data_needs_ray else 0.0  # Ray Data's tasks
        self.session = connect(cfg, lambda: trainer.pool_specs("cpu"), self.print, data_cpus)
        if self.session.dashboard_url:
            self.print(f"Ray dashboard: {self.session.dashboard_url}")
        if trainer.data_needs_ray:
            self.data = self._load_data()
        import ray

        device = resolve_device(cfg, ray.cluster_resources().get("GPU", 0))
        self.kv = KVStore.create(self.name)
        # All pools checked together: none is held while another waits or cannot fit.
        specs = trainer.pool_specs(device)
        self.pools = reserve_pools(specs, self.name, cfg.resources.wait_timeout_s)
        env = group_env(cfg, self.name, self.kv, trainer.pg_timeout_s)
        self.groups = trainer.start(self.pools, env, device, self.total_steps())
        self.write_workers()
        print_placement(self.groups, cfg.trainer.debug, self.print)
        profiling = self.profiler.describe(self.total_steps())
        if profiling:
            self.print(profiling)
        self.usage()  # start the first step's usage sampling afresh (setup is not a step)
        return self

    def _claim_run_dir(self) -> None:
        """Lock the run directory for this run (`run_lock`) and write its config there."""
        root = self.run_dir.root
        try:
            self.lock.acquire(self.name)
            self.run_dir.prepare(to_yaml(self.cfg))
        except OSError as err:
            raise RunDirError(
                f"cannot write the run directory trainer.output_dir={root}: "
                f"{err.strerror or err} ({err.filename or root}); set trainer.output_dir to "
                "a directory this user can write"
            ) from None

    def _load_data(self) -> TrainData:
        """The trainer's data; every row set aside listed in the run directory
        (`rejected_rows.jsonl`) and summarised by reason; at least one batch usable."""
        data = self.trainer.load_data()
        listed = self._report_rejected(data)
        for line in truncation_notes(data, self.cfg.data):
            self.print(line)
        try:
            require_batch(data.dataset, data.batch_size)
        except DataError as err:
            where = f" (the rows set aside are listed in {listed})" if listed else ""
            raise DataError(f"{err}{where}") from None
        return data

    def _report_rejected(self, data: TrainData) -> Path | None:
        """Write the rows set aside to `rejected_rows.jsonl` and say what they were; the
        file's path, or None when no row was set aside."""
        found = {
            "train": getattr(data.dataset, "rejected", None),
            "val": getattr(data.val, "rejected", None),
        }
        # rows of a dataset (Any); write_rejected takes a dict, invariant in its values
        splits: dict[str, Any] = {s: rows for s, rows in found.items() if isinstance(rows, list)}
        path = self.run_dir.rejected_rows
        if not write_rejected(path, splits):
            return None
        totals = {"train": data.dataset, "val": data.val}
        for split, rows in splits.items():
            if rows:
                total = getattr(totals[split], "total_rows", "?")
                summary = "\n  ".join(summarize_rejected(rows))
                self.print(
                    f"WARNING: {len(rows)} of {total} {split} rows set aside (every one "
                    f"listed in {path}):\n  {summary}"
                )
        return path

    def total_steps(self) -> int:
        """`trainer.total_training_steps`, or whole batches of the dataset x epochs."""
        data = self._data()
        return total_steps(self.cfg.trainer, len(data.dataset), data.batch_size)

    def steps_per_epoch(self) -> int:
        data = self._data()
        return len(data.dataset) // data.batch_size

    def _steps(self, freq: int | str) -> int:
        """A save or validation frequency in steps (`rayrl sft`'s after_each_epoch, as
        verl's SFT trainer: the steps of an epoch)."""
        return self.steps_per_epoch() if freq == "after_each_epoch" else int(freq)

    def _data(self) -> TrainData:
        if self.data is None:
            raise RuntimeError("the run's data is not loaded yet: call Run.setup() first")
        return self.data

    def _replay_of_fit(self) -> StepReplay:
        if self.replay is None:
            raise RuntimeError("the run's step replay starts with Run.fit()")
        return self.replay

    def shutdown(self) -> None:
        """Kill the run's workers, release its pools and KV store; a Ray this run
        started stops too, all its processes at once (`ray_private.stop_local_ray`)."""
        local = self.session is not None and self.session.started_here
        stop = getattr(self.trainer, "shutdown", None)  # what a trainer runs beside its groups
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - the groups and pools are released anyway
                log.exception("the trainer's own shutdown failed")
        for group in self.groups:
            group.shutdown()
        for pool in self.pools:
            pool.teardown()
        if self.kv is not None:  # no need to see the store gone when Ray stops next
            self.kv.shutdown(**({"wait_s": 0.0} if local else {}))
        if local:
            ray_private.stop_local_ray()
            self.session = None
        self.lock.release()

    # ------------------------------------------------------- checkpoint/resume
    def parts(self) -> dict[str, Stateful]:
        """The driver's state a checkpoint keeps: the run's and the trainer's parts."""
        return {"progress": self.progress, "rng": DriverRNG(), **self.trainer.parts()}

    def save_checkpoint(self) -> Path:
        """Checkpoint the run as it stands after `progress.global_step` steps."""
        return self.checkpoints.save(
            self.progress.global_step,
            capture(self.parts()),
            self.trainer.save,
            fingerprint=self.fingerprint(),
        )

    def fingerprint(self) -> dict[str, Any]:
        """What must not change between this run and its resume (as JSON would store it)."""
        plain: dict[str, Any] = json.loads(json.dumps(self.trainer.fingerprint(), default=str))
        return plain

    def restore(self, path: str | Path) -> Progress:
        """Put every role and the driver's parts back to a checkpoint's step boundary."""
        self.trainer.load(Path(path))
        restore(self.parts(), load_states(path))
        return self.progress

    def resume(self) -> Path | None:
        """Apply `trainer.resume_mode` (`rayrl.trainer.resume`: a damaged checkpoint named,
        the run's fingerprint checked); metrics.jsonl keeps the rows up to the resumed step."""
        t = self.cfg.trainer
        stale = self.checkpoints.stale_marker() if t.resume_mode == "auto" else None
        if stale:
            self.print(f"WARNING: {stale}")
        path = self.checkpoints.resolve(t.resume_mode, t.resume_from_path)
        if path is None:
            self.progress.load_state_dict(Progress().state_dict())
            self.run_dir.metrics.unlink(missing_ok=True)
            return None
        path = intact_checkpoint(self.checkpoints, path, t.resume_mode, self.print)
        check_fingerprint(path, self.fingerprint(), t.resume_check, self.print)
        progress = restore_from(self, path)
        reposition(progress, self._data().batch_size, self.print)
        self.run_dir.keep_metrics_until(progress.global_step)
        self.print(f"resumed from {path} ({progress.describe()})")
        return path

    def rewind(self, reason: str) -> int:
        """Back to the last checkpoint (or the run's start) when a step cannot be
        restored from memory; returns the step the run continues from."""
        path = self.checkpoints.latest()
        if path is not None:
            self.restore(path)
        else:
            replay = self._replay_of_fit()
            for group in self.trainer.stateful_groups():  # fresh engines: the first state
                replay.replace(group, list(range(group.world_size)))
            self.write_workers()
            restore(self.parts(), self._start_states)
        step = self.progress.global_step
        self.run_dir.keep_metrics_until(step)
        self.print(
            f"WARNING: {reason}; rewound to {path or 'the start of the run'} "
            f"(step {step}): the steps after it run again"
        )
        return step

    # ------------------------------------------------------------------- loop
    def batches(self) -> Iterator[tuple[int, Batch]]:
        """(step, batch) from the current data position to the end of the run, epoch
        after epoch, seeded per epoch; each batch's meta carries `step`, `epoch` and
        `batch_index` (its index in the epoch)."""
        data, t = self._data(), self.cfg.trainer
        return epoch_batches(
            data.dataset,
            data.batch_size,
            start=self.progress,
            total=self.total_steps(),
            seed=t.seed if data.seed is None else data.seed,
            shuffle=data.shuffle,
            epochs=None if t.total_training_steps is not None else t.total_epochs,
        )

    def fit(
        self, on_step: Callable[[int, dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """Resume, validate, train to the end with checkpoints and tracking, export.

        Worker failures are recovered and the step replayed (`trainer.replay`); a first
        Ctrl-C stops at a safe point with a checkpoint (`self.stopped` then)."""
        self.resume()
        self._start_states = capture(self.parts())
        history: list[dict[str, Any]] = []
        tracking = self._tracking()
        replay = self.replay = self._replay()
        try:
            with StopOnInterrupt(self.print) as interrupt:
                self.calls.stop_check = lambda mutated: interrupt.check(mutated, replay.can_undo)
                try:
                    replay.start()
                    self._train(tracking, history, on_step, interrupt)
                except StopRequested:
                    self._stop_safely(interrupt)
        finally:
            self.calls.stop_check = lambda mutated: None
            tracking.finish()
        return history

    def _tracking(self) -> Tracking:
        t = self.cfg.trainer
        return Tracking(
            t.logger,
            self.run_dir.root,
            project=t.project_name,
            experiment=t.experiment_name,
            config=_config_dict(self.cfg),
            print_fn=self.print,
            tensorboard_dir=t.tensorboard_dir,
        )

    def _replay(self) -> StepReplay:
        t, res = self.cfg.trainer, self.cfg.resources
        policy = ReplayPolicy(
            max_restarts=getattr(t, "max_worker_restarts", 0),
            snapshots=getattr(t, "step_snapshots", False),
            init_timeout_s=res.init_timeout_s,
            init_retries=res.init_retries,
            snapshot_replicas=getattr(t, "snapshot_replicas", 0),
        )
        stateful = self.trainer.stateful_groups()
        return StepReplay(
            self.groups,
            stateful,
            self.calls,
            policy,
            self.rewind,
            self.print,
            on_replaced=self.write_workers,
            on_back=self.run_dir.keep_metrics_until,
        )

    def write_workers(self) -> None:
        """Rewrite `workers.json` from the groups as they are now (after a replacement:
        the new workers' pids, nodes and log files), with the workers the trainer keeps
        beside its groups (`more_workers`: async training's rollout replicas)."""
        if self.session is None:
            raise RuntimeError("the run has no workers yet: call Run.setup() first")
        self.run_dir.write_workers(self.all_groups(), self.session.log_dir)

    def all_groups(self) -> list[WorkerGroup]:
        """The run's groups and the workers the trainer keeps beside them."""
        more = getattr(self.trainer, "more_workers", None)
        return [*self.groups, *(more() if more else [])]

    def _train(
        self,
        tracking: Tracking,
        history: list[dict[str, Any]],
        on_step: Callable[[int, dict[str, Any]], None] | None,
        interrupt: StopOnInterrupt,
    ) -> None:
        """Validation before training, the steps with what follows each, the export; each
        under recovery. A rewind to a checkpoint (a lost snapshot) continues from there."""
        t, replay = self.cfg.trainer, self._replay_of_fit()
        validates = self._data().val is not None
        notice = None if validates else no_validation_notice(self.cfg)
        if notice:
            self.print(notice)
        if getattr(t, "val_only", False):  # verl's trainer.val_only: validate, then stop
            if not validates:
                raise ValueError("trainer.val_only=true needs validation data (data.val_files)")
            step = self.progress.global_step
            tracking.log(replay.run(lambda: self.trainer.validate(step), "validation"), step=step)
            return
        total = self.total_steps()
        if self.progress.global_step >= total:
            self.print(
                f"nothing to train: the checkpoint is at step {self.progress.global_step} of "
                f"{total}; set trainer.resume_mode=disable or another trainer.output_dir to "
                "start over"
            )
        elif validates and getattr(t, "val_before_train", False) and self.progress.global_step == 0:
            tracking.log(replay.run(lambda: self.trainer.validate(0), "validation"), step=0)
        while True:
            try:
                for step, batch in self.batches():
                    interrupt.check()
                    metrics = self._step(step, batch)
                    tracking.log(metrics, step=self.progress.global_step)
                    history.append(metrics)
                    if on_step:
                        on_step(step, metrics)
                if t.export_hf:
                    replay.run(lambda: self.trainer.export(self.run_dir.hf), "export")
                return
            except Rewound as rewound:
                self._step_states = None  # the rewind put the parts where the run stands
                history[:] = [m for m in history if m["training/global_step"] <= rewound.step]

    def _step(self, step: int, batch: Batch) -> dict[str, float]:
        """One step under replay, the data position advanced, then (under replay too)
        usage, validation and a checkpoint when due; the step's metrics."""

        def work() -> tuple[dict[str, Any], list[str]]:
            with self.profiler.step(step + 1, self.all_groups()) as profiled:
                started = time.time()
                metrics, trained = self.trainer.step(batch, self.calls)
                self._step_span = (started, time.time())  # the overhead comes with the usage
                profiled.update(metrics)
            return metrics, trained

        replay = self._replay_of_fit()
        self._step_states = capture(self.parts())
        metrics = replay.run_step(step, work, self.parts())
        self._step_states = None  # the step is done: a stop now keeps it
        self.progress.advance(batch.meta, self._data().batch_size, self.steps_per_epoch())
        metrics.update(replay.run(lambda: self._after_step(batch), "checkpoint and validation"))
        metrics.update(replay.take_recovery_metrics())
        return metrics

    def _after_step(self, batch: Batch) -> dict[str, float]:
        """Usage, validation when due, a checkpoint when due; their metrics."""
        t, done = self.cfg.trainer, self.progress.global_step
        metrics = self.usage()
        metrics.update({"training/global_step": done, "training/epoch": batch.meta["epoch"]})
        if hasattr(self.trainer, "more_workers"):  # they come and go between steps
            self.write_workers()
        last = done == self.total_steps()
        test_freq, save_freq = self._steps(t.test_freq), self._steps(t.save_freq)
        every = test_freq > 0
        at_end = last and (every or self.trainer.validate_at_end)
        if self._data().val is not None and ((every and done % test_freq == 0) or at_end):
            metrics.update(self.trainer.validate(done))
        if last or (save_freq > 0 and done % save_freq == 0):
            self.save_checkpoint()
        return metrics

    def _stop_safely(self, interrupt: StopOnInterrupt) -> None:
        """After a first Ctrl-C or SIGTERM: the step abandoned (its state undone from the
        snapshot) or finished, then a checkpoint of the step boundary the run stands at."""
        if self._step_states is not None:  # stopped inside a step: abandon it
            if self.calls.mutated:
                replay = self._replay_of_fit()
                if replay.can_undo:
                    replay.undo()
            restore(self.parts(), self._step_states)  # the KL controller, for one
        path = self.save_checkpoint()
        self.stopped, self.exit_code = True, interrupt.exit_code
        name = "SIGTERM" if interrupt.exit_code == 143 else "Ctrl-C"
        self.print(
            f"stopped by {name} after step {self.progress.global_step}; checkpoint {path}. "
            "Run the same command again to resume (trainer.resume_mode=auto)."
        )

    def usage(self) -> dict[str, float]:
        """Usage metrics of every group since the last call (with the last step's
        `timing_s/controller_overhead`); warns of CPU starvation, once per stage."""
        reports = {group.role: group.usage() for group in self.groups}
        span, self._step_span = self._step_span, None
        for warning in starved_stages(reports):
            key = warning.split(":", 1)[0]
            if key not in self._warned:
                self._warned.add(key)
                log.warning(warning)
                self.print(f"WARNING: {warning}")
        metrics = usage_metrics(reports)
        if span is not None:
            metrics["timing_s/controller_overhead"] = controller_overhead(reports, *span)
        return metrics


def _config_dict(cfg: RayRLConfig | SFTConfig) -> dict[str, Any]:
    from omegaconf import OmegaConf

    data: dict[str, Any] = OmegaConf.to_container(OmegaConf.structured(cfg))
    return data
