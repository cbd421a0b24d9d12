"""StageCalls: a replayed step reuses the calls that finished and runs the updates of a
restored group again; the stop check runs before each new call only."""

from __future__ import annotations

import pytest

from rayrl.trainer.stage_calls import StageCalls


class Future:
    def __init__(self, value, fail: bool = False) -> None:
        self.value, self.fail, self.discarded = value, fail, False

    def get(self, timeout=None, collect=None):
        if self.fail:
            raise RuntimeError("rank died")
        return self.value if collect is None else collect([self.value], None)

    def discard(self) -> None:
        self.discarded = True


class Method:
    """A group method stand-in: `.remote` counts calls; `_owner.name` is the group."""

    def __init__(self, group: str, fail_first: bool = False) -> None:
        self._owner = type("G", (), {"name": group})()
        self.calls, self.fail_first, self.futures = 0, fail_first, []

    def remote(self, x):
        self.calls += 1
        self.futures.append(Future(x * 10, fail=self.fail_first and self.calls == 1))
        return self.futures[-1]


def test_a_replay_reuses_finished_calls_and_reruns_updates_of_restored_groups():
    calls = StageCalls()
    gen, reward, update = Method("actor"), Method("reward", fail_first=True), Method("actor")
    calls.new_step()
    assert calls.run("gen", gen, 1) == 10
    pending = calls.start("reward", reward, 2)
    assert calls.run("update", update, 3, mutates=True) == 30
    assert calls.mutated
    with pytest.raises(RuntimeError):
        pending.get()
    calls.forget({"actor", "reward"})  # both groups were brought back and restored
    assert reward.futures[0].discarded
    calls.new_attempt()
    assert calls.run("gen", gen, 1) == 10 and gen.calls == 1  # reused: it changed nothing
    assert calls.start("reward", reward, 2).get() == 20 and reward.calls == 2
    assert calls.run("update", update, 3, mutates=True) == 30 and update.calls == 2
    calls.new_step()
    assert calls.run("gen", gen, 1) == 10 and gen.calls == 2  # a new step calls again


def test_a_call_collected_by_the_caller_keeps_what_its_collect_made():
    calls = StageCalls()
    gen = Method("actor")
    calls.new_step()
    assert calls.run("gen", gen, 1, collect=lambda outputs, state: ("mine", outputs)) == (
        "mine",
        [10],
    )
    calls.new_attempt()
    assert calls.run("gen", gen, 1) == ("mine", [10]) and gen.calls == 1  # kept as collected


def test_calls_of_a_group_that_was_not_restored_are_kept():
    calls = StageCalls()
    gen, update = Method("actor"), Method("actor")
    calls.run("gen", gen, 1)
    calls.run("update", update, 1, mutates=True)
    calls.forget({"reward"})
    calls.new_attempt()
    calls.run("gen", gen, 1)
    calls.run("update", update, 1, mutates=True)
    assert gen.calls == 1 and update.calls == 1


def test_the_stop_check_runs_before_each_new_call_with_whether_state_changed():
    calls = StageCalls()
    seen: list[bool] = []
    calls.stop_check = seen.append
    gen, update = Method("actor"), Method("actor")
    calls.run("gen", gen, 1)
    calls.run("update", update, 1, mutates=True)
    calls.run("gen", gen, 2)
    calls.new_attempt()
    calls.run("gen", gen, 1)  # kept: no new call, no check
    assert seen == [False, False, True]


def test_a_kept_call_of_a_recovered_group_runs_again_its_rows_left_with_the_worker():
    calls = StageCalls()
    gen, score = Method("actor"), Method("reward")
    gen.keeps_rows = True  # as `GroupMethod.keeping()`: the rows stayed on the ranks
    score.keeps_rows = True
    calls.new_step()
    assert calls.run("gen", gen, 1) == 10 and calls.run("reward", score, 2) == 20
    calls.forget({"actor"})  # an actor rank was replaced: its kept rows are gone
    calls.new_attempt()
    assert calls.run("gen", gen, 1) == 10 and gen.calls == 2
    assert calls.run("reward", score, 2) == 20 and score.calls == 1  # its group was spared


def test_a_call_that_raised_runs_again_though_its_group_was_not_replaced():
    """A reward call fails because another group lost a worker (the judge replica it
    posts to): the replay replaces that group only, and the reward is called again
    instead of raising its kept error once more."""
    calls = StageCalls()
    reward = Method("reward", fail_first=True)
    calls.new_step()
    with pytest.raises(RuntimeError):
        calls.run("reward", reward, 2)
    calls.forget({"judge"})
    calls.new_attempt()
    assert calls.run("reward", reward, 2) == 20 and reward.calls == 2
    assert reward.futures[0].discarded
