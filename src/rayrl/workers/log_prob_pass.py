"""The old-log-prob pass (`ActorRolloutRefWorker.compute_log_prob`): what it reads from
the step's batch and the columns it returns.

The pass runs the policy over the sampled responses once, without gradients, at the
log-prob temperature, and returns per response token:

- ``old_log_probs`` and ``entropy`` (the trainer reports ``actor/entropy`` from them,
  with ``entropy_sum`` per row);
- ``sum_pi_squared`` with ``actor.calculate_sum_pi_squared``: the sum over the
  vocabulary of the squared probabilities, which the optimal token baseline reads
  (`rayrl.algos.token_baseline`), as verl's pass returns it;
- the routing of a mixture of experts (`rayrl.workers.routing`), and, when the samples
  carry the rollout's log-probs, the per-row sums of the rollout-vs-actor probability
  gap (`rayrl.algos.probs_diff`).
"""

from __future__ import annotations

import torch

from rayrl.algos.probs_diff import probs_diff_rows
from rayrl.algos.routing import ROUTES
from rayrl.batch import Batch
from rayrl.train.outputs import IMAGE_COLUMN, MODEL_INPUTS
from rayrl.workers import routing as replay

__all__ = ["LOG_PROB_READS", "log_prob_columns"]

# The columns of the step's batch the pass reads: the model's inputs (and the rows'
# images, where prompts have them), and the rollout's log-probs and routing record when
# the samples have them, for the sums the pass returns beside its own. The trainer sends
# no others (`rayrl.trainer.stages.only_reads`).
LOG_PROB_READS = (*MODEL_INPUTS, IMAGE_COLUMN, "rollout_log_probs", ROUTES)


def log_prob_columns(batch: Batch, out: Batch) -> Batch:
    """The pass's result from the engine's outputs ``out`` over ``batch``'s rows."""
    mask = batch["response_mask"]
    entropy_sum = torch.where(mask.bool(), out["entropy"], 0.0).to(torch.float64).sum(-1)
    columns = {"old_log_probs": out["log_probs"], "entropy": out["entropy"]}
    columns["entropy_sum"] = entropy_sum
    if "sum_pi_squared" in out:
        columns["sum_pi_squared"] = out["sum_pi_squared"]
    columns.update(replay.routing_columns(out))
    if "rollout_log_probs" in batch:
        rollout = batch["rollout_log_probs"]
        columns.update(probs_diff_rows(rollout, out["log_probs"].to(rollout.device), mask))
    return Batch(columns)
