"""Step replay on its own (`rayrl.trainer.replay.StepReplay`), with no trainer: a toy
stateful group on real Ray, a worker process SIGKILLed mid-step, and the step run again
from the step boundary's snapshot, the driver's parts and the kept calls."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

from controller_toys import Tally
from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import PoolSpec, ResourcePool
from rayrl.controller import ONE_TO_ALL, Worker, WorkerGroup, register
from rayrl.trainer.replay import ReplayPolicy, Rewound, StepReplay, WorkerRestartLimitError
from rayrl.trainer.stage_calls import StageCalls


class Counter(Worker):
    """A value per rank that steps change; dies on purpose where a marker file says."""

    def init_worker(self) -> None:
        self.value = 0

    @register(dispatch=ONE_TO_ALL)
    def add(self, amount: int) -> int:
        self.value += amount
        return self.value

    @register(dispatch=ONE_TO_ALL)
    def read(self, die_once_at: str = "") -> int:
        """The value; SIGKILLs this process first when rank 1 finds `die_once_at` absent
        (creating it, so the replacement lives)."""
        if die_once_at and self.rank == 1 and not os.path.exists(die_once_at):
            Path(die_once_at).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return self.value

    @register(dispatch=ONE_TO_ALL)
    def always_die(self) -> None:
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def snapshot_state(self) -> int:
        return self.value

    def restore_state(self, state: int) -> None:
        self.value = state


@pytest.fixture
def counters(ray_local):
    run = f"replay-{uuid.uuid4().hex[:6]}"
    pool = ResourcePool(PoolSpec("counter", per_node=[2], bundle={"CPU": 0.5}), run)
    pool.bootstrap(timeout_s=60)
    kv = KVStore.create(run)
    group = WorkerGroup(Counter, pool.bundles, role="counter", run=run, kv=kv, pool=pool)
    group.create(timeout_s=180)
    group.init(timeout_s=180)
    try:
        yield group
    finally:
        group.shutdown()
        pool.teardown()
        kv.shutdown()


def _replay(group, calls, snapshots=True, max_restarts=2, rewind=None, printed=None):
    """A started StepReplay whose first snapshot is stored (a rank killed before its
    snapshot reached the object store leaves none: that is the rewind's case)."""
    policy = ReplayPolicy(max_restarts=max_restarts, snapshots=snapshots, init_timeout_s=180)
    rewound = rewind or (lambda reason: pytest.fail(f"unexpected rewind: {reason}"))
    say = printed.append if printed is not None else (lambda text: None)
    replay = StepReplay([group], [group], calls, policy, rewound, say)
    replay.start()
    for snapshot in replay.snapshots.values():
        snapshot.wait_stored(group)
    return replay


def test_a_killed_rank_is_replaced_and_the_step_runs_again_from_its_boundary(counters, tmp_path):
    calls, tally, printed = StageCalls(), Tally(), []
    replay = _replay(counters, calls, printed=printed)
    marker = str(tmp_path / "died")
    pid_before = counters.describe(1).pid

    def step():
        tally.count += 1  # driver state the step changes: put back before each attempt
        added = calls.run("add", counters.add, 5, mutates=True)
        seen = calls.run("read", counters.read, marker)  # rank 1 dies here, once
        return {"added": added, "seen": seen}, ["p0", "p1"]

    metrics = replay.run_step(0, step, {"tally": tally})
    # restored to the boundary (0) and the update ran again: 5, not 10
    assert metrics["added"] == [5, 5] and metrics["seen"] == [5, 5]
    assert counters.read() == [5, 5]
    assert tally.count == 1  # one attempt's worth, not two
    assert counters.describe(1).pid != pid_before
    assert replay.ledger == [(0, ["p0", "p1"])]
    [record] = replay.recoveries
    assert record["stage"] == "read" and record["replaced"][0]["rank"] == 1
    assert any("recovering from a worker failure in step 1" in line for line in printed)
    assert "timing_s/snapshot" in metrics

    # the next step starts from the new boundary
    metrics = replay.run_step(1, lambda: ({"added": counters.add(1)}, []), {})
    assert metrics["added"] == [6, 6]


def test_without_a_snapshot_the_run_rewinds(counters, tmp_path):
    calls, rewinds = StageCalls(), []

    def rewind(reason: str) -> int:
        rewinds.append(reason)
        return 3

    replay = _replay(counters, calls, snapshots=False, rewind=rewind)
    replay.ledger = [(s, [f"p{s}"]) for s in range(4)]  # steps 0-3 done
    marker = str(tmp_path / "died")

    def step():
        calls.run("add", counters.add, 1, mutates=True)
        return {"seen": calls.run("read", counters.read, marker)}, []

    with pytest.raises(Rewound) as info:
        replay.run_step(4, step, {})
    assert info.value.step == 3 and rewinds and "no step snapshot" in rewinds[0]
    # the run continues at step 3: what steps 3 on trained is recorded again, not twice
    assert replay.ledger == [(0, ["p0"]), (1, ["p1"]), (2, ["p2"])]


def test_a_rank_that_always_dies_stops_at_the_restart_limit(counters):
    calls = StageCalls()
    replay = _replay(counters, calls, max_restarts=1)
    with pytest.raises(WorkerRestartLimitError, match="rank 1 failed 2 times in 'always_die'"):
        replay.run_step(0, lambda: (calls.run("die", counters.always_die) or {}, []), {})


def test_a_fault_in_a_later_step_restores_that_steps_boundary(counters, tmp_path):
    """Replay after a fault in step 1 goes back to the boundary after step 0, not to the
    first snapshot: 5 + 3, not 3 (nor 5 + 3 + 3)."""
    calls = StageCalls()
    replay = _replay(counters, calls)
    replay.run_step(0, lambda: ({"added": calls.run("add", counters.add, 5, mutates=True)}, []), {})
    # step 0's boundary stored whole before the fault (on a loaded machine the store can
    # lag: a rank lost meanwhile goes back to the boundary before, which the
    # two-machine tests cover)
    for snapshot in replay.snapshots.values():
        snapshot.wait_stored(counters)
    marker = str(tmp_path / "died")

    def step():
        added = calls.run("add", counters.add, 3, mutates=True)
        return {"added": added, "seen": calls.run("read", counters.read, marker)}, []

    metrics = replay.run_step(1, step, {})
    assert len(replay.recoveries) == 1
    assert metrics["seen"] == [8, 8] and counters.read() == [8, 8]


def test_snapshots_are_weighed_node_by_node():
    """`step_snapshots=auto`: each node's ranks' snapshots against that node's own object
    store (they go there), not the cluster's sum against the cluster's total."""
    from rayrl.trainer.replay import nodes_over

    stores = {"a": 10.0, "b": 10.0}
    assert nodes_over({"a": 4, "b": 4}, stores, 0.5) == {}
    # 9 bytes fit half of the cluster's 20, but node a holds 6 of them in its 10
    assert nodes_over({"a": 6, "b": 3}, stores, 0.5) == {"a": (6, 10.0)}
    assert nodes_over({"?": 6}, {"a": 10.0, "b": 40.0}, 0.5) == {"?": (6, 10.0)}


def test_snapshot_copies_are_weighed_on_their_buddy_nodes():
    """`trainer.snapshot_replicas`: a rank's copy counts against its buddy node's store,
    so with one copy each of two nodes holds both nodes' snapshots."""
    from rayrl.trainer.replay import bytes_by_node, nodes_over

    homes, sizes = ["a", "a", "b"], [3, 3, 4]
    assert bytes_by_node(homes, sizes, ["a", "b"], 0) == {"a": 6, "b": 4}
    need = bytes_by_node(homes, sizes, ["a", "b"], 1)
    assert need == {"a": 10, "b": 10}
    assert nodes_over(need, {"a": 16.0, "b": 30.0}, 0.5) == {"a": (10, 16.0)}
    assert bytes_by_node(["a", "a"], [3, 3], ["a"], 1) == {"a": 6}  # one node: no copy


def test_a_rank_lost_before_the_first_snapshot_is_replaced_and_the_run_rewinds(counters):
    """A worker killed before the run's first boundary (while `step_snapshots=auto`
    sizes the snapshots) is replaced; with no snapshot yet the run goes back to its
    start, the snapshots are taken then, and `on_replaced` saw the new worker."""
    calls, rewinds, seen_pids = StageCalls(), [], []
    victim = counters.describe(1).pid
    os.kill(victim, signal.SIGKILL)  # a real process on this machine, dead before start()

    def rewind(reason: str) -> int:
        rewinds.append(reason)
        return 0

    policy = ReplayPolicy(max_restarts=2, snapshots="auto", init_timeout_s=180)
    replay = StepReplay(
        [counters],
        [counters],
        calls,
        policy,
        rewind,
        on_replaced=lambda: seen_pids.append(counters.describe(1).pid),
    )
    replay.start()
    assert replay.use_snapshots is True and counters.name in replay.snapshots
    assert len(rewinds) == 1 and "no step snapshot" in rewinds[0]
    [record] = replay.recoveries
    assert record["what"] == "the first snapshot" and record["replaced"][0]["rank"] == 1
    assert seen_pids and seen_pids[0] not in (None, victim)
    assert counters.read() == [0, 0]
