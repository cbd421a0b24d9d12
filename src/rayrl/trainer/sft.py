"""Supervised fine-tuning on the controller: reserve, start the SFT ranks, then step.

`SFTTrainer` is `rayrl sft`: one pool of `nnodes x n_gpus_per_node` bundles holds one
`SFTWorker` per rank (FSDP2 over them, gloo on CPU, NCCL on GPU). Each step sends a
batch of `data.train_batch_size` (prompt, response) pairs, split over the ranks, for
one optimizer step on the response tokens' negative log-likelihood. Around the steps
it keeps what `rayrl train` keeps (`trainer.run_dir`): the resolved config,
metrics.jsonl and the trackers, atomic checkpoints with resume (`trainer.resume_mode`),
the validation loss (`val/loss`, every `trainer.test_freq` steps and at the end), and
at the end `hf/`, a model directory that `rayrl train
actor_rollout_ref.model.path=OUTPUT_DIR/hf` starts from. Metric names are verl's
(`train/loss`, `train/lr`, `val/loss`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rayrl.batch import Batch
from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import ResourcePool, reserve_pools
from rayrl.cluster.spec import PoolSpec
from rayrl.config.load import to_yaml
from rayrl.config.sft import SFTConfig
from rayrl.controller import WorkerGroup
from rayrl.trainer.checkpoint import (
    CheckpointManager,
    TrainerState,
    driver_rng,
    load_state,
    restore_driver_rng,
)
from rayrl.trainer.epochs import epoch_batches, position_after, total_steps
from rayrl.trainer.model_dir import model_dir
from rayrl.trainer.names import check_sft_names
from rayrl.trainer.ray_session import RaySession, check_debugger, connect, debug_env
from rayrl.trainer.resources import resolve_device
from rayrl.trainer.run_dir import RunDir
from rayrl.trainer.tracking import Tracking, check_trackers
from rayrl.workers.sft import SFTWorker

# Collectives time out after this (verl's `nccl_timeout` default; `rayrl sft`, like
# verl's SFT trainer, has no key for it), not torch's 30 minutes.
PG_TIMEOUT_S = 600.0


def sft_pool(cfg: SFTConfig, device: str) -> PoolSpec:
    """One bundle per rank: `n_gpus_per_node` on each of `nnodes` nodes."""
    res = cfg.resources
    bundle = {"CPU": float(res.cpus_per_worker), **({"GPU": 1.0} if device == "cuda" else {})}
    return PoolSpec(
        name="sft",
        per_node=[cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes,
        bundle=bundle,
        strategy="STRICT_PACK",
        capacity_factor=res.capacity_factor,
        loader_workers=res.loader_workers,
    )


class SFTTrainer:
    """Runs supervised fine-tuning for one `SFTConfig`; `print_fn` gets its messages."""

    def __init__(self, cfg: SFTConfig, print_fn: Callable[[str], None] = print) -> None:
        check_sft_names(cfg)
        self.cfg, self.print = cfg, print_fn
        t = cfg.trainer
        self.run = f"{t.experiment_name}-sft-{uuid.uuid4().hex[:6]}"
        self.run_dir = RunDir(Path(t.output_dir))
        self.model_path = model_dir(cfg.model.partial_pretrain, t.output_dir, t.seed)
        self.checkpoints = CheckpointManager(self.run_dir.checkpoints, t.max_ckpt_to_keep)
        self.state = TrainerState()
        self.pools: list[ResourcePool] = []
        self.group: WorkerGroup | None = None
        self.kv: KVStore | None = None
        self.session: RaySession | None = None

    # ------------------------------------------------------------------ setup
    def load_data(self) -> None:
        """Tokenizer and the (prompt, response) pairs, before anything is reserved."""
        from transformers import AutoTokenizer

        from rayrl.trainer.sft_data import load_sft_datasets

        self.tokenizer = AutoTokenizer.from_pretrained(
            self.model_path, trust_remote_code=self.cfg.model.trust_remote_code
        )
        self.dataset, self.val_dataset = load_sft_datasets(self.cfg, self.tokenizer)

    def setup(self) -> SFTTrainer:
        """Check trackers and data, start or join Ray, reserve the pool, start the ranks."""
        cfg, res = self.cfg, self.cfg.resources
        check_trackers(cfg.trainer.logger)
        check_debugger(cfg)
        self.run_dir.prepare(to_yaml(cfg))
        self.load_data()
        self.session = connect(cfg)
        if self.session.dashboard_url:
            self.print(f"Ray dashboard: {self.session.dashboard_url}")
        import ray

        device = resolve_device(cfg, ray.cluster_resources().get("GPU", 0))
        self.kv = KVStore.create(self.run)
        self.pools = reserve_pools([sft_pool(cfg, device)], self.run, res.wait_timeout_s)
        env = debug_env(cfg)
        self.group = WorkerGroup(
            SFTWorker,
            self.pools[0].bundles,
            role="sft",
            run=self.run,
            kv=self.kv,
            pool=self.pools[0],
            runtime_env={"env_vars": env} if env else None,
        )
        self.group.create(timeout_s=res.create_timeout_s)
        self.group.init(
            timeout_s=res.init_timeout_s,
            retries=res.init_retries,
            config=cfg,
            model_path=self.model_path,
            total_steps=self.total_steps(),
            backend=("nccl" if device == "cuda" else "gloo") if self.group.world_size > 1 else None,
            pg_timeout_s=PG_TIMEOUT_S,
        )
        self.run_dir.write_workers([self.group], self.session.log_dir)
        nodes = ", ".join(str(i.get("node_id") or "?")[:8] for i in self.group.infos)
        self.print(f"sft: {self.group.world_size} worker(s) on node(s) {nodes}")
        return self

    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.cfg.data.train_batch_size

    def total_steps(self) -> int:
        """`trainer.total_training_steps`, or whole batches of the loaded dataset x epochs."""
        return total_steps(self.cfg.trainer, len(self.dataset), self.cfg.data.train_batch_size)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        for pool in self.pools:
            pool.teardown()
        if self.kv is not None:
            self.kv.shutdown()

    # ------------------------------------------------------- checkpoint/resume
    def save_checkpoint(self) -> Path:
        state = replace(self.state, rng=driver_rng())
        return self.checkpoints.save(state, lambda tmp: self.group.save(str(tmp)))

    def resume(self) -> Path | None:
        """Apply `trainer.resume_mode`; metrics.jsonl keeps the rows up to the resumed step."""
        t = self.cfg.trainer
        path = self.checkpoints.resolve(t.resume_mode, t.resume_from_path)
        if path is None:
            self.state = TrainerState()
            self.run_dir.metrics.unlink(missing_ok=True)
            return None
        self.group.load(str(path))
        self.state = load_state(path)
        restore_driver_rng(self.state.rng)
        self.run_dir.keep_metrics_until(self.state.global_step)
        self.print(f"resumed from {path} ({self.state.describe()})")
        return path

    # ------------------------------------------------------------------- loop
    def fit(self, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
        """Resume, train to the end with validation, checkpoints and tracking, export."""
        t, d = self.cfg.trainer, self.cfg.data
        self.resume()
        total, history = self.total_steps(), []
        tracking = Tracking(
            t.logger,
            self.run_dir.root,
            project=t.project_name,
            experiment=t.experiment_name,
            config=_config_dict(self.cfg),
            print_fn=self.print,
        )
        epochs = None if t.total_training_steps is not None else t.total_epochs
        try:
            if self.state.global_step >= total:
                self.print(
                    f"nothing to train: the checkpoint is at step {self.state.global_step} of "
                    f"{total}; set trainer.resume_mode=disable or another trainer.output_dir"
                )
            batches = epoch_batches(
                self.dataset,
                d.train_batch_size,
                start=self.state,
                total=total,
                epochs=epochs,
                seed=t.seed,
                shuffle=d.shuffle,
            )
            for step, batch in batches:
                metrics = self.step(batch)
                self.state = position_after(self.state, batch, self.steps_per_epoch())
                metrics.update(self._after_step(batch, total))
                tracking.log(metrics, step=self.state.global_step)
                history.append(metrics)
                if on_step:
                    on_step(step, metrics)
            if t.export_hf:
                self.group.export_hf(str(self.run_dir.hf))
        finally:
            tracking.finish()
        return history

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on a batch; its metrics."""
        start = time.perf_counter()
        metrics = self.group.train_batch(batch)
        seconds = time.perf_counter() - start
        tokens = float(batch["attention_mask"].sum())
        metrics.update(
            {
                "timing_s/step": seconds,
                "perf/total_num_tokens": tokens,
                "perf/throughput": tokens / (seconds * self.group.world_size),  # per GPU, as verl
            }
        )
        return metrics

    def _after_step(self, batch: Batch, total: int) -> dict[str, float]:
        t, done = self.cfg.trainer, self.state.global_step
        metrics = {"training/global_step": done, "training/epoch": batch.meta["epoch"]}
        last = done == total
        if self.val_dataset is not None and (last or (t.test_freq > 0 and done % t.test_freq == 0)):
            metrics["val/loss"] = self.validation_loss()
        if last or (t.save_freq > 0 and done % t.save_freq == 0):
            self.save_checkpoint()
        return metrics

    def validation_loss(self) -> float:
        """Token-mean negative log-likelihood of the validation responses."""
        nll = tokens = 0.0
        size = self.cfg.data.train_batch_size
        for start in range(0, len(self.val_dataset), size):
            rows = list(range(start, min(start + size, len(self.val_dataset))))
            out = self.group.nll(self.val_dataset.collate(rows))
            nll += float(out["nll"].sum())
            tokens += float(out["tokens"].sum())
        return nll / max(tokens, 1.0)


def _config_dict(cfg: SFTConfig) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))
