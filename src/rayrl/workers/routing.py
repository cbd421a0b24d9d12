"""What the actor's passes do with a mixture of experts' routing (verl's router replay),
as `actor_rollout_ref.actor.router_replay.mode` and
`actor_rollout_ref.rollout.enable_rollout_routing_replay` say.

- The log-prob pass (`log_prob_pass`) compares its routing with the rollout's record
  when the samples carry one (``routed_experts``: per-row counts for
  ``actor/routing_mismatch_frac`` and its kin, `rayrl.algos.routing`); under R3 it
  replays the record, under R2 it records the router's own choices
  (``actor_routed_experts``), which the update then replays.
- The update (`update_pass`) replays the rollout's record (R3) or the log-prob pass's
  (R2).

The routing is replayed where the record has it; positions it lacks are routed by the
router (and counted: ``actor/routing_recorded_frac``). A replay mode whose record is
missing from the batch is an error, not a silent fallback.
"""

from __future__ import annotations

from torch import nn

from rayrl.algos.routing import ACTOR_ROUTES, ROUTES, ROUTING_COLUMNS
from rayrl.batch import Batch
from rayrl.config.schema import RayRLConfig
from rayrl.train.router_replay import RoutingPass, moe_routers

__all__ = [
    "check_recording_engine",
    "log_prob_pass",
    "routing_columns",
    "routing_reads",
    "update_pass",
]


def _mode(cfg: RayRLConfig) -> str:
    return cfg.actor_rollout_ref.actor.router_replay.mode


def check_recording_engine(cfg: RayRLConfig, engine: str) -> None:
    """ValueError unless the rollout engine resolved for this worker (``rollout.name=auto``
    picks one per device and model) records the routing the config asks for."""
    if cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay and engine != "native":
        raise ValueError(
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true needs the native "
            f"rollout engine, which records each token's experts; this worker's is {engine!r} "
            "(rollout.name=auto picked it here): set actor_rollout_ref.rollout.name=native"
        )


def routing_reads(cfg: RayRLConfig) -> tuple[str, ...]:
    """The record `update_actor` reads: the rollout's (R3), the log-prob pass's (R2)."""
    return {"R3": (ROUTES,), "R2": (ACTOR_ROUTES,)}.get(_mode(cfg), ())


def log_prob_pass(cfg: RayRLConfig, batch: Batch) -> RoutingPass | None:
    """The log-prob pass's routing (module docstring); None: it leaves it alone."""
    mode, recorded = _mode(cfg), ROUTES in batch
    plan = RoutingPass(replay=mode == "R3" and recorded, record=mode == "R2", compare=recorded)
    return plan if plan.replay or plan.record or plan.compare else None


def update_pass(
    cfg: RayRLConfig, batch: Batch, model: nn.Module
) -> tuple[Batch, RoutingPass | None]:
    """The update's batch (R2: the log-prob pass's record in the ``routed_experts``
    column the forward replays) and its routing.

    Raises:
        ValueError: a replay mode, a mixture of experts, and no record to replay.
    """
    mode = _mode(cfg)
    if mode == "disabled":
        return batch, None
    column = routing_reads(cfg)[0]
    if column not in batch:
        if not moe_routers(model):
            return batch, None  # a dense model: nothing to replay (the config warned)
        raise ValueError(
            f"actor_rollout_ref.actor.router_replay.mode={mode}: the batch has no {column} "
            "column to replay; "
            + (
                "the rollout recorded no routing (is rollout.enable_rollout_routing_replay "
                "on, with the native engine?)"
                if mode == "R3"
                else "the log-prob pass did not run (R2 records the routing in it)"
            )
        )
    if column != ROUTES:
        batch[ROUTES] = batch[column]
    return batch, RoutingPass(replay=True)


def routing_columns(out: Batch) -> dict:
    """The log-prob pass's routing outputs to return: the per-row counts and R2's record."""
    return {k: out[k] for k in (*ROUTING_COLUMNS, ACTOR_ROUTES) if k in out}
