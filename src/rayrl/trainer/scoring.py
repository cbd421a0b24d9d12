"""Scoring a step's rows on the reward workers: which worker scores which rows, and the
run's reward error budget.

The reward group has `reward.workers_per_node` workers on every node of the training
pool (`rayrl.trainer.resources.reward_pool_spec`). `reward_rows` splits the rows of a
call over them the way the training ranks hold them (the actor's `train` data layout,
which its log-prob and update calls follow): the rows of the ranks on node k go to the
reward workers on node k, evenly among them (`rayrl.controller.locality`). Today the
driver still carries the batch; once rows stay with the workers that hold them, each
node's rows are scored without leaving it. Where a replaced worker runs on another
node the split is even instead. Either way each row is scored once, by a function of
that row alone, and the results come back in row order: the scores, errors, extras and
metrics are those of a single reward worker.

`RewardErrors` keeps the run's `ErrorTally` (`reward.max_error_rate`, over every
sample scored so far, validation included): no reward worker sees all of a step's
rows. It is a driver part (`Stateful`): a replayed step counts its samples once, and a
checkpoint keeps the count.
"""

from __future__ import annotations

from typing import Any

from rayrl.batch import Batch
from rayrl.config.schema import RayRLConfig
from rayrl.controller import WorkerGroup
from rayrl.controller.dispatch import Chunks
from rayrl.controller.locality import even_rows, part_nodes, rows_by_node, split_rows
from rayrl.rewards.budget import ErrorTally
from rayrl.trainer.protocols import RewardRole
from rayrl.workers.reward import error_policy, rewards_from_batch

TRAIN_LAYOUT = "train"


def reward_rows(batch: Batch, hybrid: WorkerGroup, reward: RewardRole) -> Batch | Chunks:
    """`batch` as the argument of the reward group's `compute_score`: split by node when
    the reward has workers of its own (`reward` a WorkerGroup of several ranks), else
    as it is (one worker, or the reward in the actor's process)."""
    if not isinstance(reward, WorkerGroup) or reward.world_size == 1:
        return batch
    targets = [bundle.node_id for bundle in reward.bundles]
    sizes = rows_by_node(len(batch), part_nodes(hybrid, TRAIN_LAYOUT), targets)
    return split_rows(batch, sizes if sizes is not None else even_rows(len(batch), len(targets)))


class RewardErrors:
    """The run's reward error budget: `check` counts a scored batch's rows and raises
    `RewardErrorRateError` (naming the reward, the counts and the first failures) once
    more than the config's rate of all samples scored so far have failed."""

    def __init__(self, cfg: RayRLConfig) -> None:
        self.tally = ErrorTally(*error_policy(cfg))

    def check(self, batch: Batch, decode: Any) -> None:
        """Count `batch`'s samples (its responses with their scores' columns); `decode`
        (a tokenizer's `batch_decode`) renders the failed responses the error quotes."""
        self.tally.note(rewards_from_batch(batch), lambda i: _item(batch, i, decode))
        self.tally.check()

    def state_dict(self) -> dict[str, Any]:
        return self.tally.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tally.load_state_dict(state)


def _item(batch: Batch, row: int, decode: Any) -> dict[str, Any]:
    """Row `row` as the reward saw it: data source, ground truth and response text."""
    mask = batch["response_mask"][row].bool()
    [text] = decode([batch["responses"][row][mask].tolist()], skip_special_tokens=True)
    return {
        "data_source": batch["data_source"][row],
        "ground_truth": batch["ground_truth"][row],
        "solution_str": text,
    }


# The reward's columns of a scored batch (`rayrl.workers.reward.scores_to_batch`).
SCORE_COLUMNS = (
    "token_level_scores",
    "scores",
    "reward_elapsed_s",
    "reward_error",
    "reward_extra",
)


def score_columns(scores: Batch) -> Batch:
    """The reward's columns of a scored batch (`SCORE_COLUMNS`)."""
    return scores.select(*SCORE_COLUMNS)
