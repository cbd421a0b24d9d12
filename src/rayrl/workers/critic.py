"""Critic: a value head on the training engine; computes values and learns them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rayrl.batch import Batch
from rayrl.config.schema import RayRLConfig
from rayrl.controller import DP_SPLIT, ONE_TO_ALL, Worker, register
from rayrl.train.outputs import MODEL_INPUTS
from rayrl.workers.common import (
    engine_kwargs,
    epoch_rows,
    load_rng,
    mean_metrics,
    optim_spec,
    per_rank_mini_batch,
    save_rng,
)
from rayrl.workers.context import StepContext
from rayrl.workers.losses import critic_loss_fn

# The columns of the step's batch each method reads; the trainer sends no others
# (`rayrl.trainer.stages.only_reads`).
VALUES_READS = MODEL_INPUTS
UPDATE_CRITIC_READS = (*MODEL_INPUTS, "values", "returns")


class CriticWorker(Worker):
    """Per-token values of the responses (`values`) and clipped value-loss updates."""

    def init_worker(
        self, config: RayRLConfig, model_path: str, *, total_steps: int | None = None
    ) -> None:
        from rayrl.train.engine import TrainEngine  # in the worker only

        self.cfg = config
        c = config.critic
        kwargs = engine_kwargs(
            c.model, c.model.fsdp_config, config.trainer.seed, sp=c.ulysses_sequence_parallel_size
        )
        kwargs["tokenizer_path"] = c.model.tokenizer_path or model_path
        self.engine = TrainEngine(
            c.model.path or model_path,
            value_head=True,
            optim=optim_spec(c.optim, total_steps),
            total_steps=total_steps,
            join=self.joining,  # a replacement: its state comes from the snapshot restore
            **kwargs,
        )
        self.loss_fn = critic_loss_fn(c, config.data.max_response_length)

    def snapshot_state(self) -> dict[str, Any]:
        """The critic's state at a step boundary (copied out before the next)."""
        return {"critic": self.engine.snapshot(reuse=True, wait=False)}

    def snapshot_nbytes(self) -> int:
        return self.engine.snapshot_nbytes()

    def restore_state(self, state: dict[str, Any]) -> None:
        self.engine.restore(state["critic"])

    def rebuild(self) -> None:
        """Sharded anew on the re-formed process group, on the weights this rank holds."""
        self.engine.rebuild()

    @register(dispatch=ONE_TO_ALL)
    def data_parts(self) -> dict[str, int]:
        """This rank's part of the `critic` data layout (`controller.layout`): the ranks of
        a sequence-parallel group share the rows."""
        return {"critic": self.engine.dp_rank}

    @register(dispatch=DP_SPLIT, layout="critic")
    def compute_values(self, batch: Batch) -> Batch:
        c = self.cfg.critic
        if c.use_dynamic_bsz:
            out = self.engine.forward(
                batch, max_tokens_per_micro_batch=c.forward_max_token_len_per_gpu
            )
        else:
            out = self.engine.forward(batch, micro_batch_size=c.forward_micro_batch_size_per_gpu)
        return Batch({"values": out["values"]})

    @register(dispatch=DP_SPLIT, collect=mean_metrics, layout="critic")
    def update_critic(self, batch: Batch, ctx: StepContext) -> dict[str, float]:
        """`ppo_epochs` passes over mini-batches of `ppo_mini_batch_size` x n samples of
        the clipped value loss; metrics averaged over mini-batches and epochs."""
        c, n = self.cfg.critic, self.cfg.actor_rollout_ref.rollout.n
        mini = per_rank_mini_batch(c.ppo_mini_batch_size * n, self.engine.dp_size, len(batch))
        metrics = [
            self.engine.train_step(
                epoch_rows(batch, ctx.step, epoch, c.shuffle, self.cfg.trainer.seed, self.rank),
                self.loss_fn,
                mini_batch_size=mini,
                micro_batch_size=None if c.use_dynamic_bsz else c.ppo_micro_batch_size_per_gpu,
                max_tokens_per_micro_batch=c.ppo_max_token_len_per_gpu
                if c.use_dynamic_bsz
                else None,
                step_lr=epoch == c.ppo_epochs - 1,
            )
            for epoch in range(c.ppo_epochs)
        ]
        out = mean_metrics(metrics, None)
        return {k if "/" in k else f"critic/{k}": v for k, v in out.items()}

    @register(dispatch=ONE_TO_ALL)
    def save(self, path: str) -> None:
        """Sharded critic checkpoint under `path/critic` (model, optimizer, LR, RNGs)."""
        self.engine.save(Path(path) / "critic")
        save_rng(Path(path) / "critic", self.rank)

    @register(dispatch=ONE_TO_ALL)
    def load(self, path: str) -> None:
        self.engine.load(Path(path) / "critic")
        load_rng(Path(path) / "critic", self.rank)
