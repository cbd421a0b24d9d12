"""GroupMethod: a registered worker method as it appears on a WorkerGroup (or a role view).

`group.foo(x)` dispatches `x` over the ranks as `foo`'s `@register` contract says,
calls every rank, and collects; `group.foo.remote(x)` (or `group.foo(x,
blocking=False)`) returns a GroupFuture at once.
"""

from __future__ import annotations

from typing import Any, Protocol

from ray import ObjectRef

from rayrl.controller.dispatch import MethodSpec, collect_dp
from rayrl.controller.errors import WorkerCallError, WorkerDescription
from rayrl.controller.future import GroupFuture, adapt_arguments


class Caller(Protocol):
    """What a GroupMethod needs from the group (or view) it belongs to."""

    world_size: int

    def _invoke(self, rank: int, spec: MethodSpec, args: tuple, kwargs: dict) -> ObjectRef: ...

    def describe(self, rank: int) -> WorkerDescription: ...

    def _note_error(self, rank: int, err: BaseException) -> None: ...


class GroupMethod:
    """A registered method bound to a group: call it, or `.remote(...)` it for a future."""

    def __init__(self, owner: Caller, spec: MethodSpec) -> None:
        self._owner = owner
        self.spec = spec
        self.__name__ = spec.name
        self.__doc__ = f"{spec.name} on every rank ({spec.mode.name})"

    def __repr__(self) -> str:
        return f"<group method {self.spec.name} dispatch={self.spec.mode.name}>"

    def __call__(self, *args: Any, blocking: bool | None = None, **kwargs: Any) -> Any:
        """Run on the group; blocks and returns the collected value unless blocking=False."""
        future = self.remote(*args, **kwargs)
        blocking = self.spec.blocking if blocking is None else blocking
        return future.get() if blocking else future

    def remote(self, *args: Any, **kwargs: Any) -> GroupFuture:
        """Start the call on every rank it dispatches to and return a GroupFuture."""
        owner, spec = self._owner, self.spec
        args, kwargs = adapt_arguments(spec.mode, owner.world_size, args, kwargs)
        plan = spec.mode.dispatch(owner.world_size, args, kwargs)
        refs = []
        for rank in plan.ranks:
            try:
                refs.append(owner._invoke(rank, spec, plan.args[rank], plan.kwargs[rank]))
            except WorkerCallError:
                raise
            except Exception as err:  # noqa: BLE001 - e.g. an argument Ray cannot pickle
                raise WorkerCallError(spec.name, owner.describe(rank), err) from err
        return GroupFuture(
            refs,
            plan.ranks,
            spec.collect,
            plan.state,
            split=spec.collect is collect_dp,
            stage=spec.name,
            describe=owner.describe,
            on_error=owner._note_error,
        )


def bind_methods(owner: Caller, specs: dict[str, MethodSpec], reserved: set[str]) -> None:
    """Set a GroupMethod on `owner` for every registered method; refuse name clashes."""
    for name, spec in specs.items():
        if name in reserved:
            raise TypeError(
                f"worker method '{name}' is registered with @register but WorkerGroup has "
                f"its own '{name}'; rename the worker method"
            )
        setattr(owner, name, GroupMethod(owner, spec))
