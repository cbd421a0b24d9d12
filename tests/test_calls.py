"""How a call enters a worker, in this process (no Ray): `@register` returns the method
itself; the Worker class wraps its registered methods once, so each call marks the
worker busy, records its span and runs the installed call hooks around it."""

from __future__ import annotations

import asyncio
import inspect
import threading
from contextlib import contextmanager

import pytest
import ray

from rayrl.controller import calls, usage
from rayrl.controller.dispatch import SPEC_ATTR, register
from rayrl.controller.kept import KEEP_KWARG
from rayrl.controller.worker import HEALTH_GROUP, Worker, WorkerContext


def plain(self, x):
    return x


class Mixin:
    """Registered methods from a class that is not a Worker."""

    @register()
    def mixed(self) -> tuple:
        return self._rayrl_busy


class Seen(Mixin, Worker):
    @register()
    def busy(self) -> tuple:
        return self._rayrl_busy

    @register()
    def fail(self) -> None:
        raise ValueError("in the call")

    @register()
    async def later(self) -> tuple | None:
        return getattr(self, "_rayrl_busy", None)

    @register()
    @ray.method(concurrency_group=HEALTH_GROUP)
    def on_health(self) -> int:
        return 1


class Override(Seen):
    def busy(self) -> tuple:  # not registered again: still Seen.busy's contract
        return ("override", *self._rayrl_busy)


@pytest.fixture
def hooks():
    """The call hooks installed during the test; none are left installed after it."""
    before = list(calls._HOOKS)
    yield calls
    calls._HOOKS[:] = before


def worker(cls=Seen):
    w = cls()
    w.ctx = WorkerContext(group="g", role="r", rank=3, world_size=4)
    w._rayrl_busy = None
    return w


def test_register_only_states_the_contract():
    assert register(dispatch="dp_split", blocking=False)(plain) is plain
    spec = getattr(plain, SPEC_ATTR)
    assert (spec.name, spec.mode.name, spec.blocking) == ("plain", "dp_split", False)


def test_a_registered_call_marks_the_worker_busy_and_records_its_span():
    w = worker()
    usage.take_calls()
    name, start, thread = w.busy()
    assert (name, thread) == ("busy", threading.get_ident())
    assert w.mixed()[0] == "mixed"  # inherited from a class that is not a Worker
    assert worker(Override).busy()[:2] == ("override", "busy")
    assert w._rayrl_busy is None
    spans = usage.take_calls()
    assert len(spans) == 3 and spans[0][0] == start <= spans[0][1]
    with pytest.raises(ValueError, match="in the call"):
        w.fail()
    assert w._rayrl_busy is None and len(usage.take_calls()) == 1


def test_each_method_is_wrapped_once_keeping_its_spec_and_ray_options():
    # the wrapper is the innermost function Ray sees: its signature takes the kept flag
    assert Seen.busy.__name__ == "busy" and not hasattr(Seen.busy, "__wrapped__")
    assert KEEP_KWARG in inspect.signature(Seen.busy).parameters
    assert Override.busy is not Seen.busy and Override.fail is Seen.fail
    assert getattr(Seen.busy, SPEC_ATTR).name == "busy"
    assert Seen.on_health.__ray_concurrency_group__ == HEALTH_GROUP
    remote = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(Seen)  # Ray subclasses it
    in_ray = worker(remote.__ray_metadata__.modified_class)
    usage.take_calls()
    assert in_ray.busy()[0] == "busy" and len(usage.take_calls()) == 1  # tracked once
    assert "__wrapped__" not in vars(Seen.later)  # a coroutine method is left as it is
    assert asyncio.run(worker().later()) is None


def test_call_hooks_run_in_order_around_each_call_on_its_thread(hooks):
    seen = []

    def first(w, name):
        seen.append(("first", name, w.ctx.rank, w._rayrl_busy[0]))

    @contextmanager
    def around(w, name):
        seen.append(("enter", name))
        yield
        seen.append(("exit", name, w._rayrl_busy is not None))

    hooks.add_call_hooks([first, around])
    assert hooks.add_call_hooks([first]) == len(hooks._HOOKS)  # installed once
    w = worker()
    w.busy()
    assert seen == [("first", "busy", 3, "busy"), ("enter", "busy"), ("exit", "busy", True)]
    seen.clear()
    assert w._rayrl_snapshot() == 3  # the group's own calls pass through the hooks too
    assert seen == [("first", "snapshot", 3, "snapshot"), ("enter", "snapshot")] + [
        ("exit", "snapshot", True)
    ]


def test_a_hook_that_raises_fails_the_call_before_it_runs(hooks):
    ran = []

    class Refuse:
        def __call__(self, w, name):
            if name == "busy":
                raise RuntimeError("refused")

    class Counted(Seen):
        @register()
        def busy(self) -> tuple:
            ran.append(1)
            return super().busy()

    hooks.add_call_hooks([Refuse()])
    w = worker(Counted)
    with pytest.raises(RuntimeError, match="refused"):
        w.busy()
    assert ran == [] and w._rayrl_busy is None
    assert w.mixed()[0] == "mixed"
