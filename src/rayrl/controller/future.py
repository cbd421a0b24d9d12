"""GroupFuture: the pending result of a non-blocking group call, one ObjectRef per rank.

`future.get()` gathers and collects on the driver. Passed as an argument to another
group's call, a future is never fetched by the driver: each dispatch mode says what
it makes of one (an adapter):

- DP_SPLIT, same world size: rank i of the new call gets rank i's ref as it is, and
  the padding bookkeeping travels along, so results still unpad correctly;
- DP_SPLIT, another world size: a light remote task concatenates, re-pads and
  re-chunks the parts into one ref per new rank;
- ALL_TO_ALL: rank i gets rank i's ref (the world sizes must match);
- any other mode: a remote task collects the parts into one ref that every rank gets
  (a single-ref RANK_ZERO future is passed as it is).

Ray resolves the refs inside the receiving workers, so data moves worker to worker
through the object store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray import ObjectRef

from rayrl.controller.dispatch import (
    ALL_TO_ALL,
    DP_SPLIT,
    Chunks,
    CollectFn,
    DispatchMode,
    DPState,
    collect_dp,
)
from rayrl.controller.errors import (
    DEAD_ERRORS,
    GroupTimeoutError,
    WorkerCallError,
    WorkerDescription,
)


class GroupFuture:
    """Per-rank ObjectRefs of one group call plus how to collect them.

    `refs[i]` is the output of rank `ranks[i]`. `split` is true when the outputs are
    DP_SPLIT chunks (`state` then says how much padding to drop, possibly as a ref).
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
    ) -> None:
        self.refs = refs
        self.ranks = ranks
        self.collect = collect
        self.state = state
        self.split = split
        self.stage = stage
        self._describe = describe or (lambda rank: WorkerDescription(role="?", rank=rank))
        self._on_error = on_error

    def __repr__(self) -> str:
        return f"GroupFuture({self.stage!r}, ranks={self.ranks})"

    def __len__(self) -> int:
        return len(self.refs)

    def __reduce__(self) -> tuple:
        raise TypeError(
            f"a GroupFuture ({self.stage!r}) cannot be sent to a worker inside another value; "
            "pass it as a top-level argument of a group call (group.method(future)) so its "
            "refs go worker to worker, or call future.ref() for one ObjectRef of its result"
        )

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank, then collect. A failed rank raises WorkerCallError;
        ranks still running after `timeout` seconds raise GroupTimeoutError naming them."""
        try:
            outputs = ray.get(self.refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError as err:
            raise self._timeout_error(timeout) from err
        except Exception as err:  # noqa: BLE001 - translated to the failing rank below
            self._raise_for_rank(err)
        state = ray.get(self.state) if isinstance(self.state, ObjectRef) else self.state
        return self.collect(outputs, state)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every rank finished within `timeout` seconds (does not fetch)."""
        ready, _ = ray.wait(
            self.refs, num_returns=len(self.refs), timeout=timeout, fetch_local=False
        )
        return len(ready) == len(self.refs)

    def ref(self) -> ObjectRef:
        """One ObjectRef of the collected value, computed by a remote task (not the driver)."""
        if len(self.refs) == 1 and self.state is None and not self.split:
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
        """Find the rank that failed (a dead one first, then the lowest) and raise for it."""
        failures: list[tuple[int, BaseException]] = []
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0, fetch_local=False)
        ready_ids = {r.hex() for r in ready}
        for rank, ref in zip(self.ranks, self.refs, strict=True):
            if ref.hex() not in ready_ids:
                continue
            try:
                ray.get(ref, timeout=0)
            except Exception as rank_err:  # noqa: BLE001
                failures.append((rank, rank_err))
        if not failures:
            failures = [(self.ranks[0] if self.ranks else -1, err)]
        failures.sort(key=lambda f: (not isinstance(f[1], DEAD_ERRORS), f[0]))
        rank, cause = failures[0]
        if self._on_error is not None:
            self._on_error(rank, cause)
        raise WorkerCallError(self.stage, self._describe(rank), cause) from cause


@ray.remote(num_cpus=0)
def _collect_task(collect: CollectFn, state: Any, *outputs: Any) -> Any:
    return collect(list(outputs), state)


@ray.remote(num_cpus=0)
def _rechunk_task(world_size: int, state: Any, *parts: Any) -> tuple:
    """Concatenate and unpad `parts`, then pad and chunk for `world_size` ranks."""
    merged = collect_dp(list(parts), state)
    padded, pad = merged.pad_to_multiple(world_size)
    return (DPState(pad, len(padded)), *padded.chunk(world_size))


def rechunk(future: GroupFuture, world_size: int) -> Chunks:
    """Re-split a future's outputs into `world_size` chunks inside the cluster."""
    state = future.state if future.split else None
    parts = future.refs if future.split else [future.ref()]
    out = _rechunk_task.options(num_returns=world_size + 1).remote(world_size, state, *parts)
    return Chunks(list(out[1:]), state=out[0])


def _adapt_dp(future: GroupFuture, world_size: int) -> Chunks:
    if future.split and len(future.refs) == world_size:
        return Chunks(list(future.refs), state=future.state)
    return rechunk(future, world_size)


def _adapt_per_rank(future: GroupFuture, world_size: int) -> Chunks:
    if len(future.refs) != world_size:
        raise ValueError(
            f"ALL_TO_ALL got a future of '{future.stage}' with {len(future.refs)} parts for a "
            f"world of {world_size}; pass futures from a group of the same size"
        )
    return Chunks(list(future.refs))


def _adapt_whole(future: GroupFuture, world_size: int) -> ObjectRef:
    return future.ref()


_ADAPTERS: dict[str, Callable[[GroupFuture, int], Any]] = {
    DP_SPLIT: _adapt_dp,
    ALL_TO_ALL: _adapt_per_rank,
}


def adapt_arguments(mode: DispatchMode, world_size: int, args: tuple, kwargs: dict) -> tuple:
    """Replace GroupFuture arguments by what `mode` dispatches (refs, never fetched data)."""
    adapter = mode.adapt_future or _ADAPTERS.get(mode.name, _adapt_whole)

    def adapt(value: Any) -> Any:
        return adapter(value, world_size) if isinstance(value, GroupFuture) else value

    return tuple(adapt(a) for a in args), {k: adapt(v) for k, v in kwargs.items()}
