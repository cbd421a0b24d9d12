"""GroupMethod: a registered worker method as it appears on a WorkerGroup (or a role view).

`group.foo(x)` dispatches `x` over the ranks as `foo`'s `@register` contract says,
calls every rank, and collects; `group.foo.remote(x)` (or `group.foo(x,
blocking=False)`) returns a GroupFuture at once.

An argument that goes whole to several ranks (ONE_TO_ALL, or a non-Batch argument of
DP_SPLIT) is serialised once: above Ray's inline size it is `ray.put` once and every
rank gets the same ref, instead of Ray pickling and storing a copy per rank.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import ray
from ray import ObjectRef

from rayrl.controller import traffic
from rayrl.controller.dispatch import CallPlan, MethodSpec, collect_dp, split_by_layout
from rayrl.controller.errors import WorkerCallError, WorkerDescription
from rayrl.controller.future import GroupFuture, adapt_arguments
from rayrl.controller.kept import KEEP_KWARG
from rayrl.controller.layout import DataLayout


class Caller(Protocol):
    """What a GroupMethod needs from the group (or view) it belongs to."""

    @property
    def world_size(self) -> int: ...

    def _invoke(
        self, rank: int, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ObjectRef: ...

    def describe(self, rank: int) -> WorkerDescription: ...

    def _note_error(self, rank: int, err: BaseException) -> None: ...

    def data_layout(self, name: str | None) -> DataLayout | None: ...

    @property
    def watchdog(self) -> Any: ...


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

    def keeping(self, driver: tuple[str, ...] | None = None) -> GroupMethod:
        """This method, called so that each rank keeps columns of the Batch it returns in
        its own object store: the result holds them as remote columns, which later
        calls fetch worker to worker (`rayrl.controller.kept`). Kept: every column not
        named in `driver`, or without it those of more than one value per row."""
        return _Keeping(self._owner, self.spec, True if driver is None else tuple(driver))

    def remote(self, *args: Any, **kwargs: Any) -> GroupFuture:
        """Start the call on every rank it dispatches to and return a GroupFuture."""
        owner, spec = self._owner, self.spec
        layout = owner.data_layout(spec.layout)
        if layout is not None and not layout.trivial:
            return self._remote_by_layout(layout, args, kwargs)
        args, kwargs, inputs, adapters = adapt_arguments(spec.mode, owner.world_size, args, kwargs)
        plan = share_broadcast(spec.mode.dispatch(owner.world_size, args, kwargs), spec.name)
        return self._start(plan, split=spec.collect is collect_dp, inputs=inputs, adapters=adapters)

    def _remote_by_layout(
        self, layout: DataLayout, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> GroupFuture:
        """DP_SPLIT over a data layout: one chunk per part, the same chunk for the ranks
        of a part (stored once), the output taken from each part's first rank. Future
        arguments are collected here first: their chunks follow another split."""
        args = tuple(a.get() if isinstance(a, GroupFuture) else a for a in args)
        kwargs = {k: v.get() if isinstance(v, GroupFuture) else v for k, v in kwargs.items()}
        plan = share_parts(split_by_layout(layout, args, kwargs), layout, self.spec.name)
        return self._start(plan, keep=layout.leaders)

    def _start(self, plan: CallPlan, **future: Any) -> GroupFuture:
        """Invoke every rank of `plan`; the GroupFuture of the call (`future`: its extra
        arguments). An argument Ray cannot send fails as this rank's call."""
        owner, spec = self._owner, self.spec
        refs = []
        for rank, args, kwargs in plan.called():
            traffic.count_sent(spec.name, [*args, *kwargs.values()])
            try:
                refs.append(owner._invoke(rank, spec, args, kwargs))
            except WorkerCallError:
                raise
            except Exception as err:  # noqa: BLE001 - e.g. an argument Ray cannot pickle
                raise WorkerCallError(spec.name, owner.describe(rank), err) from err
        return GroupFuture(
            refs,
            plan.ranks,
            spec.collect,
            plan.state,
            stage=spec.name,
            describe=owner.describe,
            on_error=owner._note_error,
            watchdog=owner.watchdog,
            **future,
        )


class _Keeping(GroupMethod):
    """A GroupMethod whose calls keep their result's wide columns (`keeping()`)."""

    keeps_rows = True

    def __init__(self, owner: Caller, spec: MethodSpec, keep: Any) -> None:
        super().__init__(owner, spec)
        self.keep = keep

    def remote(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return super().remote(*args, **kwargs, **{KEEP_KWARG: self.keep})


def share_parts(plan: CallPlan, layout: DataLayout, method: str = "") -> CallPlan:
    """Each part's large arguments stored once for all its ranks (`ray.put`)."""
    stored: dict[int, Any] = {}

    def once(value: Any) -> Any:
        if id(value) not in stored:
            large = nbytes_at_least(value, INLINE_BYTES)
            stored[id(value)] = put(value, method) if large else value
        return stored[id(value)]

    if layout.parts == len(layout.part_of):
        return plan
    calls = plan.called()
    args: list[tuple[Any, ...] | None] = [tuple(once(a) for a in rargs) for _, rargs, _ in calls]
    kwargs: list[dict[str, Any] | None] = [
        {k: once(v) for k, v in rkw.items()} for _, _, rkw in calls
    ]
    return CallPlan(args, kwargs, plan.state)


def bind_methods(owner: Caller, specs: dict[str, MethodSpec], reserved: set[str]) -> None:
    """Set a GroupMethod on `owner` for every registered method; refuse name clashes."""
    for name, spec in specs.items():
        if name in reserved:
            raise TypeError(
                f"worker method '{name}' is registered with @register but WorkerGroup has "
                f"its own '{name}'; rename the worker method"
            )
        setattr(owner, name, GroupMethod(owner, spec))


# Ray inlines task arguments up to 100 KiB (max_direct_call_object_size); larger ones
# are put in the object store once per call, so those are worth sharing.
INLINE_BYTES = 100 * 1024


def put(value: Any, method: str) -> ObjectRef:
    """`ray.put(value)`, counted as sent by `method` (`rayrl.controller.traffic`)."""
    traffic.count_sent(method, [value])
    return ray.put(value)


def share_broadcast(plan: CallPlan, method: str = "") -> CallPlan:
    """Put each large argument that several ranks get as the same object once."""
    calls = plan.called()
    if len(calls) < 2:
        return plan
    shared: dict[int, Any] = {}

    def share(value: Any) -> Any:
        if id(value) not in shared:
            large = nbytes_at_least(value, INLINE_BYTES)
            shared[id(value)] = put(value, method) if large else value
        return shared[id(value)]

    _, first_args, first_kwargs = calls[0]
    repeated = {i for i, a in enumerate(first_args) if all(c[1][i] is a for c in calls[1:])}
    krepeated = {k for k, v in first_kwargs.items() if all(c[2][k] is v for c in calls[1:])}
    if not repeated and not krepeated:
        return plan
    args = list(plan.args)
    kwargs = list(plan.kwargs)
    for r, rargs, rkwargs in calls:
        args[r] = tuple(share(a) if i in repeated else a for i, a in enumerate(rargs))
        kwargs[r] = {k: share(v) if k in krepeated else v for k, v in rkwargs.items()}
    return CallPlan(args, kwargs, plan.state)


def nbytes_at_least(value: Any, limit: int, depth: int = 0) -> bool:
    """Whether `value` takes at least `limit` bytes serialised, judged cheaply.

    Buffers, arrays, tensors and Batches by their bytes; containers by their items
    (up to a few levels and a thousand items); anything else by `sys.getsizeof`.
    """
    if isinstance(value, ObjectRef) or value is None or isinstance(value, (bool, int, float)):
        return False
    if isinstance(value, (bytes, bytearray, str)):
        return len(value) >= limit
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes >= limit
    tensors = getattr(value, "tensors", None)
    if isinstance(tensors, dict):  # a Batch
        columns = list(tensors.values()) + list(getattr(value, "non_tensors", {}).values())
        return _sum_at_least(columns, limit, depth)
    if isinstance(value, dict):
        return _sum_at_least(list(value.values()), limit, depth)
    if isinstance(value, (list, tuple, set)):
        return len(value) > 1000 or _sum_at_least(list(value), limit, depth)
    return sys.getsizeof(value) >= limit


def _sum_at_least(items: list[Any], limit: int, depth: int) -> bool:
    if depth >= 3 or len(items) > 1000:
        return True
    total = 0
    for item in items:
        nbytes = getattr(item, "nbytes", None)
        if isinstance(nbytes, int):
            total += nbytes
        elif nbytes_at_least(item, limit - total, depth + 1):
            return True
        else:
            total += 64
        if total >= limit:
            return True
    return False
