"""Controller layer: Worker, WorkerGroup, dispatch modes, colocation, health, replacement,
step-boundary snapshots, the progress watchdog, and what runs around each call inside a
worker (busy tracking, call hooks: `rayrl.controller.calls`).

The driver talks to a group of workers as if it were one object: a call on the group
is dispatched over its ranks as the method's `@register` contract says, and the
ranks' results are collected into one value (docs/design.md, "Worker groups and
dispatch"). Imports only the cluster layer and leaves (batch); knows nothing of RL.
"""

from rayrl.controller.colocate import FusedWorker, RoleView, colocate
from rayrl.controller.dispatch import (
    ALL_TO_ALL,
    DP_SPLIT,
    ONE_TO_ALL,
    RANK_ZERO,
    CallPlan,
    DPState,
    register,
    register_collector,
    register_dispatch_mode,
)
from rayrl.controller.errors import (
    FutureArgumentError,
    GroupTimeoutError,
    NoSpareBundleError,
    WorkerCallError,
    WorkerCreateError,
    WorkerError,
    WorkerHungError,
    WorkerInitError,
)
from rayrl.controller.future import GroupFuture
from rayrl.controller.group import WorkerGroup
from rayrl.controller.health import HealthMonitor, HealthReport, Replacement, TopologyChangedWarning
from rayrl.controller.recovery import GroupSnapshot, SnapshotLostError
from rayrl.controller.startup import PhaseFuture, start_groups
from rayrl.controller.worker import Worker, WorkerContext

__all__ = [
    "ALL_TO_ALL",
    "DP_SPLIT",
    "ONE_TO_ALL",
    "RANK_ZERO",
    "CallPlan",
    "DPState",
    "FusedWorker",
    "FutureArgumentError",
    "GroupFuture",
    "GroupSnapshot",
    "GroupTimeoutError",
    "HealthMonitor",
    "HealthReport",
    "NoSpareBundleError",
    "PhaseFuture",
    "Replacement",
    "RoleView",
    "SnapshotLostError",
    "TopologyChangedWarning",
    "Worker",
    "WorkerCallError",
    "WorkerContext",
    "WorkerCreateError",
    "WorkerError",
    "WorkerGroup",
    "WorkerHungError",
    "WorkerInitError",
    "colocate",
    "register",
    "register_collector",
    "register_dispatch_mode",
    "start_groups",
]
