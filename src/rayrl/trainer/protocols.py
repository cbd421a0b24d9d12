"""The roles as the trainer calls them: typed views of a started group's methods.

A `WorkerGroup` (or a fused group's `RoleView`) binds each registered method of its
worker class as a `GroupMethod` attribute when it starts (`bind_methods`), so a type
checker cannot see them on the class. These protocols name the methods the PPO
trainer and its stages call on each role; `start_roles` states that the groups it
starts have them (`rayrl.trainer.roles`). They are for type checkers only: nothing
checks them at run time.
"""

from __future__ import annotations

from typing import Protocol

from rayrl.controller.method import GroupMethod

__all__ = [
    "ActorRole",
    "CriticRole",
    "ReplicaRole",
    "RewardRole",
    "SFTRole",
    "TeacherRole",
    "TrainRole",
]


class TrainRole(Protocol):
    """A role with a training engine: its ranks' data layouts, its state on disk."""

    @property
    def world_size(self) -> int: ...

    data_parts: GroupMethod  # -> per rank, which part of the rows it takes, by layout
    save: GroupMethod  # (path: str) -> None
    load: GroupMethod  # (path: str) -> None


class ActorRole(TrainRole, Protocol):
    """The actor (with its rollout engine and reference policy): `ActorRolloutRefWorker`."""

    generate: GroupMethod  # (prompts: Batch, ctx: StepContext) -> StageResult
    compute_log_prob: GroupMethod
    compute_ref_log_prob: GroupMethod
    update_actor: GroupMethod
    export_hf: GroupMethod  # (path: str) -> None
    publish_weights: GroupMethod  # (transport, group, key) -> PublishedWeights | None


class CriticRole(TrainRole, Protocol):
    """The critic: `CriticWorker`."""

    compute_values: GroupMethod
    update_critic: GroupMethod


class TeacherRole(Protocol):
    """The teachers of on-policy distillation: `TeacherWorker`, in the actor's processes
    or on a pool of their own."""

    @property
    def world_size(self) -> int: ...

    data_parts: GroupMethod
    compute_teacher_log_prob: GroupMethod  # (batch: Batch) -> Batch of teacher_log_prob


class SFTRole(TrainRole, Protocol):
    """The supervised fine-tuning ranks: `SFTWorker`."""

    train_batch: GroupMethod  # (batch: Batch) -> dict[str, float]
    nll: GroupMethod  # (batch: Batch) -> Batch of per-row "nll" and "tokens"
    export_hf: GroupMethod  # (path: str) -> None


class ReplicaRole(Protocol):
    """A rollout replica of asynchronous training: `RolloutWorker`."""

    generate: GroupMethod  # (prompts: Batch, call: ReplicaCall) -> ReplicaResult


class RewardRole(Protocol):
    """The reward source the step scores with: `RewardWorker`, in a group of its own
    or in the actor's processes."""

    @property
    def world_size(self) -> int: ...

    compute_score: GroupMethod  # (batch: Batch) -> Batch
