"""Stages that ride on the generate call: in a one-process run, the reference log-probs
and the reward's scores of the fresh samples are computed by the same worker call that
generated them.

When the actor is one rank and the reward scores in its process (`reward.colocate`),
the generate, scoring and reference calls all run in that one process, one after
another, whatever the controller does. Sending them as three calls only adds two round
trips and two trips of the step's batch through the object store and back. With
`StepContext.with_scores` / `with_ref` the worker's `generate` scores the samples (the
colocated reward role's own code) and computes the reference log-probs (the reference
engine's own forward) before it returns; the columns are the ones the separate calls
return, computed by the same code on the same rows, and the step reports
`timing_s/reward` and `timing_s/ref` as the worker measured them (`timing_s/gen`
without them).

Separate calls remain where they can overlap or need the controller in between:
several actor ranks (the batch is re-balanced across ranks after generation), the
reward in its own process (it scores while the reference runs), an HTTP reward (its
error budget stops a run from the reward stage), and dynamic sampling (it scores extra
rounds of prompts on its own).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayrl.config.schema import RayRLConfig

# The stages a generate call may compute itself, timed under these names.
RIDING_STAGES = ("reward", "ref")


@dataclass(frozen=True)
class Riding:
    """Which stages ride on a step's generate call (`StepContext.with_scores`, `with_ref`)."""

    scores: bool = False
    ref: bool = False


def riding_stages(
    cfg: RayRLConfig, actor_ranks: int, reward_in_actor: bool, use_ref: bool
) -> Riding:
    """The stages that ride on the generate call of this run's steps (none: `Riding()`)."""
    if actor_ranks != 1:
        return Riding()
    scores = reward_in_actor and not cfg.reward.http.url and not cfg.algorithm.filter_groups.enable
    return Riding(scores=scores, ref=use_ref)
