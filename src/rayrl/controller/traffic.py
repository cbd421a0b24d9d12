"""Bytes through the driver: what group calls send to workers and fetch back, counted.

At scale the driver must carry little more than scalars; this is how a bench (or a
test) checks what it really carries. Off by default, and then free: nothing is
measured until a `counting()` block is entered in the driver process::

    with traffic.counting() as seen:
        trainer.step(...)
    seen.sent["compute_log_prob"], seen.received["generate"], seen.total

Counted where the driver hands data to Ray or takes it back: each argument a group
call sends to a rank (an argument shared by several ranks once, where it is
`ray.put` once), and each output a `GroupFuture.get()` fetches. An ObjectRef
argument is not counted: its data goes worker to worker. A value's size is what
pickle protocol 5 makes of it, as Ray serialises it: the in-band bytes plus the
out-of-band buffers (a Batch's tensors), measured without copying the buffers.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ray import ObjectRef, cloudpickle

__all__ = [
    "Traffic",
    "count_received",
    "count_sent",
    "counting",
    "paused",
    "serialized_nbytes",
]


@dataclass
class Traffic:
    """Bytes sent to and received from workers, by method name, while counting; and
    the driver CPU seconds spent measuring them (`cost_s`), which a caller timing the
    driver can take off."""

    sent: Counter[str] = field(default_factory=Counter)
    received: Counter[str] = field(default_factory=Counter)
    cost_s: float = 0.0

    @property
    def total(self) -> int:
        """Every byte counted, both ways."""
        return sum(self.sent.values()) + sum(self.received.values())


_active: list[Traffic] = []


@contextlib.contextmanager
def counting() -> Iterator[Traffic]:
    """Count the driver's group-call traffic inside the block (nested blocks each count)."""
    seen = Traffic()
    _active.append(seen)
    try:
        yield seen
    finally:
        _active.remove(seen)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Count nothing inside the block (a bench measuring a batch's size, say)."""
    active = list(_active)
    _active.clear()
    try:
        yield
    finally:
        _active.extend(active)


def count_sent(method: str, values: Iterable[Any]) -> None:
    """Count `values` as sent to a worker by a call of `method` (ObjectRefs: nothing)."""
    if _active:
        _add("sent", method, values)


def count_received(method: str, values: Iterable[Any]) -> None:
    """Count `values` as fetched from workers by the driver for a call of `method`."""
    if _active:
        _add("received", method, values)


def _add(way: str, method: str, values: Iterable[Any]) -> None:
    start = time.process_time()
    nbytes = sum(serialized_nbytes(v) for v in values if not isinstance(v, ObjectRef))
    spent = time.process_time() - start
    for seen in _active:
        getattr(seen, way)[method] += nbytes
        seen.cost_s += spent


def serialized_nbytes(value: Any) -> int:
    """Bytes of `value` serialised as Ray does (pickle 5: in-band plus out-of-band)."""
    buffers: list[Any] = []
    inband = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return len(inband) + sum(memoryview(b).nbytes for b in buffers)
