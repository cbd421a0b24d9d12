"""Colocation: several role classes fused into one Ray actor per bundle.

    Fused = colocate({"actor": Actor, "ref": Ref})
    group = WorkerGroup(Fused, pool.bundles, role="actor_ref", run=run, kv=kv).create()
    group.init(actor={"lr": 1e-6}, ref={})     # each role's init_worker gets its kwargs
    actor = group.view("actor")                # a WorkerGroup-like view of one role
    actor.update(batch)                        # runs Actor.update in the fused process

One process holds an instance of every role, so roles can share memory (weights, a
CUDA context): inside a role, `self.peers["ref"]` is the Ref instance of the same
process. The process group belongs to the process: form it once for the fused group
(`group.init(backend="gloo")`), not in each role. The hybrid engine stands on this.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ray import ObjectRef

from rayrl.controller.dispatch import MethodSpec, method_specs
from rayrl.controller.errors import WorkerDescription
from rayrl.controller.members import GroupMembers
from rayrl.controller.method import bind_methods
from rayrl.controller.worker import Worker, WorkerContext


class FusedWorker(Worker):
    """A worker holding one instance of each role class of `ROLES` (set by `colocate`).

    Constructor: `roles_args={"actor": {...ctor kwargs...}}` for roles that take any.
    """

    ROLES: dict[str, type[Worker]] = {}

    def __init__(self, roles_args: dict[str, dict[str, Any]] | None = None) -> None:
        roles_args = dict(roles_args or {})
        _check_roles(self.ROLES, roles_args, "constructor arguments")
        self.peers: dict[str, Worker] = {}
        for role, cls in self.ROLES.items():
            self.peers[role] = cls(**roles_args.get(role, {}))
        for instance in self.peers.values():
            # only the roles of a fused process have `peers` (a role looks for it with
            # getattr), so Worker does not declare it and mypy cannot follow this
            instance.peers = self.peers  # type: ignore[attr-defined]

    def _rayrl_setup(self, ctx: WorkerContext, call_hooks: tuple[Any, ...] = ()) -> dict[str, Any]:
        for role, instance in self.peers.items():
            instance._rayrl_setup(replace(ctx, role=role))
        return super()._rayrl_setup(ctx, call_hooks)  # hooks belong to the process: once

    def _rayrl_set_context(self, ctx: WorkerContext) -> dict[str, Any]:
        for role, instance in self.peers.items():
            instance.ctx = replace(ctx, role=role)
        return super()._rayrl_set_context(ctx)

    def _rayrl_join(
        self, ctx: WorkerContext, backend: str, timeout: float, pg_timeout: float | None = None
    ) -> dict[str, Any]:
        info = super()._rayrl_join(ctx, backend, timeout, pg_timeout)
        for role, instance in self.peers.items():
            instance.ctx = replace(ctx, role=role)
        return info

    def _rayrl_busy_now(self) -> tuple[str, float, int] | None:
        for role, instance in self.peers.items():
            busy = getattr(instance, "_rayrl_busy", None)
            if busy:
                return (f"{role}.{busy[0]}", *busy[1:])
        return super()._rayrl_busy_now()

    @classmethod
    def check_init_kwargs(cls, kwargs: dict[str, Any]) -> None:
        _check_roles(cls.ROLES, kwargs, "init arguments")
        for role, role_kwargs in kwargs.items():
            cls.ROLES[role].check_init_kwargs(role_kwargs)

    def init_worker(self, **kwargs: Any) -> None:
        """Run each role's `init_worker` with `kwargs[role]`, in the order the roles were given."""
        for role, instance in self.peers.items():
            instance._rayrl_init_kwargs = dict(kwargs.get(role, {}))
            instance.joining = self.joining
            instance.init_worker(**kwargs.get(role, {}))

    def rebuild(self) -> None:
        """Each role's rebuild hook, in the order the roles were given."""
        for instance in self.peers.values():
            instance.rebuild()

    def snapshot_state(self) -> dict[str, Any]:
        """Every role's state, by role."""
        return {role: instance.snapshot_state() for role, instance in self.peers.items()}

    def snapshot_nbytes(self) -> int:
        return sum(instance.snapshot_nbytes() for instance in self.peers.values())

    def restore_state(self, state: dict[str, Any]) -> None:
        for role, instance in self.peers.items():
            instance.restore_state(state.get(role))

    def _rayrl_role_call(
        self, _rayrl_role_: str, _rayrl_method_: str, *args: Any, **kwargs: Any
    ) -> Any:
        """Call `method` on the instance of `role` in this process."""
        return getattr(self.peers[_rayrl_role_], _rayrl_method_)(*args, **kwargs)


def _check_roles(roles: dict[str, type], given: dict[str, Any], what: str) -> None:
    unknown = sorted(set(given) - set(roles))
    if unknown:
        raise ValueError(
            f"{what} name roles {unknown} that this fused worker does not have; "
            f"its roles are {list(roles)}"
        )


def colocate(roles: dict[str, type[Worker]], name: str | None = None) -> type[FusedWorker]:
    """A FusedWorker class holding one instance of each role class (all Worker subclasses)."""
    if not roles:
        raise ValueError("colocate needs at least one role, e.g. colocate({'actor': Actor})")
    for role, cls in roles.items():
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"role '{role}' must be a plain Worker subclass, got {cls!r}")
    cls_name = name or "Fused_" + "_".join(roles)
    return type(cls_name, (FusedWorker,), {"ROLES": dict(roles), "__module__": __name__})


class RoleView:
    """The methods of one role of a fused group, called like a WorkerGroup's.

    Shares the fused group's actors: calls run on the role's instance in each process.
    """

    def __init__(self, group: GroupMembers, role: str) -> None:
        roles = getattr(group.worker_cls, "ROLES", {})
        if role not in roles:
            raise KeyError(f"group {group.name} has roles {list(roles)}, not '{role}'")
        self.group = group
        self.role = role
        self.name = f"{group.name}:{role}"
        self.specs: dict[str, MethodSpec] = method_specs(roles[role])
        bind_methods(self, self.specs, reserved=set(dir(RoleView)) | set(vars(self)))

    def __repr__(self) -> str:
        return f"RoleView({self.name!r}, world_size={self.world_size})"

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def _invoke(
        self, rank: int, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ObjectRef:
        method = self.group.actor_handle(rank, spec.name)._rayrl_role_call
        if spec.options:
            method = method.options(**spec.options)
        return method.remote(self.role, spec.name, *args, **kwargs)

    def describe(self, rank: int) -> WorkerDescription:
        """The fused worker's description, naming this role."""
        return replace(self.group.describe(rank), role=f"{self.role} (in {self.group.role})")

    def _note_error(self, rank: int, err: BaseException) -> None:
        self.group._note_error(rank, err)

    def data_layout(self, name: str | None) -> Any:
        return self.group.data_layout(name)

    @property
    def watchdog(self) -> Any:
        return self.group.watchdog

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a registered method of this role by name."""
        if method not in self.specs:
            raise AttributeError(f"role '{self.role}' has no registered method '{method}'")
        return getattr(self, method)(*args, **kwargs)
