"""The watchdog on real Ray: a call that keeps reporting progress may outlast the stage
deadline; one that sleeps forever is reported (role, rank, pid, log file, the stack of
its busy thread) within the deadline plus one check, then replaced."""

from __future__ import annotations

import time
import uuid

import pytest

from controller_toys import Progressing, reserve
from rayrl.controller import WorkerGroup
from rayrl.controller.errors import WorkerHungError
from rayrl.testing.faults import Fault, inject


def test_a_call_without_progress_is_reported_with_its_stack_then_replaced(ray_local):
    run = f"watch-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [2], {"CPU": 0.25})
    try:
        with WorkerGroup(Progressing, pool.bundles, role="w", run=run, pool=pool) as group:
            group.create(timeout_s=120).init(timeout_s=60)
            group.stage_timeout_s = 1.5
            assert group.ticking(3.0) == [0, 1]  # twice the deadline, but moving
            pids = group.work()
            inject(group, Fault("work", "hang", ranks=(1,)))
            start = time.monotonic()
            with pytest.raises(WorkerHungError) as info:
                group.work()
            assert time.monotonic() - start < 1.5 + 2 * group.watchdog.check_every_s + 5
            err = info.value
            assert (err.role, err.rank, err.pid) == ("w", 1, pids[1]) and err.log_file
            assert "no progress in work" in str(err) and "_hang_forever" in err.stack
            assert "in work" in err.stack.splitlines()[0] and "stage_timeout_s" in str(err)
            done = group.replace(1)  # the hung process is killed first
            assert done.old_pid == pids[1] != done.new_pid
            assert group.work()[0] == pids[0]
    finally:
        pool.teardown()
