"""The PPO/GRPO loop on the controller: reserve, place the roles, then step.

A step, as data flows (DESIGN.md): prompts -> actor.generate -> reward.compute_score
(concurrently with actor.compute_log_prob and, when a KL term needs it,
compute_ref_log_prob) -> critic.compute_values (GAE) -> advantages on the controller
(`rayrl.algos`) -> critic.update_critic -> actor.update_actor. Each stage is timed
(`timing_s/<stage>`); metrics use verl's names.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import ray

from rayrl.algos import apply_kl_penalty, compute_advantages, masked_mean
from rayrl.batch import Batch
from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import ResourcePool
from rayrl.config.schema import RayRLConfig
from rayrl.config.validate import critic_enabled, ref_enabled
from rayrl.controller import WorkerGroup, colocate
from rayrl.data import PromptDataset, read_parquet, synthetic_rows
from rayrl.trainer.names import check_names
from rayrl.trainer.resources import pools_from_config, resolve_device
from rayrl.workers import ActorRolloutRefWorker, CriticWorker, RewardWorker


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
        self.pools: list[ResourcePool] = []
        self.groups: list[WorkerGroup] = []
        self.kv: KVStore | None = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> PPOTrainer:
        """Reserve the pools (bounded waits, clear errors) and initialise every role."""
        cfg, res = self.cfg, self.cfg.resources
        self.load_data()
        if not ray.is_initialized():
            ray.init(address=res.address or "local", include_dashboard=False, log_to_driver=False)
        device = resolve_device(cfg, ray.cluster_resources().get("GPU", 0))
        self.kv = KVStore.create(self.run)
        for spec in pools_from_config(cfg, device):
            pool = ResourcePool(spec, self.run)
            self.pools.append(pool)
            pool.bootstrap(timeout_s=res.wait_timeout_s)
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
        """Tokenizer and prompt dataset, before any resource is reserved."""
        from transformers import AutoTokenizer

        model = self.cfg.actor_rollout_ref.model
        self.tokenizer = AutoTokenizer.from_pretrained(
            model.tokenizer_path or self.model_path, trust_remote_code=model.trust_remote_code
        )
        self.dataset = self._dataset()
        return self.dataset

    def _dataset(self) -> PromptDataset:
        d = self.cfg.data
        rows = (
            read_parquet(d.train_files) if d.train_files
            else synthetic_rows(d.synthetic_task, d.synthetic_size, self.cfg.trainer.seed)
        )  # fmt: skip
        return PromptDataset(
            rows, self.tokenizer, max_prompt_length=d.max_prompt_length,
            truncation=d.truncation, filter_overlong=d.filter_overlong_prompts,
            prompt_key=d.prompt_key,
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
        with _timer(timing, "step"):
            with _timer(timing, "gen"):
                batch = self.actor.generate(prompts)
            reward_future = self.reward.compute_score(batch, blocking=False)
            with _timer(timing, "old_log_prob"):
                batch = batch.union(self.actor.compute_log_prob(batch).select("old_log_probs"))
            if self.use_ref:
                with _timer(timing, "ref"):
                    batch = batch.union(self.actor.compute_ref_log_prob(batch))
            if self.critic is not None:
                with _timer(timing, "values"):
                    batch = batch.union(self.critic.compute_values(batch))
            with _timer(timing, "reward"):
                scores = reward_future.get()
            batch = batch.union(scores.select("token_level_scores", "scores"))
            with _timer(timing, "adv"):
                metrics = self._advantages(batch)
            if self.critic is not None:
                with _timer(timing, "update_critic"):
                    metrics.update(self.critic.update_critic(batch))
            if self._actor_learns(prompts):
                with _timer(timing, "update_actor"):
                    metrics.update(self.actor.update_actor(batch))
        metrics.update(_batch_metrics(batch, scores))
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        tokens = float(batch["attention_mask"].sum())
        metrics["perf/throughput"] = tokens / timing["step"]
        return metrics

    def _actor_learns(self, prompts: Batch) -> bool:
        """False during the critic's warm-up (`trainer.critic_warmup` first steps)."""
        return int(prompts.meta.get("step", 0)) >= self.cfg.trainer.critic_warmup

    def _advantages(self, batch: Batch) -> dict[str, float]:
        alg, mask = self.cfg.algorithm, batch["response_mask"]
        rewards, metrics = batch["token_level_scores"], {}
        if alg.use_kl_in_reward:
            rewards, kl = apply_kl_penalty(
                rewards, batch["old_log_probs"], batch["ref_log_prob"], mask,
                alg.kl_ctrl.kl_coef, estimator=alg.kl_penalty,
            )  # fmt: skip
            metrics.update({f"actor/{k}": float(v) for k, v in kl.items()})
        adv, returns = compute_advantages(
            alg.adv_estimator, token_level_rewards=rewards, response_mask=mask,
            index=batch["uid"], values=batch.tensors.get("values"), gamma=alg.gamma,
            lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        )  # fmt: skip
        batch["token_level_rewards"], batch["advantages"], batch["returns"] = rewards, adv, returns
        metrics["critic/advantages/mean"] = float(masked_mean(adv, mask))
        metrics["critic/returns/mean"] = float(masked_mean(returns, mask))
        return metrics


def _batch_metrics(batch: Batch, scores: Batch) -> dict[str, float]:
    lengths = batch["response_mask"].sum(-1).float()
    errors = sum(e is not None for e in scores["reward_error"])
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
