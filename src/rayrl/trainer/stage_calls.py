"""The group calls of one step, kept so that a replayed step reuses what it can.

`PPOTrainer.step` makes each worker call through `StageCalls.run` (blocking) or
`StageCalls.start` (a future). Each result is kept under (stage, occurrence), so when
the step runs again after a failure (`rayrl.trainer.replay`), the calls that had
finished return their kept result at once: the step's inputs and seeds are the same,
so running them again would give the same result, only later. A call that raised runs
again (its group may be whole, and the failure another's: a reward worker that could
not reach a judge replica that was lost). Calls that change a
group's state (`mutates=True`: the updates) are forgotten when that group is restored
to the step's start, and run again; so are calls of a recovered group still in flight,
and those whose rows stayed with its workers (`GroupMethod.keeping()`).

Before each call the stop check runs (`rayrl.trainer.interrupt`): a first Ctrl-C ends
the step at the next call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class _Kept:
    group: str
    mutates: bool
    value: Any = None
    future: Any = None  # a GroupFuture not yet collected
    collect: Any = None  # instead of the method's own collect
    keeps_rows: bool = False  # its result's token columns stay with the group's workers
    failed: bool = False  # it raised: a replayed step calls it again


class _Started:
    """What `StageCalls.start` returns: `get()` collects (once) and keeps the value."""

    def __init__(self, kept: _Kept) -> None:
        self.kept = kept

    def get(self, timeout: float | None = None) -> Any:
        kept = self.kept
        if kept.future is not None:
            own = kept.collect is None
            try:
                value = kept.future.get(timeout) if own else kept.future.get(timeout, kept.collect)
            except BaseException:
                kept.failed = True  # kept for `forget` to discard; `start` calls anew
                raise
            kept.value, kept.future = value, None
        return kept.value


class StageCalls:
    """Kept results of a step's group calls (see the module docstring)."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, int], _Kept] = {}
        self.counts: Counter[str] = Counter()
        self.stop_check: Callable[[bool], None] = lambda mutated: None

    def new_step(self) -> None:
        """Forget everything: the next calls belong to a new step."""
        self.kept.clear()
        self.counts.clear()

    def new_attempt(self) -> None:
        """The step starts again: calls are matched to the kept ones from the first."""
        self.counts.clear()

    @property
    def mutated(self) -> bool:
        """Whether a call that changes a group's state has finished in this step."""
        return any(k.mutates and k.future is None for k in self.kept.values())

    def run(
        self,
        stage: str,
        method: Any,
        *args: Any,
        mutates: bool = False,
        collect: Any = None,
        **kwargs: Any,
    ) -> Any:
        """`method(*args, **kwargs)` (a group method), or its kept result."""
        return self.start(stage, method, *args, mutates=mutates, collect=collect, **kwargs).get()

    def start(
        self,
        stage: str,
        method: Any,
        *args: Any,
        mutates: bool = False,
        collect: Any = None,
        **kwargs: Any,
    ) -> _Started:
        """`method.remote(*args, **kwargs)`, or the kept call; `.get()` the result,
        collected by `collect` (`(outputs, state) -> value`) instead of the method's
        own collect when given."""
        key = (stage, self.counts[stage])
        self.counts[stage] += 1
        kept = self.kept.get(key)
        if kept is None or kept.failed:
            if kept is not None and kept.future is not None:
                kept.future.discard()
            self.stop_check(self.mutated)
            future = method.remote(*args, **kwargs)
            kept = _Kept(_group_of(method), mutates, future=future, collect=collect)
            kept.keeps_rows = bool(getattr(method, "keeps_rows", False))
            self.kept[key] = kept
        return _Started(kept)

    def forget(self, groups: set[str]) -> None:
        """Drop the calls of `groups` that changed state, had not been collected, or
        left their rows with the group's workers (a replaced worker took them along)."""
        for key, kept in list(self.kept.items()):
            lost = kept.mutates or kept.future is not None or kept.keeps_rows
            if kept.group in groups and lost:
                if kept.future is not None:
                    kept.future.discard()
                del self.kept[key]


def _group_of(method: Any) -> str:
    owner = getattr(method, "_owner", None)
    group = getattr(owner, "group", owner)
    return getattr(group, "name", "")
