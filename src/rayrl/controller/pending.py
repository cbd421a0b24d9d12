"""A worker's value still being filled in behind its call: `Pending`, and `settled`.

A step-boundary snapshot (`Worker.snapshot_state`) is host memory filled from the
device. Copied asynchronously, the call that starts the copy can return before the
bytes are there, and the device works on (the next stage's generation) while they
arrive. Such a value is handed out as a `Pending`: the value and a ``wait`` that
returns once it is complete. Whoever reads the bytes settles it first (`settled`,
which `Worker._rayrl_snapshot_publish` runs before Ray copies the state into the
object store); a `Pending` that is pickled settles itself, so one sent anywhere
unsettled still arrives whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Pending", "settled"]


class Pending:
    """``value``, complete once ``wait()`` has returned."""

    __slots__ = ("_value", "_wait")

    def __init__(self, value: Any, wait: Callable[[], None]) -> None:
        self._value, self._wait = value, wait

    def result(self) -> Any:
        """The value, after waiting for it to be complete."""
        self._wait()
        return self._value

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        return _identity, (self.result(),)


def _identity(value: Any) -> Any:
    return value


def settled(value: Any) -> Any:
    """``value`` with every `Pending` in it (inside dicts, lists and tuples) waited for
    and replaced by its result; a container holding none is returned as it is."""
    if isinstance(value, Pending):
        return settled(value.result())
    if isinstance(value, dict):
        items = {k: settled(v) for k, v in value.items()}
        changed = any(items[k] is not v for k, v in value.items())
        return items if changed else value
    if isinstance(value, list | tuple):
        values = [settled(v) for v in value]
        if all(a is b for a, b in zip(values, value, strict=True)):
            return value
        if hasattr(value, "_fields"):  # a named tuple takes its fields one by one
            return type(value)(*values)
        return type(value)(values)
    return value
