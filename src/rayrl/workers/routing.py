"""What the actor's passes do with a mixture of experts' routing (verl's router replay),
as `actor_rollout_ref.actor.router_replay.mode` and
`actor_rollout_ref.rollout.enable_rollout_routing_replay` say.

- The log-prob pass (`log_prob_pass`) compares its routing with the rollout's record
  when the samples carry one (``routed_experts``: per-row counts for
  ``actor/routing_mismatch_frac`` and its kin, `rayrl.algos.routing`); under R3 it
  replays the record, under R2 it records the router's own choices
  (``actor_routed_experts``), which the update then replays.
- The update (`update_routing`) replays the rollout's record (R3) or the log-prob
  pass's (R2). An on-policy update (no separate log-prob pass: `rayrl.trainer.on_policy`)
  makes the pass's counts itself, summed over its micro-batches (`routing_sums`) and
  turned into the same metrics (`routing_from_totals`).

The routing is replayed where the record has it; positions it lacks are routed by the
router (and counted: ``actor/routing_recorded_frac``). A replay mode whose record is
missing from the batch is an error, not a silent fallback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from rayrl.algos.routing import ACTOR_ROUTES, ROUTES, ROUTING_COLUMNS, routing_metrics
from rayrl.batch import Batch
from rayrl.config.schema import RayRLConfig
from rayrl.train.router_replay import RoutingPass, moe_routers, routing

__all__ = [
    "check_recording_engine",
    "log_prob_pass",
    "routing_columns",
    "routing_from_totals",
    "routing_reads",
    "routing_sums",
    "update_pass",
    "update_routing",
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
    """The records `update_actor` reads: the log-prob pass's (R2), the rollout's (R3, and
    for an on-policy update's counts whenever the rollout records)."""
    reads = [ACTOR_ROUTES] if _mode(cfg) == "R2" else []
    if cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay or _mode(cfg) == "R3":
        reads.append(ROUTES)
    return tuple(reads)


def log_prob_pass(cfg: RayRLConfig, batch: Batch) -> RoutingPass | None:
    """The log-prob pass's routing (module docstring); None: it leaves it alone."""
    mode, recorded = _mode(cfg), ROUTES in batch
    plan = RoutingPass(replay=mode == "R3" and recorded, record=mode == "R2", compare=recorded)
    return plan if plan.replay or plan.record or plan.compare else None


def update_pass(
    cfg: RayRLConfig, batch: Batch, model: nn.Module, on_policy: bool = False
) -> tuple[Batch, RoutingPass | None]:
    """The update's batch (R2: the log-prob pass's record in the ``routed_experts``
    column the forward replays) and its routing (``on_policy``: with the counts against
    the rollout's record, which no log-prob pass made).

    Raises:
        ValueError: a replay mode, a mixture of experts, and no record to replay.
    """
    mode, compare = _mode(cfg), on_policy and ROUTES in batch
    if mode == "disabled":
        return batch, RoutingPass(compare=True) if compare else None
    column = ACTOR_ROUTES if mode == "R2" else ROUTES
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
    return batch, RoutingPass(replay=True, compare=compare)


@contextmanager
def update_routing(
    cfg: RayRLConfig, batch: Batch, model: nn.Module, on_policy: bool
) -> Iterator[Batch]:
    """The update's batch, its forwards (and their backwards) routed as `update_pass`
    says while inside."""
    batch, plan = update_pass(cfg, batch, model, on_policy)
    with routing(model, plan):
        yield batch


def routing_sums(outputs: dict[str, Tensor]) -> dict[str, Any]:
    """A micro-batch's `ROUTING_COLUMNS` summed over its rows (``routing/<column>``), for
    the loss's metrics (summed over micro-batches and ranks); nothing without them."""
    return {f"routing/{k}": outputs[k].sum() for k in ROUTING_COLUMNS if k in outputs}


def routing_from_totals(metrics: dict[str, float]) -> dict[str, float]:
    """`routing_metrics` of an update's ``routing/<column>`` totals, which are taken out
    of ``metrics``; nothing when they are not there."""
    if f"routing/{ROUTING_COLUMNS[0]}" not in metrics:
        return {}
    totals = {k: torch.tensor([metrics.pop(f"routing/{k}")]) for k in ROUTING_COLUMNS}
    return routing_metrics(totals)


def routing_columns(out: Batch) -> dict[str, Any]:
    """The log-prob pass's routing outputs to return: the per-row counts and R2's record."""
    return {k: out[k] for k in (*ROUTING_COLUMNS, ACTOR_ROUTES) if k in out}
