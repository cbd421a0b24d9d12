"""Reference: the frozen initial policy on its own workers (the standalone layout).

Colocated runs keep the reference inside ActorRolloutRef; this worker serves runs
that place it on separate resources. No optimizer, no gradients. A mixture-of-experts
reference splits its experts over ``actor_rollout_ref.ref.expert_parallel_size`` ranks
(the actor's size unless set), as the actor does.
"""

from __future__ import annotations

from rayrl.batch import Batch
from rayrl.config.schema import RayRLConfig
from rayrl.controller import DP_SPLIT, ONE_TO_ALL, Worker, register
from rayrl.train.outputs import IMAGE_COLUMN, MODEL_INPUTS
from rayrl.workers.common import forward_sizes, logprob_temperature, ref_engine_kwargs

# The columns of the step's batch `compute_ref_log_prob` reads: the model's inputs and
# the rows' images where prompts have them (as the actor's own reference pass reads).
REF_LOG_PROB_READS = (*MODEL_INPUTS, IMAGE_COLUMN)


class ReferenceWorker(Worker):
    """Reference log-probs (`ref_log_prob`) of sampled responses."""

    def init_worker(self, config: RayRLConfig, model_path: str) -> None:
        from rayrl.train.engine import TrainEngine  # in the worker only

        self.cfg = config
        arr = config.actor_rollout_ref
        self.engine = TrainEngine(
            model_path,
            trainable=False,
            join=self.joining,  # a replacement: its own shards, read alone
            **ref_engine_kwargs(arr, config.trainer.seed),
        )

    def rebuild(self) -> None:
        """The frozen weights sharded anew, from the shards this rank holds (nothing to
        restore, nothing read)."""
        self.engine.rebuild()

    @register(dispatch=ONE_TO_ALL)
    def data_parts(self) -> dict[str, int]:
        """This rank's part of the `ref` data layout (`controller.layout`)."""
        return {"ref": self.engine.dp_rank}

    @register(dispatch=DP_SPLIT, layout="ref")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        arr = self.cfg.actor_rollout_ref
        out = self.engine.forward(
            batch, temperature=logprob_temperature(arr.rollout), **forward_sizes(arr.ref)
        )
        return Batch({"ref_log_prob": out["log_probs"]})
