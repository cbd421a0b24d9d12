"""The SFT role: one training engine per rank that fits a model to (prompt, response)
pairs, with the checkpoints and HF export of an RL actor.

Each rank holds a `TrainEngine` (FSDP2 over the group's process group, packing with
`use_remove_padding`, Ulysses sequence parallelism with `ulysses_sequence_parallel_size`
(the ranks of one sequence-parallel group take the same rows), micro-batches or a token
budget, LoRA with `model.lora_rank`).
`train_batch` is one optimizer step on the rank's share of a batch, with the loss of
`rayrl.workers.losses.sft_loss_fn`; `nll` gives per-row sums for the validation loss.
Checkpoints go under `<step dir>/actor`, the layout `rayrl train` and `rayrl export`
read, so a fine-tuned model is an actor's starting point.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, TypedDict

import torch

from rayrl.batch import Batch
from rayrl.config.pref import PrefConfig
from rayrl.config.sft import SFTConfig
from rayrl.controller import DP_SPLIT, ONE_TO_ALL, Worker, register
from rayrl.train.lora import LoraSpec
from rayrl.workers.common import (
    DTYPE_NAMES,
    load_rng,
    mean_metrics,
    optim_spec,
    save_rng,
    update_perf_metrics,
)
from rayrl.workers.losses import sft_loss_fn


def sft_engine_kwargs(cfg: SFTConfig | PrefConfig) -> dict[str, Any]:
    """TrainEngine arguments from the model group; verl's `cpu_offload` with
    `offload_params` keeps weights and optimizer state in host memory between uses."""
    m, fsdp = cfg.model, cfg.model.fsdp_config
    offload = fsdp.cpu_offload and fsdp.offload_params
    return {
        "dtype": DTYPE_NAMES.get(fsdp.model_dtype, fsdp.model_dtype),
        "mixed_precision": DTYPE_NAMES.get(fsdp.dtype, fsdp.dtype) == "bfloat16",
        "param_offload": offload,
        "optimizer_offload": offload,
        "fsdp_size": fsdp.fsdp_size,
        "attn_implementation": m.attn_implementation,
        "gradient_checkpointing": m.enable_gradient_checkpointing,
        "use_remove_padding": cfg.use_remove_padding,
        "ulysses_sequence_parallel_size": cfg.ulysses_sequence_parallel_size,
        "seed": cfg.trainer.seed,
        "trust_remote_code": m.trust_remote_code,
        "config_overrides": dict(m.override_config),
        "lora": LoraSpec.from_model_config(m),
    }


class MicroBatchSizes(TypedDict, total=False):
    """The engine's micro-batch keywords (`TrainEngine.forward`, ``train_step``)."""

    micro_batch_size: int | None
    max_tokens_per_micro_batch: int | None


class SFTWorker(Worker):
    """A rank of supervised fine-tuning."""

    def init_worker(self, config: SFTConfig, model_path: str, *, total_steps: int) -> None:
        """Build the engine; the group formed the process group (FSDP uses it) already."""
        self.cfg = config
        from rayrl.train.engine import TrainEngine  # in the worker only

        self.engine = TrainEngine(
            model_path,
            optim=optim_spec(config.optim, total_steps),
            total_steps=total_steps,
            **sft_engine_kwargs(config),
        )
        self.loss_fn = sft_loss_fn()

    def rebuild(self) -> None:
        """After the process group re-formed (an init retried): sharded anew."""
        self.engine.rebuild()

    def _sizes(self) -> MicroBatchSizes:
        d = self.cfg.data
        if d.use_dynamic_bsz:
            return {"max_tokens_per_micro_batch": d.max_token_len_per_gpu}
        return {"micro_batch_size": d.micro_batch_size_per_gpu}

    @register(dispatch=ONE_TO_ALL)
    def data_parts(self) -> dict[str, int]:
        """This rank's part of the rows (`controller.layout`): the ranks of a
        sequence-parallel group share theirs."""
        return {"train": self.engine.dp_rank}

    @register(dispatch=DP_SPLIT, collect=mean_metrics, layout="train")
    def train_batch(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on this rank's rows; `train/loss` is the batch's token-mean
        negative log-likelihood of the responses (all ranks), `train/lr` the LR used."""
        if self.engine.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.engine.device)
        start = time.perf_counter()
        batch = self.before_train(batch)
        out = self.engine.train_step(batch, self.loss_fn, **self._sizes())
        perf = update_perf_metrics(
            out.pop("flops"), time.perf_counter() - start, self.engine.device
        )
        keys = ("loss", "grad_norm", "lr", "skipped_steps", *self.loss_metrics)
        metrics = {f"train/{k}": out[k] for k in keys}
        metrics.update({f"perf/{k}": v for k, v in perf.items()})
        return metrics

    loss_metrics: tuple[str, ...] = ()  # the loss function's metrics (train/ prefixed)

    def before_train(self, batch: Batch) -> Batch:
        """What a step adds to its rows before the engine trains on them (nothing here;
        `rayrl dpo`'s reference log-probs in `PrefWorker`)."""
        return batch

    @register(dispatch=DP_SPLIT, layout="train")
    def nll(self, batch: Batch) -> Batch:
        """Per row: the summed negative log-likelihood of its response and its token count."""
        out = self.engine.forward(batch, **self._sizes())
        mask = batch["response_mask"].float()
        return Batch({"nll": -(out["log_probs"] * mask).sum(-1).double(), "tokens": mask.sum(-1)})

    @register(dispatch=ONE_TO_ALL)
    def save(self, path: str) -> None:
        """Sharded checkpoint under `path/actor` (model, optimizer, LR schedule, RNGs,
        and on rank 0 what an offline `rayrl export` needs)."""
        out = Path(path) / "actor"
        self.engine.save(out)
        save_rng(out, self.rank)
        if self.rank == 0:
            from rayrl.train.hf_export import write_hf_meta

            write_hf_meta(self.engine, out)

    @register(dispatch=ONE_TO_ALL)
    def load(self, path: str) -> None:
        out = Path(path) / "actor"
        self.engine.load(out)
        load_rng(out, self.rank)

    @register(dispatch=ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """An HF model directory at `path` in the training dtype, LoRA merged."""
        self.engine.export_hf(path, dtype=self.engine.training_dtype)
