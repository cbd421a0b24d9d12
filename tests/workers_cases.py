"""Shared pieces of the role-worker tests: a tiny model, configs, groups on real Ray."""

from __future__ import annotations

import uuid

import torch

from rayrl.batch import Batch
from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import PoolSpec, ResourcePool
from rayrl.config import load_config
from rayrl.controller import WorkerGroup
from rayrl.data import PromptDataset, synthetic_rows
from rayrl.workers.context import StepContext

BASE = [
    "data.train_batch_size=2",
    "data.max_response_length=6",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "critic.ppo_mini_batch_size=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "trainer.seed=7",
]


def config(*overrides: str):
    return load_config("grpo", [*BASE, *overrides])


def local_worker(worker_cls, **init):
    """A worker of one rank in this process (no Ray): the real class and methods."""
    from rayrl.controller.worker import WorkerContext

    worker = worker_cls()
    worker.ctx = WorkerContext(group="local", role="local", rank=0, world_size=1)
    worker.init_worker(**init)
    return worker


def group_on(worker_cls, ranks: int, role: str, cpus: float = 0.5):
    """A created WorkerGroup on a fresh pool of `ranks` bundles, with its KV store."""
    run = f"{role}-{uuid.uuid4().hex[:6]}"
    pool = ResourcePool(PoolSpec(role, per_node=[ranks], bundle={"CPU": cpus}), run)
    pool.bootstrap(timeout_s=60)
    kv = KVStore.create(run)
    group = WorkerGroup(worker_cls, pool.bundles, role=role, run=run, kv=kv, pool=pool)
    group.create(timeout_s=180)
    return group, pool, kv


def close(group, pool, kv) -> None:
    group.shutdown()
    pool.teardown()
    kv.shutdown()


def prompts(tokenizer, n: int, step: int = 0) -> Batch:
    ds = PromptDataset(synthetic_rows(size=n, seed=1), tokenizer, max_prompt_length=64)
    batch = ds.collate(list(range(n)))
    batch.meta.update(step=step)
    return batch


def generate(group, batch: Batch, sampling: str = "train") -> Batch:
    """A group's (or worker's) samples of `batch` at its meta step, as `sampling` says."""
    ctx = StepContext(step=int(batch.meta.get("step", 0)), sampling=sampling)
    return group.generate(batch, ctx).batch


def update_actor(group, batch: Batch, step: int = 0, on_policy: bool = False) -> dict:
    return group.update_actor(batch, StepContext(step=step, on_policy=on_policy))


def update_critic(group, batch: Batch, step: int = 0) -> dict:
    return group.update_critic(batch, StepContext(step=step))


def forced_batch(prompt_batch: Batch, token: int, length: int) -> Batch:
    """Prompts followed by `length` copies of `token`, every response token real."""
    n, p = prompt_batch["input_ids"].shape
    responses = torch.full((n, length), token, dtype=torch.long)
    mask = torch.ones((n, length), dtype=torch.long)
    attention = torch.cat([prompt_batch["attention_mask"], mask], dim=1)
    return Batch.from_dict(
        {
            "input_ids": torch.cat([prompt_batch["input_ids"], responses], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": mask,
        }
    )
