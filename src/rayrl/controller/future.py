"""GroupFuture: the pending result of a non-blocking group call, one ObjectRef per rank.

`future.get()` gathers and collects on the driver. Passed as an argument to another
group's call, a future stands for exactly the value `future.get()` would return, for
every producer and consumer dispatch mode, yet the driver never fetches it: each mode
says what it makes of one (an adapter), and the data moves worker to worker through
the object store:

- DP_SPLIT, from a DP_SPLIT producer of the same world size: rank i gets rank i's ref
  as it is, and the padding bookkeeping travels along, so results still unpad;
- DP_SPLIT otherwise: a light remote task collects the parts and splits the value
  (a Batch: padded and chunked for the new world size; anything else: broadcast);
- ALL_TO_ALL: rank i gets rank i's ref when the producer collects a list of one output
  per rank of the same world size; otherwise a remote task splits the collected list;
- any other mode: one ref of the collected value that every rank gets (computed by a
  remote task, or the single output itself when the producer's collect takes the first).

When a producer rank failed, the consumer's error names that producer worker; when an
adapter task failed (say, a value ALL_TO_ALL cannot split), a FutureArgumentError says
which result could not be passed into which call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import ray
from ray import ObjectRef

from rayrl.controller import traffic
from rayrl.controller.dispatch import (
    ALL_TO_ALL,
    DP_SPLIT,
    Chunks,
    CollectFn,
    DispatchMode,
    DPState,
    all_to_all_parts,
    collect_dp,
    collect_first,
    collect_list,
    is_batch,
)
from rayrl.controller.errors import (
    DEAD_ERRORS,
    FutureArgumentError,
    GroupTimeoutError,
    WorkerCallError,
    WorkerDescription,
    WorkerHungError,
)


class GroupFuture:
    """Per-rank ObjectRefs of one group call plus how to collect them.

    `refs[i]` is the output of rank `ranks[i]`. `split` is true when the outputs are
    DP_SPLIT chunks (`state` then says how much padding to drop, possibly as a ref).
    `inputs` are the futures this call took as arguments and `adapters` the refs of the
    remote tasks that passed them in: a failure there is reported as theirs.
    """

    def __init__(
        self,
        refs: list[ObjectRef],
        ranks: list[int],
        collect: CollectFn,
        state: Any = None,
        *,
        split: bool = False,
        stage: str = "",
        describe: Callable[[int], WorkerDescription] | None = None,
        on_error: Callable[[int, BaseException], None] | None = None,
        inputs: list[GroupFuture] | None = None,
        adapters: list[tuple[str, ObjectRef]] | None = None,
        watchdog: Any = None,
        keep: list[int] | None = None,
    ) -> None:
        self.refs = refs
        self.ranks = ranks
        self.collect = collect
        self.state = state
        self.split = split
        self.stage = stage
        self._describe = describe or (lambda rank: WorkerDescription(role="?", rank=rank))
        self._on_error = on_error
        self.inputs = list(inputs or [])
        self.adapters = list(adapters or [])
        self.watchdog = watchdog
        self.keep = None if keep is None else set(keep)  # ranks whose outputs are collected

    def __repr__(self) -> str:
        return f"GroupFuture({self.stage!r}, ranks={self.ranks})"

    def __len__(self) -> int:
        return len(self.refs)

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError(
            f"a GroupFuture ({self.stage!r}) cannot be sent to a worker inside another value; "
            "pass it as a top-level argument of a group call (group.method(future)) so its "
            "refs go worker to worker, or call future.ref() for one ObjectRef of its result"
        )

    def get(self, timeout: float | None = None, collect: CollectFn | None = None) -> Any:
        """Wait for every rank, then collect (with `collect` instead of the method's own
        when given). A failed rank raises WorkerCallError; ranks still running after
        `timeout` seconds raise GroupTimeoutError naming them; with a watchdog, a rank
        without progress raises WorkerHungError."""
        try:
            if self.watchdog is not None:
                outputs = self.watchdog.wait(self, timeout)
            else:
                outputs = ray.get(self.refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError as err:
            raise self._timeout_error(timeout) from err
        except WorkerHungError:
            raise
        except Exception as err:  # noqa: BLE001 - translated to the failing rank below
            self._raise_for_rank(err)
        state = ray.get(self.state) if isinstance(self.state, ObjectRef) else self.state
        traffic.count_received(self.stage, [*outputs, state])
        if self.keep is not None:  # a data layout: one output per part (its first rank)
            outputs = [
                out for rank, out in zip(self.ranks, outputs, strict=True) if rank in self.keep
            ]
        return (collect or self.collect)(outputs, state)

    def discard(self) -> None:
        """Give up on this call: errors of ranks that already failed are read (so Ray
        does not report them as unhandled), results are dropped."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0, fetch_local=False)
        for ref in ready:
            with contextlib.suppress(Exception):  # handled where the failure surfaced
                ray.get(ref, timeout=0)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every rank finished within `timeout` seconds (does not fetch)."""
        ready, _ = ray.wait(
            self.refs, num_returns=len(self.refs), timeout=timeout, fetch_local=False
        )
        return len(ready) == len(self.refs)

    def ref(self) -> ObjectRef:
        """One ObjectRef of the value `get()` returns, computed by a remote task (not the
        driver); the single output itself when the collect takes the first output."""
        if len(self.refs) == 1 and self.collect is collect_first:
            return self.refs[0]
        return _collect_task.remote(self.collect, self.state, *self.refs)

    def _timeout_error(self, timeout: float | None) -> GroupTimeoutError:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0, fetch_local=False)
        done = {r.hex() for r in ready}
        late = [
            rank for rank, ref in zip(self.ranks, self.refs, strict=True) if ref.hex() not in done
        ]
        where = "; ".join(self._describe(rank).where() for rank in late)
        return GroupTimeoutError(
            f"'{self.stage}' did not finish within {timeout} s on {len(late)} of "
            f"{len(self.refs)} ranks: {where}. group.check_health() shows whether they are "
            "alive and which method each is in; their worker logs show what they are doing."
        )

    def _raise_for_rank(self, err: BaseException) -> None:
        """Raise for what failed: a producer of an input future, an adapter task, or
        else this call's rank (a dead one first, then the lowest)."""
        for future in self.inputs:
            if _failures(future.refs, future.ranks):
                future._raise_for_rank(err)
        for producer, ref in self.adapters:
            found = _failures([ref], [0])
            if found:
                cause = found[0][1]
                raise FutureArgumentError(
                    f"the result of '{producer}' could not be passed into '{self.stage}': "
                    f"{_cause_text(cause)}"
                ) from cause
        failures = _failures(self.refs, self.ranks)
        if not failures:
            failures = [(self.ranks[0] if self.ranks else -1, err)]
        failures.sort(key=lambda f: (not isinstance(f[1], DEAD_ERRORS), f[0]))
        rank, cause = failures[0]
        if self._on_error is not None:
            self._on_error(rank, cause)
        raise WorkerCallError(self.stage, self._describe(rank), cause) from cause


def _failures(refs: list[ObjectRef], ranks: list[int]) -> list[tuple[int, BaseException]]:
    """(rank, error) of every finished ref that holds an error."""
    failures: list[tuple[int, BaseException]] = []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    ready_ids = {r.hex() for r in ready}
    for rank, ref in zip(ranks, refs, strict=True):
        if ref.hex() not in ready_ids:
            continue
        try:
            ray.get(ref, timeout=0)
        except Exception as rank_err:  # noqa: BLE001
            failures.append((rank, rank_err))
    return failures


def _cause_text(cause: BaseException) -> str:
    inner = getattr(cause, "cause", None) or cause
    return f"{type(inner).__name__}: {inner}"


@ray.remote(num_cpus=0)  # type: ignore[untyped-decorator]  # ray is not followed
def _collect_task(collect: CollectFn, state: Any, *outputs: Any) -> Any:
    return collect(list(outputs), state)


@ray.remote(num_cpus=0)  # type: ignore[untyped-decorator]  # ray is not followed
def _rechunk_task(world_size: int, state: Any, *parts: Any) -> tuple[Any, ...]:
    """Concatenate and unpad DP_SPLIT `parts`, then pad and chunk for `world_size` ranks."""
    return _dp_parts(collect_dp(list(parts), state), world_size)


@ray.remote(num_cpus=0)  # type: ignore[untyped-decorator]  # ray is not followed
def _dp_task(world_size: int, collect: CollectFn, state: Any, *outputs: Any) -> tuple[Any, ...]:
    """What DP_SPLIT makes of a collected value: chunks of a Batch, else the value for all."""
    return _dp_parts(collect(list(outputs), state), world_size)


def _dp_parts(value: Any, world_size: int) -> tuple[Any, ...]:
    if not is_batch(value):
        return (None, *([value] * world_size))
    padded, pad = value.pad_to_multiple(world_size)
    return (DPState(pad, len(padded)), *padded.chunk(world_size))


@ray.remote(num_cpus=0)  # type: ignore[untyped-decorator]  # ray is not followed
def _per_rank_task(
    world_size: int, name: str, collect: CollectFn, state: Any, *outputs: Any
) -> Any:
    """What ALL_TO_ALL makes of a collected value: element i for rank i (it must be a list)."""
    parts = all_to_all_parts(collect(list(outputs), state), world_size, name)
    return parts[0] if world_size == 1 else tuple(parts)


def _adapt_dp(future: GroupFuture, world_size: int) -> tuple[Chunks, list[Any]]:
    if future.split and len(future.refs) == world_size:
        return Chunks(list(future.refs), state=future.state), []
    if future.split:
        state = future.state
        out = _rechunk_task.options(num_returns=world_size + 1).remote(
            world_size, state, *future.refs
        )
    else:
        out = _dp_task.options(num_returns=world_size + 1).remote(
            world_size, future.collect, future.state, *future.refs
        )
    return Chunks(list(out[1:]), state=out[0]), [out[0]]


def _adapt_per_rank(future: GroupFuture, world_size: int) -> tuple[Chunks, list[Any]]:
    name = f"(the result of '{future.stage}')"
    if future.collect is collect_list:  # a list of one output per called rank
        all_to_all_parts(future.refs, world_size, name)  # the wrong length fails here
        return Chunks(list(future.refs)), []
    out = _per_rank_task.options(num_returns=world_size).remote(
        world_size, name, future.collect, future.state, *future.refs
    )
    out = [out] if world_size == 1 else list(out)
    return Chunks(out), [out[0]]


def _adapt_whole(future: GroupFuture, world_size: int) -> tuple[ObjectRef, list[Any]]:
    ref = future.ref()
    return ref, ([] if ref in future.refs else [ref])


_ADAPTERS: dict[str, Callable[[GroupFuture, int], tuple[Any, list[Any]]]] = {
    DP_SPLIT: _adapt_dp,
    ALL_TO_ALL: _adapt_per_rank,
}


def adapt_arguments(
    mode: DispatchMode, world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], list[GroupFuture], list[tuple[str, ObjectRef]]]:
    """Replace GroupFuture arguments by what `mode` dispatches (refs, never fetched data).

    Returns the new args and kwargs, the futures found, and (producer stage, ref) of
    every adapter task started, so that their failures can be reported as theirs.
    """
    custom = mode.adapt_future
    adapter = (
        (lambda f, w: (custom(f, w), [])) if custom else _ADAPTERS.get(mode.name, _adapt_whole)
    )
    inputs: list[GroupFuture] = []
    tasks: list[tuple[str, ObjectRef]] = []

    def adapt(value: Any) -> Any:
        if not isinstance(value, GroupFuture):
            return value
        inputs.append(value)
        adapted, refs = adapter(value, world_size)
        tasks.extend((value.stage, r) for r in refs)
        return adapted

    new_args = tuple(adapt(a) for a in args)
    new_kwargs = {k: adapt(v) for k, v in kwargs.items()}
    return new_args, new_kwargs, inputs, tasks
