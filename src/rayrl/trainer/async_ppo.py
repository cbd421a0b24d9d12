"""Asynchronous PPO/GRPO (`actor_rollout_ref.rollout.mode=async`): rollout replicas on a
pool of their own generate while the trainer trains.

The trainer is `PPOTrainer` with one piece swapped: a step does not generate, it takes
its batch from the sample queue (`rayrl.trainer.async_queue`), which the replicas
(`rayrl.trainer.async_rollout`) fill with the prompts fed ahead of time. Everything
after generation (scores, log-probs, advantages, updates, metrics) is the synchronous
step's own code. A step:

1. feeds the prompts of the steps the staleness bound lets run ahead (the data walk
   of the run, `epoch_batches`, read ahead);
2. publishes the policy when the replicas do not hold this step's (a fresh start on
   the model directory needs nothing; a resume or a restore does);
3. waits for a batch of finished prompts (`timing_s/wait_for_batch`), too stale ones
   dropped and queued again;
4. runs the PPO step on it (`PPOTrainer.step`);
5. records the prompts in the per-epoch ledger and publishes the new policy every
   `async_training.trigger_parameter_sync_step` steps.

Staleness (`async_training.staleness_threshold` k, sync every N steps): a sample of
policy version v trains at step s only if s - v <= N x (ceil(k) + 1) - 1 (`max_lag`;
k = 0, N = 1 is the synchronous run, k = 1, N = 1 without partial rollouts verl's
one-step-off-policy). Where samples may lag, the loss weighs each token by the
truncated importance ratio of the current policy to the one that sampled it
(`algorithm.rollout_correction`, token level with cap `rollout_is_threshold` unless
set otherwise), so stale samples are corrected, not ignored.

Validation and the HF export run on the trainer's own rollout engine, as in a
synchronous run (verl's `use_trainer_do_validate`).
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rayrl.batch import Batch
from rayrl.cluster.pool import ResourcePool
from rayrl.config.schema import AsyncTrainingConfig, RayRLConfig
from rayrl.controller import WorkerGroup
from rayrl.trainer.async_queue import FINISHED, Prompt, SampleQueue, concat_samples
from rayrl.trainer.async_rollout import RolloutManager
from rayrl.trainer.episodes import episode_metrics, is_multi_turn
from rayrl.trainer.epochs import epoch_batches
from rayrl.trainer.generations import VERSIONS
from rayrl.trainer.metrics import timer, usage_metrics
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.resources import ROLLOUT_POOL
from rayrl.trainer.ride_along import Riding
from rayrl.trainer.roles import GroupEnv
from rayrl.trainer.stage_calls import StageCalls
from rayrl.trainer.state import Progress, Stateful
from rayrl.workers.context import StepContext

__all__ = ["AsyncPPOTrainer", "max_lag", "with_async_correction"]


def max_lag(a: AsyncTrainingConfig) -> int:
    """The largest s - v a sample of policy v may train with at step s (module doc)."""
    return a.trigger_parameter_sync_step * (math.ceil(a.staleness_threshold) + 1) - 1


def window(a: AsyncTrainingConfig) -> float:
    """Policy versions of generation admitted ahead of training: N x (1 + k)."""
    return a.trigger_parameter_sync_step * (1.0 + a.staleness_threshold)


def with_async_correction(cfg: RayRLConfig, print_fn: Callable[[str], None]) -> RayRLConfig:
    """`cfg`, with token-level truncated importance sampling when samples may lag the
    policy and `algorithm.rollout_correction.rollout_is` is unset."""
    correction = cfg.algorithm.rollout_correction
    if max_lag(cfg.async_training) == 0 or correction.rollout_is is not None:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.algorithm.rollout_correction.rollout_is = "token"
    print_fn(
        "rollout.mode=async: samples may come from older policies, so the loss weighs "
        "them by truncated importance ratios (algorithm.rollout_correction.rollout_is="
        f"token, cap rollout_is_threshold={correction.rollout_is_threshold})"
    )
    return cfg


class AsyncState:
    """The async trainer's driver part: the sample queue and its ledger. Loading it
    (a resume, a rewind, a step replayed) also tells the rollout manager when the
    replicas hold a policy newer than the restored one."""

    def __init__(self, trainer: AsyncPPOTrainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.queue.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        queue, rollouts = self.trainer.queue, self.trainer.rollouts
        queue.load_state_dict(state)
        if rollouts is None:
            return
        published = rollouts.published_version
        if published is not None and published > queue.steps_done:
            rollouts.invalidate()


class AsyncPPOTrainer(PPOTrainer):
    """PPO-family training with a separate, elastic rollout pool (module docstring)."""

    kind = "async"

    def __init__(self, cfg: RayRLConfig, print_fn: Callable[[str], None] = print) -> None:
        super().__init__(with_async_correction(cfg, print_fn), print_fn)
        a = self.cfg.async_training
        self.max_lag = max_lag(a)
        self.lookahead = max(0, math.ceil(window(a) - 1e-9) - 1)
        self.queue = SampleQueue(
            self.cfg.data.train_batch_size,
            self.cfg.actor_rollout_ref.rollout.n,
            self.max_lag,
            window(a),
        )
        self.rollouts: RolloutManager | None = None
        self.total_steps = 0
        self._feeder: Iterator[tuple[int, Batch]] | None = None
        self._feeder_next: int | None = None
        self._taken: list[Prompt] = []
        self._since = time.time()
        self._requeued = 0
        self._dropped = 0

    # ------------------------------------------------------------ the contract
    def more_workers(self) -> list[WorkerGroup]:
        """The rollout replicas running now (listed in workers.json beside the groups)."""
        rollouts = getattr(self, "rollouts", None)
        return [replica.group for replica in list(rollouts.replicas)] if rollouts else []

    def start(
        self, pools: list[ResourcePool], env: GroupEnv, device: str, total_steps: int
    ) -> list[WorkerGroup]:
        """The trainer's roles and the rollout replicas (the last pool), side by side."""
        self.total_steps = total_steps
        pool = pools[-1]
        if pool.spec.name != ROLLOUT_POOL:
            raise RuntimeError(
                f"the async trainer expects the rollout pool last; got {pool.spec.name!r}"
            )
        rollouts = self.rollouts = RolloutManager(
            self.cfg, self.queue, env, self.model_path, self.max_lag, self.print
        )
        failed: list[BaseException] = []

        def start_rollouts() -> None:
            try:
                rollouts.start(pool)
            except BaseException as err:  # noqa: BLE001 - raised below, in this thread
                failed.append(err)

        starter = threading.Thread(target=start_rollouts, name="rayrl-rollout-start")
        starter.start()
        try:
            groups = super().start(pools[:-1], env, device, total_steps)
        except BaseException:
            starter.join()
            rollouts.stop()
            raise
        starter.join()
        if failed:
            for group in groups:
                group.shutdown()
            raise failed[0]
        self.riding = Riding()  # generation is not the trainer's: nothing rides on it
        replicas = rollouts.replicas
        nodes = ", ".join(sorted({r.node[:8] for r in replicas}))
        self.print(
            f"{ROLLOUT_POOL}: {len(replicas)} replica(s) on node(s) {nodes}; staleness up to "
            f"{self.max_lag} step(s), partial rollouts "
            f"{'on' if self.cfg.async_training.partial_rollout else 'off'}"
        )
        return groups

    def _rollouts(self) -> RolloutManager:
        if self.rollouts is None:
            raise RuntimeError("the rollout replicas are not started yet: call start() first")
        return self.rollouts

    def parts(self) -> dict[str, Stateful]:
        return {**super().parts(), "async": AsyncState(self)}

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "rollout.mode": "async"}

    def load(self, path: Path) -> None:
        super().load(path)
        if self.rollouts is not None:
            self.rollouts.invalidate()  # the replicas hold another policy now

    def shutdown(self) -> None:
        """Stop the rollout manager and its replicas (`Run.shutdown` calls this first)."""
        if self.rollouts is not None:
            self.rollouts.stop()

    # ------------------------------------------------------------------ a step
    def step(self, prompts: Batch, calls: StageCalls) -> tuple[dict[str, float], list[str]]:
        """Feed ahead, take a batch from the queue, the PPO step on it, then the ledger
        and the policy for the replicas (module docstring)."""
        step = int(prompts.meta["step"])
        timing: dict[str, float] = {}
        self.queue.prune()
        self._feed(prompts)
        self._sync_weights(step, calls, timing)
        metrics, trained = super().step(prompts, calls)
        self.queue.trained(step, self._taken)
        every = self.cfg.async_training.trigger_parameter_sync_step
        if (step + 1) % every == 0 and step + 1 < self.total_steps:
            self._publish(step + 1, calls, timing)
        metrics.update(self._async_metrics(metrics, timing))
        return metrics, trained

    def _feed(self, prompts: Batch) -> None:
        """Feed the batches of this step and of the steps the bound lets run ahead."""
        meta, queue = prompts.meta, self.queue
        step = int(meta["step"])
        last = min(step + self.lookahead, self.total_steps - 1)
        if queue.fed_through >= last:
            return
        if self._feeder is None or self._feeder_next != queue.fed_through + 1:
            t, data = self.cfg.trainer, self.data
            if data is None:
                raise RuntimeError("the trainer's data is not loaded yet: call load_data() first")
            start = Progress(step, int(meta["epoch"]), int(meta["batch_index"]))
            self._feeder = epoch_batches(
                data.dataset,
                data.batch_size,
                start=start,
                total=self.total_steps,
                epochs=None if t.total_training_steps is not None else t.total_epochs,
                seed=t.seed,
                shuffle=data.shuffle,
            )
        for fed, batch in self._feeder:
            self._feeder_next = fed + 1
            if fed > queue.fed_through:
                queue.feed(batch, int(batch.meta["epoch"]), fed)
            if fed >= last:
                break

    def _sync_weights(self, step: int, calls: StageCalls, timing: dict[str, float]) -> None:
        """Publish this step's policy when the replicas lack it: after a resume or a
        restore, or when a replica could not fetch the last one; a fresh run's replicas
        hold the model directory's weights, version 0, already."""
        rollouts = self._rollouts()
        held = rollouts.published_version
        if held is not None and held <= step and not rollouts.needs_publish:
            return
        if step == 0 and rollouts.all_hold(0):
            rollouts.assume(0)
            return
        self._publish(step, calls, timing)

    def _publish(self, version: int, calls: StageCalls, timing: dict[str, float]) -> None:
        """Policy `version` to the replicas, by `async_training.weight_transport`: with
        ``collective`` the replicas are asked to receive first, then actor rank 0
        broadcasts (`RolloutManager.begin_collective`)."""
        transport, rollouts = self.cfg.async_training.weight_transport, self._rollouts()
        with timer(timing, "weight_publish"):
            extra: dict[str, Any] = {}
            if transport == "collective":
                sender = self._roles().hybrid.generation
                extra = rollouts.begin_collective(version, sender)
            publish = self._roles().actor.publish_weights
            try:
                weights = calls.run("publish_weights", publish, transport=transport, **extra)
            except BaseException:
                if transport == "collective":  # the replicas waiting for it stop now
                    rollouts.sender_lost()
                raise
        rollouts.publish(version, weights)

    def _generate(
        self,
        prompts: Batch,
        ctx: StepContext,
        calls: StageCalls,
        timing: dict[str, float],
        metrics: dict[str, Any],
    ) -> Batch:
        """The step's batch from the queue (`timing_s/wait_for_batch`), its per-token
        staleness, balanced across ranks as the synchronous step's samples are."""
        # the same imbalance metrics as a synchronous step
        self._balanced(prompts, metrics, "gen", self._parts("rollout"))
        wait_s, rollouts = self.cfg.trainer.stage_timeout_s, self._rollouts()

        def check() -> None:
            rollouts.check(wait_s)
            if rollouts.needs_publish:  # its objects were lost (their owner died)
                self._publish(ctx.step, calls, timing)
            calls.stop_check(calls.mutated)  # a first Ctrl-C stops the wait

        with timer(timing, "wait_for_batch"):
            taken = self._taken = self.queue.wait_take(ctx.step, check)
        samples = []
        for p in taken:
            assert p.samples is not None  # a prompt taken is finished: its samples are in
            samples.append(p.samples)
        batch = concat_samples(samples, self._actor_tokenizer().pad_token_id)
        batch = Batch(batch.tensors, batch.non_tensors, dict(prompts.meta))
        versions = torch.cat([p.versions for p in taken])
        metrics.update(staleness_metrics(ctx.step, versions, batch["response_mask"]))
        if self.rollout_data is not None:  # each row's policy versions, in its dump
            batch[VERSIONS] = versions
        if is_multi_turn(batch):  # the episodes' turns, tool calls and events
            metrics.update(episode_metrics(batch))
            self.tool_budget.check(batch)  # once per run: tool turns cut short
        return self._balanced(batch, metrics, "train", self._parts("train"))

    def _async_metrics(self, metrics: dict[str, Any], timing: dict[str, float]) -> dict[str, float]:
        now, rollouts = time.time(), self._rollouts()
        out = rollouts.metrics(self._since, now)
        self._since = now
        queue = self.queue
        requeued = sum(queue.ledger.requeued.values())
        out["async/requeued"] = float(requeued - self._requeued)
        out["async/dropped"] = float(queue.dropped - self._dropped)
        self._requeued, self._dropped = requeued, queue.dropped
        out["async/queue_size"] = float(queue.counts()[FINISHED])
        out["async/max_lag"] = float(self.max_lag)
        extra = sum(timing.values())
        for key, value in timing.items():
            out[f"timing_s/{key}"] = value
        step_s = metrics.get("timing_s/step", 0.0) + extra
        if "timing_s/step" in metrics:
            out["timing_s/step"] = step_s
        wait = metrics.get("timing_s/wait_for_batch", 0.0)
        if step_s > 0:
            out["perf/train_idle_fraction"] = wait / step_s
        out.update(usage_metrics({ROLLOUT_POOL: rollouts.usage()}))
        return out


def staleness_metrics(step: int, versions: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`async/staleness/{mean,max}`: step - the version of each sampled response token;
    `rollout/weight_versions_in_batch`: how many policy versions drew the batch's tokens
    (more than one where partial rollouts swapped weights mid-sequence, or calls of
    several versions met in one batch)."""
    sampled = versions[mask.bool()]
    lag = (step - sampled).float()
    if lag.numel() == 0:
        return {"async/staleness/mean": 0.0, "async/staleness/max": 0.0}
    return {
        "async/staleness/mean": float(lag.mean()),
        "async/staleness/max": float(lag.max()),
        "rollout/weight_versions_in_batch": float(sampled.unique().numel()),
    }
