"""`Pending` values: settled where they are read, and whole when pickled unsettled."""

from __future__ import annotations

import pickle
import threading

from rayrl.controller.pending import Pending, settled


def _filled_later(value: int) -> tuple[Pending, dict]:
    box, done = {"value": None}, threading.Event()

    def fill() -> None:
        box["value"] = value
        done.set()

    threading.Timer(0.2, fill).start()
    return Pending(box, done.wait), box


def test_settled_waits_for_every_pending_inside_dicts_lists_and_tuples():
    first, _ = _filled_later(1)
    second, _ = _filled_later(2)
    state = {"a": first, "b": [0, (second, "x")], "c": 3}
    assert settled(state) == {"a": {"value": 1}, "b": [0, ({"value": 2}, "x")], "c": 3}


def test_a_pending_pickled_unsettled_arrives_complete():
    pending, box = _filled_later(5)
    assert box["value"] is None
    assert pickle.loads(pickle.dumps({"state": pending})) == {"state": {"value": 5}}


def test_settled_keeps_containers_without_pending_and_rebuilds_named_tuples():
    from collections import namedtuple

    Pair = namedtuple("Pair", "left right")
    plain = {"a": [1, 2], "b": Pair(3, 4)}
    assert settled(plain) is plain
    pending, _ = _filled_later(6)
    assert settled(Pair(pending, 0)) == Pair({"value": 6}, 0)
