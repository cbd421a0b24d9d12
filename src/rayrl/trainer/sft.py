"""Supervised fine-tuning: the `Trainer` of `rayrl sft` (its pool, its ranks, its step).

`SFTTrainer` is `rayrl sft`: one pool of `nnodes x n_gpus_per_node` bundles holds one
`SFTWorker` per rank (FSDP2 over them, gloo on CPU, NCCL on GPU). Each step sends a
batch of `data.train_batch_size` (prompt, response) pairs, split over the ranks, for
one optimizer step on the response tokens' negative log-likelihood (a vision-language
model's rows may hold images: read with its image processor, spliced into the prompts'
image tokens in the engine's forward, as for `rayrl train`). Around the steps
`rayrl.trainer.run.Run` keeps what it keeps for `rayrl train` (`trainer.run_dir`): the
resolved config, metrics.jsonl and the trackers, atomic checkpoints with resume
(`trainer.resume_mode`), the validation loss (`val/loss`, every `trainer.test_freq`
steps and at the end), and at the end `hf/`, a model directory that `rayrl train
actor_rollout_ref.model.path=OUTPUT_DIR/hf` starts from. Metric names are verl's
(`train/loss`, `train/lr`, `val/loss`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from rayrl.batch import Batch
from rayrl.cluster.pool import ResourcePool
from rayrl.cluster.spec import PoolSpec
from rayrl.config.errors import ConfigError
from rayrl.config.sft import SFTConfig
from rayrl.controller import WorkerGroup
from rayrl.models.loading import load_tokenizer
from rayrl.trainer.contract import TrainData
from rayrl.trainer.manifest import data_identity, model_identity
from rayrl.trainer.model_dir import model_dir
from rayrl.trainer.names import check_sft_names
from rayrl.trainer.protocols import SFTRole
from rayrl.trainer.resources import cluster_node_cpus, cpus_per_worker
from rayrl.trainer.roles import GroupEnv, new_group, set_data_layouts
from rayrl.trainer.stage_calls import StageCalls
from rayrl.trainer.state import Stateful
from rayrl.workers.sft import SFTWorker

__all__ = ["PG_TIMEOUT_S", "SFTTrainer", "sft_pool"]

# Collectives time out after this (verl's `nccl_timeout` default; `rayrl sft`, like
# verl's SFT trainer, has no key for it), not torch's 30 minutes.
PG_TIMEOUT_S = 600.0


def sft_pool(cfg: SFTConfig, device: str, node_cpu_count: float | None = None) -> PoolSpec:
    """One bundle per rank: `n_gpus_per_node` on each of `nnodes` nodes."""
    res = cfg.resources
    cpus = cpus_per_worker(cfg, device, node_cpu_count)
    bundle = {"CPU": cpus, **({"GPU": 1.0} if device == "cuda" else {})}
    return PoolSpec(
        name="sft",
        per_node=[cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes,
        bundle=bundle,
        strategy="STRICT_PACK",
        capacity_factor=res.capacity_factor,
        loader_workers=res.loader_workers,
    )


class SFTTrainer:
    """Supervised fine-tuning for one `SFTConfig`: a `Trainer` (`rayrl.trainer.contract`)
    that `Run` drives; `print_fn` gets its messages."""

    kind = "sft"
    role = "sft"  # the worker group's name
    worker_cls: type = SFTWorker  # each rank's worker
    data_needs_ray = False
    pg_timeout_s = PG_TIMEOUT_S
    validate_at_end = True  # the validation loss after the last step, whatever test_freq

    def __init__(
        self, cfg: SFTConfig, print_fn: Callable[[str], None] = print, *, check: bool = True
    ) -> None:
        if check:  # a subclass with a config of its own checks its names itself
            check_sft_names(cfg)
        self.cfg, self.print = cfg, print_fn
        t = cfg.trainer
        self.model_path = model_dir(cfg.model.partial_pretrain, t.output_dir, t.seed)
        self.data: TrainData | None = None
        self.group: WorkerGroup | None = None

    @property
    def max_ckpt_to_keep(self) -> int | None:
        return self.cfg.trainer.max_ckpt_to_keep

    def preflight(self) -> None:
        """Nothing beyond `load_data`: its tokenizer's load checks the model path."""

    def load_data(self) -> TrainData:
        """Tokenizer and the (prompt, response) pairs, before anything is reserved."""
        from rayrl.trainer.sft_data import load_sft_datasets

        tokenizer = load_tokenizer(
            self.model_path,
            key="model.partial_pretrain",
            trust_remote_code=self.cfg.model.trust_remote_code,
        )
        train, val = load_sft_datasets(self.cfg, tokenizer, self._vision(tokenizer))
        d = self.cfg.data
        self.data = TrainData(train, d.train_batch_size, d.shuffle, val)
        return self.data

    def _vision(self, tokenizer: Any) -> Any:
        """The image processor of a vision-language model (None for a text-only one);
        a ConfigError for what its images cannot run with."""
        from rayrl.trainer.data import model_vision_processor

        d = self.cfg.data
        key = "model.partial_pretrain"
        vision = model_vision_processor(self.model_path, tokenizer, d.mm_processor_kwargs, key)
        if vision is not None and self.cfg.ulysses_sequence_parallel_size > 1:
            raise ConfigError(
                f"{key}={self.model_path} is a vision-language model, and Ulysses sequence "
                "parallelism with images is not built yet (its images would be split between "
                "ranks); set ulysses_sequence_parallel_size=1"
            )
        return vision

    def pool_specs(self, device: str) -> list[PoolSpec]:
        return [sft_pool(self.cfg, device, cluster_node_cpus(device))]

    def start(
        self, pools: list[ResourcePool], env: GroupEnv, device: str, total_steps: int
    ) -> list[WorkerGroup]:
        """One `worker_cls` per rank, FSDP2 over them."""
        res = self.cfg.resources
        init: dict[str, Any] = {
            "config": self.cfg,
            "model_path": self.model_path,
            "total_steps": total_steps,
        }
        role = self.role
        group, init = new_group({role: (self.worker_cls, init)}, pools[0], role, env)
        group.create(timeout_s=res.create_timeout_s)
        backend = "nccl" if device == "cuda" else "gloo"
        if group.world_size > 1:
            init["backend"] = backend
        group.init(timeout_s=res.init_timeout_s, retries=res.init_retries, **init)
        set_data_layouts(group, [cast(SFTRole, group)])  # sequence-parallel ranks share their rows
        self.group = group
        return [group]

    def stateful_groups(self) -> list[WorkerGroup]:
        return []  # `rayrl sft` has no step replay: a lost rank ends the run (resume it)

    def parts(self) -> dict[str, Stateful]:
        return {}

    def fingerprint(self) -> dict[str, Any]:
        d = self.cfg.data
        return {
            "model": model_identity(self.model_path),
            "train_files": data_identity(d.train_files) or f"synthetic:{d.synthetic_task}",
            "data.train_batch_size": d.train_batch_size,
            "model.lora_rank": self.cfg.model.lora_rank,
        }

    def save(self, path: Path) -> None:
        self._group().save(str(path))

    def load(self, path: Path) -> None:
        self._group().load(str(path))

    def export(self, path: Path) -> None:
        self._group().export_hf(str(path))

    def _group(self) -> SFTRole:
        if self.group is None:
            raise RuntimeError("the SFT ranks are not started yet: call Run.setup() first")
        return cast(SFTRole, self.group)  # its methods are bound when it starts

    def step(self, batch: Batch, calls: StageCalls) -> tuple[dict[str, float], list[str]]:
        """One optimizer step on a batch; its metrics (no prompt ledger)."""
        group = self._group()
        start = time.perf_counter()
        metrics = calls.run("train", group.train_batch, batch, mutates=True)
        seconds = time.perf_counter() - start
        tokens = float(batch["attention_mask"].sum())
        metrics.update(
            {
                "timing_s/step": seconds,
                "perf/total_num_tokens": tokens,
                "perf/throughput": tokens / (seconds * group.world_size),  # per GPU, as verl
            }
        )
        return metrics, []

    def validate(self, step: int) -> dict[str, float]:
        """`val/loss`: the token-mean negative log-likelihood of the validation responses."""
        val = self.data.val if self.data is not None else None
        if val is None:
            raise RuntimeError("no validation data to validate on (data.val_files)")
        nll = tokens = 0.0
        size = self.cfg.data.train_batch_size
        for start in range(0, len(val), size):
            rows = list(range(start, min(start + size, len(val))))
            out = self._group().nll(val.collate(rows))
            nll += float(out["nll"].sum())
            tokens += float(out["tokens"].sum())
        return {"val/loss": nll / max(tokens, 1.0)}
