"""The PPO/GRPO loop on the controller: reserve, place the roles, then step.

A step, as data flows (DESIGN.md): prompts -> actor.generate -> reward.compute_score
(concurrently with actor.compute_log_prob and, when a KL term needs it,
compute_ref_log_prob) -> critic.compute_values (GAE) -> advantages on the controller
(`rayrl.trainer.advantage`) -> critic.update_critic -> actor.update_actor. With DAPO's
dynamic sampling the scores are awaited first and further rounds of prompts are
generated until the batch is full (`rayrl.trainer.dynamic_sampling`); ReMax adds a
greedy rollout per prompt as its baseline. Each stage is timed (`timing_s/<stage>`);
metrics use verl's names.

Around the steps, `fit` keeps what the run makes (`trainer.run_dir`): it resumes from
a checkpoint (`trainer.checkpoint`), validates (`trainer.validate`), logs every step
to the trackers (`trainer.tracking`), saves checkpoints and exports the final model.
It survives the loss of workers: every unit of work runs under `trainer.replay` (a
lost or hung worker is replaced and the step replayed from the step-start snapshot),
and a first Ctrl-C stops at a safe point with a checkpoint (`trainer.interrupt`).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from rayrl.batch import Batch
from rayrl.cluster import ray_private
from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import ResourcePool, reserve_pools
from rayrl.config.load import to_yaml
from rayrl.config.schema import RayRLConfig
from rayrl.config.validate import critic_enabled, ref_enabled
from rayrl.controller import WorkerGroup
from rayrl.controller.usage import starved_stages
from rayrl.trainer.advantage import AdvantageStage, entropy_metric, greedy_baselines, shape_rewards
from rayrl.trainer.balance import balance_batch
from rayrl.trainer.checkpoint import (
    CheckpointManager,
    TrainerState,
    driver_rng,
    load_state,
    restore_driver_rng,
)
from rayrl.trainer.data import load_datasets
from rayrl.trainer.dynamic_sampling import fill_batch
from rayrl.trainer.epochs import epoch_batches, total_steps
from rayrl.trainer.interrupt import StopOnInterrupt, StopRequested
from rayrl.trainer.metrics import (
    batch_metrics,
    controller_overhead,
    rollout_probs_diff,
    timer,
    usage_metrics,
)
from rayrl.trainer.model_dir import model_dir
from rayrl.trainer.names import check_names
from rayrl.trainer.on_policy import separate_pass_reason
from rayrl.trainer.ray_session import RaySession, check_debugger, connect
from rayrl.trainer.replay import Rewound, StepReplay
from rayrl.trainer.resources import pools_from_config, resolve_device
from rayrl.trainer.ride_along import riding_flags, riding_timing, with_flags
from rayrl.trainer.roles import print_placement, start_roles
from rayrl.trainer.run_dir import RunDir
from rayrl.trainer.stage_calls import StageCalls
from rayrl.trainer.tracking import Tracking, check_trackers
from rayrl.trainer.validate import Validator

log = logging.getLogger("rayrl.trainer")


def resolve_model_path(cfg: RayRLConfig) -> str:
    """The configured model directory, or the tiny demo model (built once, then reused)."""
    return model_dir(cfg.actor_rollout_ref.model.path, cfg.trainer.output_dir, cfg.trainer.seed)


class PPOTrainer:
    """Runs PPO-family training (GRPO, GAE-PPO, RLOO, ...) for one config.

    `print_fn` receives the run's messages (resume, dashboard, placement, warnings).
    """

    def __init__(self, cfg: RayRLConfig, print_fn: Callable[[str], None] = print) -> None:
        check_names(cfg)
        self.cfg = cfg
        self.print = print_fn
        self.run = f"{cfg.trainer.experiment_name}-{uuid.uuid4().hex[:6]}"
        self.run_dir = RunDir(Path(cfg.trainer.output_dir))
        self.model_path = resolve_model_path(cfg)
        self.use_critic = critic_enabled(cfg)
        self.use_ref = ref_enabled(cfg)
        self.advantage = AdvantageStage(cfg)  # holds the KL controller: checkpointed
        self.checkpoints = CheckpointManager(self.run_dir.checkpoints, _keep(cfg))
        self.state = TrainerState()
        self.pools: list[ResourcePool] = []
        self.groups: list[WorkerGroup] = []
        self.kv: KVStore | None = None
        self.session: RaySession | None = None
        self.val_dataset = None
        self._warned: set[str] = set()
        self._step_span: tuple[float, float] | None = None
        self.calls = StageCalls()  # the step's group calls, reused by a replay
        self.trained_uids: list[str] = []  # prompt uids of the last update (replay ledger)
        self.replay: StepReplay | None = None
        self.stopped = False  # a Ctrl-C ended fit() early, with a checkpoint
        self.riding: dict[str, bool] = {}  # stages the generate call computes (ride_along)

    # ------------------------------------------------------------------ setup
    def setup(self) -> PPOTrainer:
        """Check trackers and data, start or join Ray, reserve the pools (bounded waits,
        clear errors) and initialise every role."""
        cfg, res = self.cfg, self.cfg.resources
        check_trackers(cfg.trainer.logger)
        check_debugger(cfg)
        self.run_dir.prepare(to_yaml(cfg))
        if cfg.data.loader != "ray":
            self.load_data()
        self.session = connect(cfg)
        if self.session.dashboard_url:
            self.print(f"Ray dashboard: {self.session.dashboard_url}")
        if cfg.data.loader == "ray":
            self.load_data()
        import ray

        device = resolve_device(cfg, ray.cluster_resources().get("GPU", 0))
        self.kv = KVStore.create(self.run)
        # All pools checked together: none is held while another waits or cannot fit.
        self.pools = reserve_pools(pools_from_config(cfg, device), self.run, res.wait_timeout_s)
        start_roles(self, device)
        reward_in_actor = getattr(self.reward, "group", None) is self.hybrid
        self.riding = riding_flags(cfg, self.hybrid.world_size, reward_in_actor, self.use_ref)
        self.run_dir.write_workers(self.groups, self.session.log_dir)
        print_placement(self)
        self.usage()  # start the first step's usage sampling afresh (setup is not a step)
        return self

    def load_data(self):
        """Tokenizer, training prompts and validation prompts (before any reservation)."""
        from transformers import AutoTokenizer

        model = self.cfg.actor_rollout_ref.model
        self.tokenizer = AutoTokenizer.from_pretrained(
            model.tokenizer_path or self.model_path, trust_remote_code=model.trust_remote_code
        )
        self.dataset, self.val_dataset = load_datasets(self.cfg, self.tokenizer)
        return self.dataset

    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.cfg.data.train_batch_size

    def total_steps(self) -> int:
        """`trainer.total_training_steps`, or whole batches of the loaded dataset x epochs."""
        return total_steps(self.cfg.trainer, len(self.dataset), self.cfg.data.train_batch_size)

    def shutdown(self) -> None:
        """Kill the run's workers, release its pools and KV store; a Ray this trainer
        started stops too, all its processes at once (`ray_private.stop_local_ray`)."""
        local = self.session is not None and self.session.started_here
        for group in self.groups:
            group.shutdown()
        for pool in self.pools:
            pool.teardown()
        if self.kv is not None:  # no need to see the store gone when Ray stops next
            self.kv.shutdown(**({"wait_s": 0.0} if local else {}))
        if local:
            ray_private.stop_local_ray()
            self.session = None

    # ------------------------------------------------------- checkpoint/resume
    def save_checkpoint(self) -> Path:
        """Checkpoint the run as it stands after `self.state.global_step` steps."""
        state = replace(self.state, rng=driver_rng(), kl_ctrl=self.advantage.state_dict())

        def write(tmp: Path) -> None:
            self.actor.save(str(tmp))
            if self.critic is not None:
                self.critic.save(str(tmp))

        return self.checkpoints.save(state, write)

    def restore(self, path: str | Path) -> TrainerState:
        """Put every role and the trainer back to a checkpoint's step boundary."""
        self.actor.load(str(path))
        if self.critic is not None:
            self.critic.load(str(path))
        return self.restore_state(load_state(path))

    def restore_state(self, state: TrainerState) -> TrainerState:
        """The controller's part of a restore: RNGs, KL controller, step and data position."""
        restore_driver_rng(state.rng)
        if state.kl_ctrl is not None:
            self.advantage.load_state_dict(state.kl_ctrl)
        self.state = state
        return state

    def resume(self) -> Path | None:
        """Apply `trainer.resume_mode`; metrics.jsonl keeps the rows up to the resumed step."""
        t = self.cfg.trainer
        path = self.checkpoints.resolve(t.resume_mode, t.resume_from_path)
        if path is None:
            self.state = TrainerState()
            self.run_dir.metrics.unlink(missing_ok=True)
            return None
        state = self.restore(path)
        self.run_dir.keep_metrics_until(state.global_step)
        self.print(f"resumed from {path} ({state.describe()})")
        return path

    # ------------------------------------------------------------------- loop
    def batches(self, start: TrainerState | None = None) -> Iterator[tuple[int, Batch]]:
        """(step, prompts) from the data position of `start` to the end of the run,
        epoch after epoch, seeded per epoch. `prompts.meta` carries `epoch` and
        `batch_index` (its index in the epoch)."""
        d, t = self.cfg.data, self.cfg.trainer
        return epoch_batches(
            self.dataset,
            d.train_batch_size,
            start=start or TrainerState(),
            total=self.total_steps(),
            seed=t.seed if d.seed is None else d.seed,
            shuffle=d.shuffle,
            epochs=None if t.total_training_steps is not None else t.total_epochs,
        )

    def _advance(self, prompts: Batch) -> None:
        """The state after the step on `prompts`: the next data position included."""
        epoch, index = prompts.meta["epoch"], prompts.meta["batch_index"] + 1
        if index >= self.steps_per_epoch():
            epoch, index = epoch + 1, 0
        self.state = replace(
            self.state, global_step=prompts.meta["step"] + 1, epoch=epoch, batch=index
        )

    def fit(self, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
        """Resume, validate, train to the end with checkpoints and tracking, export.

        Worker failures are recovered and the step replayed (`trainer.replay`); a first
        Ctrl-C stops at a safe point with a checkpoint (`self.stopped` then)."""
        t = self.cfg.trainer
        self.resume()
        self.start_state = replace(
            self.state, rng=driver_rng(), kl_ctrl=self.advantage.state_dict()
        )
        total, history = self.total_steps(), []
        tracking = Tracking(
            t.logger,
            self.run_dir.root,
            project=t.project_name,
            experiment=t.experiment_name,
            config=_config_dict(self.cfg),
            print_fn=self.print,
        )
        validator = Validator(self, self.val_dataset) if self.val_dataset else None
        replay = self.replay = StepReplay(self)
        try:
            with StopOnInterrupt(self.print) as interrupt:
                self.calls.stop_check = lambda mutated: interrupt.check(mutated, replay.can_undo)
                try:
                    replay.start()
                    self._train(total, validator, tracking, history, on_step, interrupt)
                except StopRequested:
                    self._stop_safely()
        finally:
            self.calls.stop_check = lambda mutated: None
            tracking.finish()
        return history

    def _train(self, total, validator, tracking, history, on_step, interrupt) -> None:
        """Validation before training, the steps with what follows each, the export; each
        under recovery. A rewind to a checkpoint (a lost snapshot) continues from there."""
        t, replay = self.cfg.trainer, self.replay
        if t.val_only:  # verl's trainer.val_only: validate the model as it is, then stop
            if validator is None:
                raise ValueError("trainer.val_only=true needs validation data (data.val_files)")
            step = self.state.global_step
            tracking.log(replay.run(lambda: validator.run(step), "validation"), step=step)
            return
        if self.state.global_step >= total:
            self.print(
                f"nothing to train: the checkpoint is at step {self.state.global_step} of "
                f"{total}; set trainer.resume_mode=disable or another trainer.output_dir to start over"
            )
        elif validator and t.val_before_train and self.state.global_step == 0:
            tracking.log(replay.run(lambda: validator.run(0), "validation"), step=0)
        while True:
            try:
                for step, prompts in self.batches(self.state):
                    interrupt.check()
                    metrics = replay.run_step(prompts)
                    self._advance(prompts)
                    metrics.update(
                        replay.run(
                            lambda p=prompts: self._after_step(p, total, validator),
                            "checkpoint and validation",
                        )
                    )
                    tracking.log(metrics, step=self.state.global_step)
                    history.append(metrics)
                    if on_step:
                        on_step(step, metrics)
                if t.export_hf:
                    replay.run(lambda: self.actor.export_hf(str(self.run_dir.hf)), "export")
                return
            except Rewound as rewound:
                history[:] = [m for m in history if m["training/global_step"] <= rewound.step]

    def _stop_safely(self) -> None:
        """After a first Ctrl-C: the step abandoned (its state undone from the snapshot)
        or finished, then a checkpoint of the step boundary the run stands at."""
        if self.calls.mutated and self.replay.can_undo:
            self.replay.undo()
        path = self.save_checkpoint()
        self.stopped = True
        self.print(
            f"stopped by Ctrl-C after step {self.state.global_step}; checkpoint {path}. "
            "Run the same command again to resume (trainer.resume_mode=auto)."
        )

    def _after_step(self, prompts: Batch, total: int, validator: Validator | None) -> dict:
        """Usage, validation when due, a checkpoint when due; their metrics."""
        t, done = self.cfg.trainer, self.state.global_step
        metrics = self.usage()
        metrics.update({"training/global_step": done, "training/epoch": prompts.meta["epoch"]})
        last = done == total
        if validator and t.test_freq > 0 and (done % t.test_freq == 0 or last):
            metrics.update(validator.run(done))
        if last or (t.save_freq > 0 and done % t.save_freq == 0):
            self.save_checkpoint()
        return metrics

    def usage(self) -> dict[str, float]:
        """Usage metrics of every group since the last call (with the last step's
        `timing_s/controller_overhead`); warns of CPU starvation."""
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

    def step(self, prompts: Batch) -> dict[str, float]:
        """One PPO step on a batch of prompts; returns its metrics."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        alg = self.cfg.algorithm
        started = time.time()
        with timer(timing, "step"):
            gen_prompts = with_flags(self._balanced(prompts, metrics, "gen"), self.riding)
            with timer(timing, "gen"):
                batch = self.calls.run("gen", self.actor.generate, gen_prompts)
            timing["weight_sync"] = float(batch.meta.pop("timing_s/weight_sync", 0.0))
            batch, riding = riding_timing(batch)  # reward, ref computed by the generate call
            timing.update(riding, gen=timing["gen"] - sum(riding.values()))
            batch = self._balanced(batch, metrics, "train")
            reward_future = None
            if "reward" in riding:
                batch = self._scored(batch, None, metrics)
            else:
                reward_future = self.calls.start("reward", self.reward.compute_score, batch)
            if alg.filter_groups.enable:
                with timer(timing, "dynamic_sampling"):
                    batch = self._scored(batch, reward_future.get(), metrics)
                    batch, sampled = fill_batch(
                        self.cfg, batch, lambda r: self._extra_round(prompts, r, metrics)
                    )
                metrics.update(sampled)
                reward_future = None
            if alg.adv_estimator == "remax":
                with timer(timing, "gen_baseline"):
                    batch["reward_baselines"] = self._greedy_baselines(prompts, batch)
            if separate_pass_reason(self.cfg, len(batch)) is None:
                timing["old_log_prob"] = 0.0  # the update's own log-probs (trainer.on_policy)
                batch.meta["on_policy"] = True
            else:
                with timer(timing, "old_log_prob"):
                    old = self.calls.run("old_log_prob", self.actor.compute_log_prob, batch)
                    batch = batch.union(old.select("old_log_probs"))
                    metrics.update(entropy_metric(self.cfg, old["entropy"], batch["response_mask"]))
                    if self.cfg.actor_rollout_ref.rollout.calculate_log_probs:
                        metrics.update(rollout_probs_diff(batch))
            if self.use_ref and "ref" not in riding:
                with timer(timing, "ref"):
                    batch = batch.union(
                        self.calls.run("ref", self.actor.compute_ref_log_prob, batch)
                    )
            if self.critic is not None:
                with timer(timing, "values"):
                    batch = batch.union(self.calls.run("values", self.critic.compute_values, batch))
            if reward_future is not None:
                with timer(timing, "reward"):
                    batch = self._scored(batch, reward_future.get(), metrics)
            lengths = batch["response_mask"].sum(-1).float()
            with timer(timing, "adv"):
                metrics.update(self.advantage(batch))
            if self.critic is not None:
                with timer(timing, "update_critic"):
                    metrics.update(
                        self.calls.run(
                            "update_critic", self.critic.update_critic, batch, mutates=True
                        )
                    )
            self.trained_uids = sorted(set(batch["uid"]))
            if self._actor_learns(prompts):
                with timer(timing, "update_actor"):
                    metrics.update(
                        self.calls.run("update_actor", self.actor.update_actor, batch, mutates=True)
                    )
        self._step_span = (started, time.time())  # the overhead comes with the usage reports
        metrics.update(batch_metrics(batch, lengths))
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        tokens = float(batch["attention_mask"].sum())
        ranks = self.cfg.trainer.nnodes * self.cfg.trainer.n_gpus_per_node
        metrics["perf/total_num_tokens"] = tokens
        metrics["perf/throughput"] = tokens / (timing["step"] * ranks)  # per GPU, as verl
        return metrics

    def _balanced(self, batch: Batch, metrics: dict[str, float], stage: str) -> Batch:
        """`trainer.balance_batch`: rows reordered so each data-parallel rank's chunk holds
        about the same number of tokens (prompts before generation, whole sequences
        after it), with the imbalance (heaviest rank / mean) before and after."""
        t = self.cfg.trainer
        if not t.balance_batch:
            return batch
        batch, found = balance_batch(batch, t.nnodes * t.n_gpus_per_node)
        metrics.update({f"{k}/{stage}": v for k, v in found.items()})
        return batch

    def _actor_learns(self, prompts: Batch) -> bool:
        """False during the critic's warm-up (`trainer.critic_warmup` first steps)."""
        return int(prompts.meta.get("step", 0)) >= self.cfg.trainer.critic_warmup

    def _scored(self, batch: Batch, scores: Batch | None, metrics: dict[str, float]) -> Batch:
        """`batch` with its scores (overlong penalty added); failed scorings logged. The
        reward worker's metrics (`reward/score/mean`, ...) of the first scoring in a step
        are kept: they cover every sample of the step's prompts, before any filtering.
        `scores` None: `batch` carries them already (`trainer.ride_along`)."""
        if scores is None:
            reward_metrics = batch.meta.pop("reward_metrics", {})
        else:
            reward_metrics = scores.meta.get("reward_metrics", {})
            batch = batch.union(
                scores.select("token_level_scores", "scores", "reward_error", "reward_extra")
            )
        for key, value in reward_metrics.items():
            metrics.setdefault(key, value)
        metrics.update(shape_rewards(self.cfg, batch))
        errors = [e for e in batch["reward_error"] if e is not None]
        if errors:
            log.warning(
                "reward: %d of %d samples failed to score and count 0 (first: %s)",
                len(errors),
                len(batch),
                errors[0],
            )
        return batch

    def _greedy_baselines(self, prompts: Batch, batch: Batch):
        """ReMax: each prompt's greedy response, scored, as its samples' baseline."""
        greedy_prompts = Batch(dict(prompts.tensors), dict(prompts.non_tensors), dict(prompts.meta))
        greedy_prompts.meta["greedy"] = True
        greedy = self.calls.run("gen_greedy", self.actor.generate, greedy_prompts)
        greedy = greedy.union(
            self.calls.run("reward_greedy", self.reward.compute_score, greedy).select("scores")
        )
        return greedy_baselines(batch, greedy)

    def _extra_round(self, prompts: Batch, round_: int, metrics: dict[str, float]) -> Batch:
        """Dynamic sampling: fresh prompts (seeded by run seed, step and round),
        generated and scored; their uids carry the round so groups never merge."""
        d, step = self.cfg.data, int(prompts.meta.get("step", 0))
        size = min(d.gen_batch_size or d.train_batch_size, len(self.dataset))
        rng = random.Random(f"{self.cfg.trainer.seed}:extra:{step}:{round_}")
        fresh = self.dataset.collate(rng.sample(range(len(self.dataset)), size))
        fresh["uid"] = np.array([f"{u}@{round_}" for u in fresh["uid"]], dtype=object)
        fresh.meta.update(prompts.meta)
        batch = self.calls.run("gen_extra", self.actor.generate, fresh)
        return self._scored(
            batch, self.calls.run("reward_extra", self.reward.compute_score, batch), metrics
        )


def _keep(cfg: RayRLConfig) -> int | None:
    """Checkpoints to keep: a step directory holds the actor and the critic, so the
    larger of `max_actor_ckpt_to_keep` and `max_critic_ckpt_to_keep` (None: all)."""
    t = cfg.trainer
    keeps = [t.max_actor_ckpt_to_keep]
    if critic_enabled(cfg):
        keeps.append(t.max_critic_ckpt_to_keep)
    return None if None in keeps else max(keeps)


def _config_dict(cfg: RayRLConfig) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))
