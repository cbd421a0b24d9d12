"""Health checks and replacement paths on real Ray: an alive but silent worker, the
monitor's on_failure callback, a check racing a replacement, retries of a failing
replacement, and a lost bundle with no spare left."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from controller_toys import Flaky, SlowBeat, reserve
from rayrl.controller import (
    HealthMonitor,
    NoSpareBundleError,
    WorkerGroup,
    WorkerInitError,
)


@pytest.fixture
def run_pool(ray_local):
    run = f"health-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [2], {"CPU": 0.25})
    yield run, pool
    pool.teardown()


def test_alive_but_silent_rank_is_unresponsive_and_reported_once(run_pool):
    run, pool = run_pool
    with WorkerGroup(SlowBeat, pool.bundles[:1], role="s", run=run, kwargs={"beat_s": 30}) as group:
        group.create(timeout_s=120)
        reports = []
        monitor = HealthMonitor(group, timeout_s=0.5, on_failure=reports.append)
        report = monitor.check()
        assert report.unresponsive.keys() == {0} and not report.dead and not report.alive
        assert "missed heartbeat" in report.summary()
        assert reports == [report] and monitor.failed == {0}
        assert group.dead == set()  # silent is not dead: no replacement is implied
        monitor.clear(0)
        assert monitor.failed == set()


def test_health_check_racing_a_replacement_raises_no_false_alarm(run_pool):
    run, pool = run_pool
    with WorkerGroup(SlowBeat, pool.bundles, role="s", run=run, kwargs={"beat_s": 1.5}) as group:
        group.create(timeout_s=120)
        reports = []
        monitor = HealthMonitor(group, timeout_s=10, on_failure=reports.append)
        checking = threading.Thread(target=monitor.check)
        checking.start()
        time.sleep(0.5)  # the check's heartbeats are now out, rank 1's to the old process
        done = group.replace(1)
        checking.join(timeout=30)
        assert done.old_pid != done.new_pid
        assert monitor.last.failed == [] and monitor.last.replacing == [1], monitor.last
        assert monitor.failed == set() and reports == [] and group.dead == set()
        assert group.check_health(timeout_s=10).ok


def test_replace_retries_a_failing_init_and_reports_without_them(run_pool, tmp_path):
    run, pool = run_pool
    marker = str(tmp_path / "count")
    kwargs = dict(marker=marker, bad_rank=1, fail_on=(1, 2))  # the 2nd and 3rd inits fail
    with WorkerGroup(Flaky, pool.bundles, role="f", run=run) as group:
        group.create(timeout_s=120).init(timeout_s=60, **kwargs)
        with pytest.raises(WorkerInitError, match="replace"):
            group.replace(1, timeout_s=60)  # init call 2 fails, no retry
        done = group.replace(1, timeout_s=60, retries=1)  # call 3 fails, call 4 passes
        assert done.rank == 1 and (tmp_path / "count").read_text() == "4"
        assert [w["rank"] for w in group.whoami()] == [0, 1]


def test_lost_bundle_without_spares_gets_a_new_one_or_says_how_to_reserve_spares(run_pool):
    run, pool = run_pool
    with WorkerGroup(Flaky, pool.bundles[:1], role="f", run=run, pool=pool) as group:
        group.create(timeout_s=120)
        remove_placement_group(pool.bundles[0].pg)  # the rank's bundle is gone, no spare
        done = group.replace(0)  # a new placement where the cluster has room
        assert done.spare_used and group.bundles[0].pg.id != pool.bundles[0].pg.id
        assert group.whoami()[0]["rank"] == 0
        remove_placement_group(group.bundles[0].pg)  # gone again, and now no room at all
        time.sleep(1.0)
        free = ray.available_resources().get("CPU", 0)
        hog = placement_group([{"CPU": free}]) if free else None
        try:
            assert hog is None or hog.wait(30)
            group.placement_timeout_s = 2.0
            with pytest.raises(NoSpareBundleError, match="capacity_factor") as info:
                group.replace(0)
        finally:
            if hog is not None:
                remove_placement_group(hog)
        assert "rank 0's bundle" in str(info.value) and pool.name in str(info.value)
