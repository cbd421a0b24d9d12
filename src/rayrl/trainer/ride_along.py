"""Stages that ride on the generate call: in a one-process run, the reference log-probs
and the reward's scores of the fresh samples are computed by the same worker call that
generated them.

When the actor is one rank and the reward scores in its process (`reward.colocate`),
the generate, scoring and reference calls all run in that one process, one after
another, whatever the controller does. Sending them as three calls only adds two round
trips and two trips of the step's batch through the object store and back (about a
tenth of a small CPU step). With meta `with_scores` / `with_ref` the worker's
`generate` scores the samples (the colocated reward role's own code) and computes the
reference log-probs (the reference engine's own forward) before it returns; the
columns are the ones the separate calls return, computed by the same code on the same
rows, and the step reports `timing_s/reward` and `timing_s/ref` as the worker measured
them (`timing_s/gen` without them).

Separate calls remain where they can overlap or need the controller in between:
several actor ranks (the batch is re-balanced across ranks after generation), the
reward in its own process (it scores while the reference runs), an HTTP reward (its
error budget stops a run from the reward stage), and dynamic sampling (it scores extra
rounds of prompts on its own).
"""

from __future__ import annotations

from rayrl.batch import Batch
from rayrl.config.schema import RayRLConfig
from rayrl.workers.actor import RIDING_STAGES, WITH_REF, WITH_SCORES


def riding_flags(
    cfg: RayRLConfig, actor_ranks: int, reward_in_actor: bool, use_ref: bool
) -> dict[str, bool]:
    """The meta flags to put on the prompts of a step's generate call (empty: none ride)."""
    if actor_ranks != 1:
        return {}
    flags = {}
    if reward_in_actor and not cfg.reward.http.url and not cfg.algorithm.filter_groups.enable:
        flags[WITH_SCORES] = True
    if use_ref:
        flags[WITH_REF] = True
    return flags


def with_flags(prompts: Batch, flags: dict[str, bool]) -> Batch:
    """`prompts` with `flags` in a copy of its meta (the columns are shared, not copied)."""
    if not flags:
        return prompts
    return Batch(dict(prompts.tensors), dict(prompts.non_tensors), {**prompts.meta, **flags})


def riding_timing(batch: Batch) -> tuple[Batch, dict[str, float]]:
    """`batch` without the riding stages' times in its meta, and those times (seconds in
    the worker). A shallow copy: the call's kept result stays whole for a replayed step
    (`trainer.stage_calls`), which then finds the same stages riding."""
    keys = {f"timing_s/{stage}": stage for stage in RIDING_STAGES}
    timing = {stage: float(batch.meta[key]) for key, stage in keys.items() if key in batch.meta}
    if not timing:
        return batch, {}
    meta = {k: v for k, v in batch.meta.items() if k not in keys}
    return Batch(dict(batch.tensors), dict(batch.non_tensors), meta), timing
