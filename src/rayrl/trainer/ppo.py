"""The PPO/GRPO loop on the controller: reserve, place the roles, then step.

A step, as data flows (DESIGN.md): prompts -> actor.generate -> reward.compute_score
(concurrently with actor.compute_log_prob and, when a KL term needs it,
compute_ref_log_prob) -> critic.compute_values (GAE) -> advantages on the controller
(`rayrl.trainer.advantage`) -> critic.update_critic -> actor.update_actor. With DAPO's
dynamic sampling the scores are awaited first and further rounds of prompts are
generated until the batch is full (`rayrl.trainer.dynamic_sampling`); ReMax adds a
greedy rollout per prompt as its baseline. Each stage is timed (`timing_s/<stage>`);
metrics use verl's names.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import ray

from rayrl.batch import Batch
from rayrl.cluster.inspect import resolve_address
from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import ResourcePool, reserve_pools
from rayrl.config.schema import RayRLConfig
from rayrl.config.validate import critic_enabled, ref_enabled
from rayrl.controller import WorkerGroup, colocate
from rayrl.data import PromptDataset, read_parquet_with_sources, synthetic_rows
from rayrl.trainer.advantage import AdvantageStage, entropy_metric, greedy_baselines, shape_rewards
from rayrl.trainer.dynamic_sampling import fill_batch
from rayrl.trainer.names import check_names
from rayrl.trainer.resources import pools_from_config, resolve_device
from rayrl.workers import ActorRolloutRefWorker, CriticWorker, RewardWorker

log = logging.getLogger(__name__)


def resolve_model_path(cfg: RayRLConfig) -> str:
    """The configured model directory, or the tiny demo model (built once, then reused)."""
    from rayrl.models import build_tiny_model

    if cfg.actor_rollout_ref.model.path:
        return cfg.actor_rollout_ref.model.path
    out = Path(cfg.trainer.output_dir) / "tiny-model"
    if not (out / "config.json").is_file():
        build_tiny_model(out, layers=2, hidden=64, seed=cfg.trainer.seed, overwrite=True)
    return str(out)


class PPOTrainer:
    """Runs PPO-family training (GRPO, GAE-PPO, RLOO, ...) for one config."""

    def __init__(self, cfg: RayRLConfig) -> None:
        check_names(cfg)
        self.cfg = cfg
        self.run = f"{cfg.trainer.experiment_name}-{uuid.uuid4().hex[:6]}"
        self.model_path = resolve_model_path(cfg)
        self.use_critic = critic_enabled(cfg)
        self.use_ref = ref_enabled(cfg)
        self.advantage = AdvantageStage(cfg)
        self.pools: list[ResourcePool] = []
        self.groups: list[WorkerGroup] = []
        self.kv: KVStore | None = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> PPOTrainer:
        """Reserve the pools (bounded waits, clear errors) and initialise every role."""
        cfg, res = self.cfg, self.cfg.resources
        self.load_data()
        if not ray.is_initialized():
            address = resolve_address(None, res.address) or "local"  # RAY_ADDRESS too
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        device = resolve_device(cfg, ray.cluster_resources().get("GPU", 0))
        self.kv = KVStore.create(self.run)
        # All pools checked together: none is held while another waits or cannot fit.
        self.pools = reserve_pools(pools_from_config(cfg, device), self.run, res.wait_timeout_s)
        actor_pool, reward_pool = self.pools
        steps = self.total_steps()
        backend = "nccl" if device == "cuda" else "gloo"
        common = {
            "config": cfg,
            "model_path": self.model_path,
            "dist_backend": backend,
            "total_steps": steps,
        }
        if self.use_critic:
            cls = colocate({"actor": ActorRolloutRefWorker, "critic": CriticWorker})
            init = {"actor": {**common, "with_ref": self.use_ref}, "critic": common}
        else:
            cls, init = ActorRolloutRefWorker, {**common, "with_ref": self.use_ref}
        hybrid = self._group(cls, actor_pool, "actor_rollout_ref", init)
        self.actor = hybrid.view("actor") if self.use_critic else hybrid
        self.critic = hybrid.view("critic") if self.use_critic else None
        self.reward = self._group(
            RewardWorker, reward_pool, "reward", {"config": cfg, "tokenizer_path": self.model_path}
        )
        return self

    def _group(self, cls: type, pool: ResourcePool, role: str, init: dict) -> WorkerGroup:
        res = self.cfg.resources
        group = WorkerGroup(cls, pool.bundles, role=role, run=self.run, kv=self.kv, pool=pool)
        self.groups.append(group)
        group.create(timeout_s=res.create_timeout_s)
        group.init(timeout_s=res.init_timeout_s, retries=res.init_retries, **init)
        return group

    def load_data(self) -> PromptDataset:
        """Tokenizer and prompt dataset, before any resource is reserved; a dataset
        with fewer usable rows than one batch raises DataError with both numbers."""
        from transformers import AutoTokenizer

        model = self.cfg.actor_rollout_ref.model
        self.tokenizer = AutoTokenizer.from_pretrained(
            model.tokenizer_path or self.model_path, trust_remote_code=model.trust_remote_code
        )
        self.dataset = self._dataset()
        self.dataset.require_rows(self.cfg.data.train_batch_size)
        return self.dataset

    def _dataset(self) -> PromptDataset:
        d = self.cfg.data
        if d.train_files:
            rows, sources = read_parquet_with_sources(d.train_files)
        else:
            rows = synthetic_rows(d.synthetic_task, d.synthetic_size, self.cfg.trainer.seed)
            sources = None
        return PromptDataset(
            rows, self.tokenizer, max_prompt_length=d.max_prompt_length,
            truncation=d.truncation, filter_overlong=d.filter_overlong_prompts,
            prompt_key=d.prompt_key, sources=sources,
        )  # fmt: skip

    def total_steps(self) -> int:
        """`trainer.total_training_steps`, or whole batches of the loaded dataset x epochs."""
        t, d = self.cfg.trainer, self.cfg.data
        if t.total_training_steps is not None:
            return t.total_training_steps
        return max(1, len(self.dataset) // d.train_batch_size) * t.total_epochs

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()
        for pool in self.pools:
            pool.teardown()
        if self.kv is not None:
            self.kv.shutdown()

    # ------------------------------------------------------------------- loop
    def batches(self) -> Iterator[tuple[int, Batch]]:
        """(step, prompts) for the whole run, epoch after epoch, seeded per epoch."""
        d, t, step = self.cfg.data, self.cfg.trainer, 0
        total = self.total_steps()
        self.dataset.require_rows(d.train_batch_size)  # else no epoch yields a batch
        for epoch in range(t.total_epochs if t.total_training_steps is None else 10**9):
            for prompts in self.dataset.batches(
                d.train_batch_size, epoch=epoch, seed=t.seed, shuffle=d.shuffle
            ):
                if step >= total:
                    return
                prompts.meta["step"] = step
                yield step, prompts
                step += 1

    def fit(self, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
        history = []
        for step, prompts in self.batches():
            metrics = self.step(prompts)
            history.append(metrics)
            if on_step:
                on_step(step, metrics)
        return history

    def step(self, prompts: Batch) -> dict[str, float]:
        """One PPO step on a batch of prompts; returns its metrics."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        alg = self.cfg.algorithm
        with _timer(timing, "step"):
            with _timer(timing, "gen"):
                batch = self.actor.generate(prompts)
            timing["weight_sync"] = float(batch.meta.pop("timing_s/weight_sync", 0.0))
            reward_future = self.reward.compute_score(batch, blocking=False)
            if alg.filter_groups.enable:
                with _timer(timing, "dynamic_sampling"):
                    batch = self._scored(batch, reward_future.get(), metrics)
                    batch, sampled = fill_batch(
                        self.cfg, batch, lambda r: self._extra_round(prompts, r, metrics)
                    )
                metrics.update(sampled)
                reward_future = None
            if alg.adv_estimator == "remax":
                with _timer(timing, "gen_baseline"):
                    batch["reward_baselines"] = self._greedy_baselines(prompts, batch)
            with _timer(timing, "old_log_prob"):
                old = self.actor.compute_log_prob(batch)
                batch = batch.union(old.select("old_log_probs"))
                metrics.update(entropy_metric(self.cfg, old["entropy"], batch["response_mask"]))
            if self.use_ref:
                with _timer(timing, "ref"):
                    batch = batch.union(self.actor.compute_ref_log_prob(batch))
            if self.critic is not None:
                with _timer(timing, "values"):
                    batch = batch.union(self.critic.compute_values(batch))
            if reward_future is not None:
                with _timer(timing, "reward"):
                    batch = self._scored(batch, reward_future.get(), metrics)
            lengths = batch["response_mask"].sum(-1).float()
            with _timer(timing, "adv"):
                metrics.update(self.advantage(batch))
            if self.critic is not None:
                with _timer(timing, "update_critic"):
                    metrics.update(self.critic.update_critic(batch))
            if self._actor_learns(prompts):
                with _timer(timing, "update_actor"):
                    metrics.update(self.actor.update_actor(batch))
        metrics.update(_batch_metrics(batch, lengths))
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        tokens = float(batch["attention_mask"].sum())
        metrics["perf/throughput"] = tokens / timing["step"]
        return metrics

    def _actor_learns(self, prompts: Batch) -> bool:
        """False during the critic's warm-up (`trainer.critic_warmup` first steps)."""
        return int(prompts.meta.get("step", 0)) >= self.cfg.trainer.critic_warmup

    def _scored(self, batch: Batch, scores: Batch, metrics: dict[str, float]) -> Batch:
        """`batch` with its scores (overlong penalty added); failed scorings logged. The
        reward worker's metrics (`reward/score/mean`, ...) of the first scoring in a step
        are kept: they cover every sample of the step's prompts, before any filtering."""
        for key, value in scores.meta.get("reward_metrics", {}).items():
            metrics.setdefault(key, value)
        batch = batch.union(
            scores.select("token_level_scores", "scores", "reward_error", "reward_extra")
        )
        metrics.update(shape_rewards(self.cfg, batch))
        errors = [e for e in batch["reward_error"] if e is not None]
        if errors:
            log.warning(
                "reward: %d of %d samples failed to score and count 0 (first: %s)",
                len(errors), len(batch), errors[0],
            )  # fmt: skip
        return batch

    def _greedy_baselines(self, prompts: Batch, batch: Batch):
        """ReMax: each prompt's greedy response, scored, as its samples' baseline."""
        greedy_prompts = Batch(dict(prompts.tensors), dict(prompts.non_tensors), dict(prompts.meta))
        greedy_prompts.meta["greedy"] = True
        greedy = self.actor.generate(greedy_prompts)
        greedy = greedy.union(self.reward.compute_score(greedy).select("scores"))
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
        batch = self.actor.generate(fresh)
        return self._scored(batch, self.reward.compute_score(batch), metrics)


def _batch_metrics(batch: Batch, lengths) -> dict[str, float]:
    """verl's batch metrics; `lengths` are the response lengths before any masking."""
    errors = sum(e is not None for e in batch["reward_error"])
    finish = list(batch["finish_reason"])
    return {
        "critic/score/mean": float(batch["scores"].mean()),
        "critic/rewards/mean": float(batch["token_level_rewards"].sum(-1).mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_ratio": finish.count("length") / max(len(finish), 1),
        "reward/errors": float(errors),
    }


@contextmanager
def _timer(timing: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start
