"""Signals: the pool's SIGINT/SIGTERM hooks never recurse nor swallow a signal, and a
KeyboardInterrupt handler runs before the pools go; `StopOnInterrupt`: a first Ctrl-C
asks for a safe stop, a second stops at once. Each case runs in its own process, which
first puts back Python's own SIGINT handler: a process started with SIGINT ignored (a
background job of a non-interactive shell, as a CI script may start the suite) keeps it
ignored, and the cases are about what the hooks do over Python's usual handler.
Signals are sent with `signal.raise_signal`, which runs the handler before it returns."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from rayrl.trainer.interrupt import StopOnInterrupt, StopRequested

# A process with one fake live pool (teardown prints) and the pool's signal hooks.
PRELUDE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive start has it
from rayrl.cluster import pool as P

class Fake:
    name = "fake"
    def teardown(self):
        print("TEARDOWN", flush=True)

def hooks():  # what reserving a pool does
    P._register(Fake())
"""

CASES = {
    # ray.init-style wrapper around ours, installed after: a loop of two handlers.
    "recursion": """
def wrapper(signum, frame):
    print("WRAPPER", flush=True)
    chained(signum, frame)
hooks()
chained = signal.getsignal(signal.SIGINT)
signal.signal(signal.SIGINT, wrapper)
hooks()  # a second pool: ours again on top of the wrapper
try:
    signal.raise_signal(signal.SIGINT)
except KeyboardInterrupt:
    print("KEYBOARD-INTERRUPT", flush=True)
""",
    # The previous SIGTERM handler was installed from C: getsignal() says None.
    "none_previous": """
signal.signal(signal.SIGTERM, signal.SIG_DFL)
hooks()
P._PREVIOUS[signal.SIGTERM] = None
signal.raise_signal(signal.SIGTERM)
print("SURVIVED", flush=True)
""",
    # Ctrl-C with Python's handler: the program's except runs while the pools live.
    "sigint_first": """
hooks()
try:
    signal.raise_signal(signal.SIGINT)
except KeyboardInterrupt:
    print("EXCEPT-BEFORE-TEARDOWN", flush=True)
""",
    # An ignored signal stays ignored.
    "ignored": """
signal.signal(signal.SIGTERM, signal.SIG_IGN)
hooks()
signal.raise_signal(signal.SIGTERM)
print("IGNORED", flush=True)
""",
}


def _run(case: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + CASES[case]], capture_output=True, text=True, timeout=60
    )


def test_a_chain_looping_back_to_the_pool_hook_ends_instead_of_recursing():
    done = _run("recursion")
    assert "RecursionError" not in done.stderr, done.stderr[-2000:]
    lines = done.stdout.split()
    assert lines[:2] == ["WRAPPER", "KEYBOARD-INTERRUPT"], done.stdout  # pools go at exit


def test_a_previous_handler_installed_from_c_is_not_swallowed():
    done = _run("none_previous")
    assert "TEARDOWN" in done.stdout and "SURVIVED" not in done.stdout
    assert done.returncode == -signal.SIGTERM


def test_ctrl_c_reaches_the_programs_except_before_any_pool_is_released():
    done = _run("sigint_first")
    assert done.stdout.split() == ["EXCEPT-BEFORE-TEARDOWN", "TEARDOWN"], done.stdout + done.stderr


def test_an_ignored_signal_stays_ignored():
    done = _run("ignored")
    assert done.stdout.split() == ["IGNORED", "TEARDOWN"] and done.returncode == 0


def test_first_ctrl_c_asks_for_a_safe_stop_and_the_second_stops_at_once():
    said: list[str] = []
    before = signal.getsignal(signal.SIGINT)
    with StopOnInterrupt(said.append) as stop:
        stop.check()  # nothing asked yet
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and "Ctrl-C again" in said[0]
        stop.check(mutated=True, can_undo=False)  # an update ran, nothing to undo with
        with pytest.raises(StopRequested):
            stop.check(mutated=True, can_undo=True)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before  # given back at once
    assert signal.getsignal(signal.SIGINT) is before


def test_sigterm_asks_for_the_same_safe_stop_and_a_second_exits_143():
    said: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    with StopOnInterrupt(said.append) as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.exit_code == 143 and "SIGTERM again" in said[0]
        with pytest.raises(StopRequested):
            stop.check()
        with pytest.raises(SystemExit) as info:
            signal.raise_signal(signal.SIGTERM)
        assert info.value.code == 143
        assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGTERM) is before
