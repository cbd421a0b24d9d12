"""Dispatch modes: how a call on a WorkerGroup is spread over ranks and gathered back.

A worker method declares its distribution contract where it is defined::

    class Actor(Worker):
        @register(dispatch=DP_SPLIT)
        def log_prob(self, batch: Batch) -> Batch: ...

Then `group.log_prob(batch)` pads `batch` to a multiple of the world size, gives one
chunk to each rank, concatenates the per-rank results and removes the padding.

A mode is a pair of functions kept in a registry (add your own with
`register_dispatch_mode`):

- `dispatch(world_size, args, kwargs) -> CallPlan`: the positional and keyword
  arguments for each rank (`None` for a rank that is not called) and a `state` that
  is handed to collect;
- `collect(outputs, state) -> value`: the outputs of the called ranks, in rank order,
  made into the call's result.

Arguments may be futures of earlier non-blocking calls; `adapt_future(future,
world_size)` says what a mode makes of one (see `rayrl.controller.future`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayrl.registry import Registry

ONE_TO_ALL = "one_to_all"
ALL_TO_ALL = "all_to_all"
DP_SPLIT = "dp_split"
RANK_ZERO = "rank_zero"

SPEC_ATTR = "__rayrl_dispatch__"


@dataclass
class CallPlan:
    """Per-rank arguments for one group call; `None` for ranks that are not called."""

    args: list[tuple[Any, ...] | None]
    kwargs: list[dict[str, Any] | None]
    state: Any = None

    @property
    def ranks(self) -> list[int]:
        """The ranks that are called, in order."""
        return [r for r, a in enumerate(self.args) if a is not None]

    def called(self) -> list[tuple[int, tuple[Any, ...], dict[str, Any]]]:
        """(rank, args, kwargs) of each called rank, in order (kwargs None: none)."""
        return [(r, a, self.kwargs[r] or {}) for r, a in enumerate(self.args) if a is not None]


@dataclass(frozen=True)
class DPState:
    """What DP_SPLIT's collect needs: how many padding rows to drop after concatenating."""

    pad: int
    padded_len: int


@dataclass(frozen=True)
class Chunks:
    """An argument that is already split: element i goes to rank i (refs or values)."""

    parts: list[Any]
    state: Any = None


DispatchFn = Callable[[int, tuple[Any, ...], dict[str, Any]], CallPlan]
CollectFn = Callable[[list[Any], Any], Any]


@dataclass(frozen=True)
class DispatchMode:
    """A named dispatch/collect pair; `adapt_future` maps a future argument for it."""

    name: str
    dispatch: DispatchFn
    collect: CollectFn
    adapt_future: Callable[..., Any] | None = None


MODES: Registry[DispatchMode] = Registry("dispatch mode", config_key=None)
COLLECTORS: Registry[CollectFn] = Registry("collect function", config_key=None)


def register_dispatch_mode(
    name: str,
    dispatch_fn: DispatchFn,
    collect_fn: CollectFn,
    adapt_future: Callable[..., Any] | None = None,
) -> DispatchMode:
    """Add a dispatch mode under `name` (usable as `@register(dispatch=name)`)."""
    known = MODES.get(name) if name in MODES else None
    if known is not None and _qualname(known.dispatch) != _qualname(dispatch_fn):
        raise ValueError(
            f"dispatch mode '{name}' is already registered (by {_qualname(known.dispatch)}); "
            "pick another name"
        )
    mode = DispatchMode(name, dispatch_fn, collect_fn, adapt_future)
    MODES.add(name, mode, replace=True)  # the same function again: a module re-imported
    COLLECTORS.add(name, collect_fn, replace=True)
    return mode


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def get_dispatch_mode(name: str) -> DispatchMode:
    """The registered mode called `name`; the error lists the known ones."""
    if name in MODES:
        return MODES.get(name)
    raise ValueError(
        f"unknown dispatch mode '{name}'; known: {sorted(MODES)}. "
        "Add one with rayrl.controller.register_dispatch_mode(name, dispatch_fn, collect_fn)."
    )


def register_collector(name: str, collect_fn: CollectFn) -> None:
    """Add a named collect function (usable as `@register(collect=name)`)."""
    COLLECTORS.add(name, collect_fn, replace=True)


def get_collector(collect: str | CollectFn | None, mode: DispatchMode) -> CollectFn:
    """Resolve a `collect=` choice: None (the mode's own), a registered name, or a callable."""
    if collect is None:
        return mode.collect
    if callable(collect):
        return collect
    if collect in COLLECTORS:
        return COLLECTORS.get(collect)
    raise ValueError(f"unknown collect '{collect}'; known: {sorted(COLLECTORS)}")


@dataclass(frozen=True)
class MethodSpec:
    """The distribution contract `@register` attaches to a worker method."""

    name: str
    mode: DispatchMode
    collect: CollectFn
    blocking: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    layout: str | None = None  # the group's data layout it follows (`controller.layout`)


def register(
    dispatch: str = ONE_TO_ALL,
    collect: str | CollectFn | None = None,
    blocking: bool = True,
    layout: str | None = None,
    **options: Any,
) -> Callable[..., Any]:
    """Mark a Worker method as callable on a WorkerGroup with this dispatch and collect.

    `dispatch` names a registered mode (ONE_TO_ALL, ALL_TO_ALL, DP_SPLIT, RANK_ZERO or
    your own); `collect` overrides the mode's collect (a name such as "list" or a
    function `(outputs, state) -> value`); `blocking=False` makes a plain call return
    a GroupFuture. `layout` (DP_SPLIT only) names the group's data layout the call
    follows: ranks that share a part get the same rows, and each part's output comes
    from its first rank (`rayrl.controller.layout`). Extra `options` go to Ray's
    `.options()` for this method.

    It only attaches the contract (a MethodSpec) and returns the method itself: what
    runs around each call inside the worker (busy tracking, call hooks) is the
    Worker's part (`rayrl.controller.calls`).
    """
    mode = get_dispatch_mode(dispatch)
    collect_fn = get_collector(collect, mode)
    if layout is not None and dispatch != DP_SPLIT:
        raise ValueError(f"layout={layout!r} applies to DP_SPLIT methods only, not {dispatch}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        spec = MethodSpec(fn.__name__, mode, collect_fn, blocking, options, layout)
        setattr(fn, SPEC_ATTR, spec)
        return fn

    return decorate


def method_specs(cls: type) -> dict[str, MethodSpec]:
    """The registered methods of a worker class (inherited ones included), by name."""
    specs: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            spec = getattr(attr, SPEC_ATTR, None)
            if isinstance(spec, MethodSpec):
                specs[name] = spec
    return specs


# --- built-in modes ---------------------------------------------------------------------


def is_batch(value: Any) -> bool:
    """Whether `value` is a rayrl Batch, without importing torch in processes that have none.

    A Batch instance can only exist once `rayrl.batch` is imported, so looking it up in
    `sys.modules` is exact; workers that never touch a Batch never load torch.
    """
    module = sys.modules.get("rayrl.batch")
    return module is not None and isinstance(value, module.Batch)


def _one_to_all(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan:
    return CallPlan([args] * world_size, [kwargs] * world_size)


def collect_list(outputs: list[Any], state: Any) -> list[Any]:
    """The outputs of the called ranks, as a list in rank order."""
    return list(outputs)


def all_to_all_parts(value: Any, world_size: int, name: str) -> list[Any]:
    """The per-rank elements of an ALL_TO_ALL argument; ValueError unless it is a list
    (or tuple) with one element per rank."""
    if isinstance(value, Chunks):
        value = value.parts
    if not isinstance(value, (list, tuple)) or len(value) != world_size:
        got = (
            f"{type(value).__name__} of length {len(value)}"
            if hasattr(value, "__len__")
            else type(value).__name__
        )
        raise ValueError(
            f"ALL_TO_ALL needs every argument to be a list with one element per rank "
            f"({world_size}); argument {name} is a {got}"
        )
    return list(value)


def _all_to_all(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan:
    cols = [all_to_all_parts(a, world_size, f"#{i}") for i, a in enumerate(args)]
    kcols = {k: all_to_all_parts(v, world_size, f"'{k}'") for k, v in kwargs.items()}
    per_args: list[tuple[Any, ...] | None] = [tuple(c[r] for c in cols) for r in range(world_size)]
    per_kwargs: list[dict[str, Any] | None] = [
        {k: c[r] for k, c in kcols.items()} for r in range(world_size)
    ]
    return CallPlan(per_args, per_kwargs)


def _rank_zero(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan:
    return CallPlan([args] + [None] * (world_size - 1), [kwargs] + [None] * (world_size - 1))


def collect_first(outputs: list[Any], state: Any) -> Any:
    """The output of the first called rank."""
    return outputs[0]


def _dp_split(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan:
    """Split every Batch argument (or take pre-split Chunks); broadcast everything else."""
    values = list(args) + list(kwargs.values())
    lengths = {len(v) for v in values if is_batch(v)}
    if len(lengths) > 1:
        raise ValueError(f"DP_SPLIT got Batch arguments of different lengths {sorted(lengths)}")
    states = [v.state for v in values if isinstance(v, Chunks) and v.state is not None]
    state: Any = states[0] if states else None

    def split(value: Any) -> list[Any]:
        nonlocal state
        if isinstance(value, Chunks):
            if len(value.parts) != world_size:
                raise ValueError(
                    f"DP_SPLIT got {len(value.parts)} chunks for a world of {world_size}"
                )
            return list(value.parts)
        if is_batch(value):
            padded, pad = value.pad_to_multiple(world_size)
            state = DPState(pad, len(padded))
            parts: list[Any] = padded.chunk(world_size)
            return parts
        return [value] * world_size

    cols = [split(a) for a in args]
    kcols = {k: split(v) for k, v in kwargs.items()}
    per_args: list[tuple[Any, ...] | None] = [tuple(c[r] for c in cols) for r in range(world_size)]
    per_kwargs: list[dict[str, Any] | None] = [
        {k: c[r] for k, c in kcols.items()} for r in range(world_size)
    ]
    return CallPlan(per_args, per_kwargs, state)


def split_by_layout(layout: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan:
    """DP_SPLIT over a `DataLayout`: the rows split into one chunk per part, every rank
    given its part's chunk (non-Batch arguments go whole to every rank)."""
    plan = _dp_split(layout.parts, args, kwargs)
    per_args = [plan.args[part] for part in layout.part_of]
    per_kwargs = [plan.kwargs[part] for part in layout.part_of]
    return CallPlan(per_args, per_kwargs, plan.state)


def collect_dp(outputs: list[Any], state: Any) -> Any:
    """Concatenate per-rank Batches and drop the rows DP_SPLIT padded.

    If each rank returned k rows per input row (e.g. k samples per prompt), the
    padding is k times as many rows; other shapes of output are returned as a list.
    """
    if not outputs or not all(is_batch(o) for o in outputs):
        return list(outputs)
    merged = type(outputs[0]).concat(outputs)
    return merged.unpad(len(merged) - kept_rows(len(merged), state))


def kept_rows(total: int, state: Any) -> int:
    """How many of the `total` rows a DP_SPLIT call's ranks returned are real: the
    rows its padding caused (k per padded row when each input row gave k) dropped."""
    if not isinstance(state, DPState) or state.pad == 0:
        return total
    if total % state.padded_len != 0:
        raise ValueError(
            f"DP_SPLIT cannot remove its {state.pad} padding rows: the ranks returned "
            f"{total} rows for {state.padded_len} padded input rows (not a multiple). "
            "Return the same number of rows per input row, or use collect='list'."
        )
    return total - state.pad * (total // state.padded_len)


@dataclass(frozen=True)
class Outputs:
    """The called ranks' outputs in rank order and the call's dispatch state, as they
    came: what `collect_outputs` returns to a caller that collects them itself."""

    outputs: list[Any]
    state: Any


def collect_outputs(outputs: list[Any], state: Any) -> Outputs:
    """Collect nothing: the outputs and the state as they are (`Outputs`)."""
    return Outputs(list(outputs), state)


register_dispatch_mode(ONE_TO_ALL, _one_to_all, collect_list)
register_dispatch_mode(ALL_TO_ALL, _all_to_all, collect_list)
register_dispatch_mode(RANK_ZERO, _rank_zero, collect_first)
register_dispatch_mode(DP_SPLIT, _dp_split, collect_dp)
register_collector("list", collect_list)
register_collector("first", collect_first)
register_collector("concat", collect_dp)
register_collector("outputs", collect_outputs)
