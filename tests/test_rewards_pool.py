"""RewardPool: real spawned processes; raising, hanging, slow, dying and badly returning functions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rayrl.rewards import RewardPool, RewardPoolError
from rayrl.rewards.loader import RewardFunctionError

TIMEOUT_S = 2.0  # the hang test waits this long; the slow call below sleeps 0.3 s

# One reward file whose behaviour is chosen by data_source, so one pool covers every case.
BEHAVIOURS = """
import os, subprocess, sys, time
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "value":
        return {"score": float(solution_str), "acc": float(solution_str == ground_truth)}
    if data_source == "raise":
        raise ValueError(f"cannot parse {solution_str!r}")
    if data_source == "hang":
        Path(extra_info["pid_file"]).write_text(str(os.getpid()))
        if extra_info.get("child"):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            Path(extra_info["child"]).write_text(str(child.pid))
        time.sleep(600)
    if data_source == "slow":
        time.sleep(extra_info["sleep_s"])
        return 1.0
    if data_source == "text":
        return "high"
    if data_source == "nan":
        return float("nan")
    if data_source == "no-score":
        return {"acc": 1.0}
    if data_source == "unpicklable":
        return {"score": 1.0, "handle": (lambda: 0)}
    if data_source == "exit":
        os._exit(7)
    return True
"""


def alive(pid: int) -> bool:
    """Whether `pid` is a live (non-zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_dead(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def item(source: str, solution: str = "0", truth: str = "0", **extra) -> dict:
    return dict(data_source=source, solution_str=solution, ground_truth=truth, extra_info=extra)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "behaviours.py"
    path.write_text(textwrap.dedent(BEHAVIOURS))
    return path


@pytest.fixture(scope="module")
def pool(reward_file):
    with RewardPool((str(reward_file), "compute_score"), num_workers=2, timeout_s=TIMEOUT_S) as p:
        yield p


def test_results_come_back_in_order_with_extras_and_counters(pool):
    before = pool.stats()
    values = [str(v) for v in range(40)]
    results = pool.score([item("value", v, truth="7") for v in values])
    assert [r.score for r in results] == [float(v) for v in values]
    assert [r.extra["acc"] for r in results] == [float(v == "7") for v in values]
    assert all(r.ok and r.elapsed_s >= 0 for r in results)
    after = pool.stats()
    assert after["calls"] - before["calls"] == 40 and after["errors"] == before["errors"]
    assert pool.score([]) == []


def test_failures_become_zero_scores_with_errors(pool):
    before = pool.stats()
    results = pool.score(
        [
            item("raise", "x"),
            item("text"),
            item("nan"),
            item("no-score"),
            item("unpicklable"),
            item("value", "2.5"),
            item("bool"),
        ]
    )
    errors = [r.error for r in results]
    assert errors[0] == "ValueError: cannot parse 'x'"
    assert "must return a number or a dict" in errors[1] and "str: 'high'" in errors[1]
    assert "non-finite score" in errors[2]
    assert "without a 'score' key" in errors[3]
    assert "could not be sent back" in errors[4]
    assert errors[5] is None and results[5].score == 2.5
    assert errors[6] is None and results[6].score == 1.0  # True counts as 1
    assert [r.score for r in results[:5]] == [0.0] * 5
    after = pool.stats()
    assert after["errors"] - before["errors"] == 5 and after["timeouts"] == before["timeouts"]


def test_a_hung_call_times_out_its_process_is_killed_and_the_pool_goes_on(pool, tmp_path):
    before = pool.stats()
    pid_file, child_file = tmp_path / "pid", tmp_path / "child"
    items = [item("value", str(i)) for i in range(10)]
    items[3] = item("hang", pid_file=str(pid_file), child=str(child_file))
    started = time.monotonic()
    results = pool.score(items)
    took = time.monotonic() - started

    assert results[3].error == f"timed out after {TIMEOUT_S:g} s" and results[3].score == 0.0
    assert TIMEOUT_S <= results[3].elapsed_s < TIMEOUT_S + 3.0
    assert took < TIMEOUT_S + 6.0  # the batch waits for the timeout, not for the hang
    assert [r.score for i, r in enumerate(results) if i != 3] == [
        float(i) for i in range(10) if i != 3
    ]
    hung = int(pid_file.read_text())
    assert wait_dead(hung), "the hung worker process is still running"
    assert wait_dead(int(child_file.read_text())), "what the hung function started survived"
    assert hung not in pool.pids
    after = pool.stats()
    assert after["timeouts"] - before["timeouts"] == 1
    assert after["restarts"] - before["restarts"] == 1
    assert [r.score for r in pool.score([item("value", "5"), item("value", "6")])] == [5.0, 6.0]


def test_a_slow_call_within_the_timeout_is_fine(pool):
    before = pool.stats()
    results = pool.score([item("slow", sleep_s=0.3), item("value", "1"), item("slow", sleep_s=0.3)])
    assert [r.error for r in results] == [None, None, None]
    assert [r.score for r in results] == [1.0, 1.0, 1.0]
    # elapsed_s is timed by the pool, not the sleep: a few ms of clock skew either way
    assert results[0].elapsed_s >= 0.25 and results[2].elapsed_s >= 0.25
    assert pool.stats()["timeouts"] == before["timeouts"]


def test_a_worker_that_dies_is_replaced_and_the_sample_reported(pool):
    before = pool.stats()
    results = pool.score([item("value", "1"), item("exit"), item("value", "3")])
    assert "died (exit code 7)" in results[1].error and results[1].score == 0.0
    assert [results[0].score, results[2].score] == [1.0, 3.0]
    assert pool.stats()["restarts"] - before["restarts"] == 1
    assert pool.score([item("value", "4")])[0].score == 4.0


def test_samples_queued_behind_a_hang_or_a_crash_are_scored_by_the_next_worker(
    reward_file, tmp_path
):
    """One worker with samples sent ahead: a hang or an exit costs its own sample only;
    the ones queued behind it are scored by the replacement."""
    with RewardPool((str(reward_file), "compute_score"), num_workers=1, timeout_s=1.0) as pool:
        items = [item("value", str(i)) for i in range(12)]
        items[2] = item("hang", pid_file=str(tmp_path / "pid"))
        items[7] = item("exit")
        results = pool.score(items)
        assert results[2].error == "timed out after 1 s"
        assert "died (exit code 7)" in results[7].error
        assert [r.score for i, r in enumerate(results) if i not in (2, 7)] == [
            float(i) for i in range(12) if i not in (2, 7)
        ]
        assert pool.stats()["restarts"] == 2 and pool.stats()["timeouts"] == 1


def test_each_queued_sample_has_its_own_timeout(reward_file):
    """Three samples of 0.6 s queued on one worker with a 1 s timeout: 1.8 s in all, yet
    none timed out, since each one's time starts when the one before it is answered."""
    with RewardPool((str(reward_file), "compute_score"), num_workers=1, timeout_s=1.0) as pool:
        results = pool.score([item("slow", sleep_s=0.6) for _ in range(3)])
        assert [r.error for r in results] == [None, None, None]
        assert all(0.5 <= r.elapsed_s < 1.0 for r in results)
        assert pool.stats()["timeouts"] == 0


def test_builtin_registry_spec_and_unknown_sources(tmp_path):
    with RewardPool(None, num_workers=1, timeout_s=5.0) as pool:
        results = pool.score(
            [
                item("openai/gsm8k", "#### 72", "72"),
                item("arithmetic", "18", "19"),
                item("gsm8", "#### 1", "1"),
            ]
        )
        pids = pool.pids
    assert [r.score for r in results] == [1.0, 0.1, 0.0]
    assert results[0].extra == {"acc": 1.0}
    assert results[2].error.startswith("UnknownDataSourceError: No built-in reward scorer")
    assert "Did you mean 'gsm8k'" in results[2].error
    assert all(wait_dead(pid) for pid in pids), "close() left worker processes running"
    with pytest.raises(RewardPoolError, match="after close"):
        pool.score([item("gsm8k")])
    pool.close()  # idempotent


def test_bad_specs_and_items_fail_in_the_caller(tmp_path, pool):
    with pytest.raises(RewardFunctionError, match="no such file"):
        RewardPool((str(tmp_path / "missing.py"), "compute_score"))
    with pytest.raises(ValueError, match="num_workers >= 1"):
        RewardPool(None, num_workers=0)
    with pytest.raises(ValueError, match=r"item 1 lacks \['solution_str'\]"):
        pool.score([item("value", "1"), {"data_source": "value", "ground_truth": "1"}])
    unpicklable = item("value", "1", handle=lambda: 0)
    results = pool.score([unpicklable, item("value", "2")])
    assert "could not be sent to a reward worker" in results[0].error
    assert results[1].score == 2.0


def test_a_worker_that_cannot_load_the_function_raises(tmp_path):
    flaky = tmp_path / "flaky.py"
    marker = tmp_path / "loaded-once"
    flaky.write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path
            marker = Path({str(marker)!r})
            if marker.exists():
                raise RuntimeError("second import fails")
            marker.write_text("x")

            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                return 1.0
            """
        )
    )
    pool = RewardPool((str(flaky), "compute_score"), num_workers=1)
    with pytest.raises(RewardPoolError, match="could not load .*second import fails"):
        pool.score([item("x")])
    assert all(wait_dead(pid) for pid in pool.pids if pid is not None)
    assert os.getpid() not in pool.pids


def test_a_script_that_never_closes_its_pool_still_exits(tmp_path):
    script = tmp_path / "forgetful.py"
    script.write_text(
        textwrap.dedent(
            """
            import weakref
            weakref.finalize(weakref, print)  # weakref's exit hook now runs after multiprocessing's
            from rayrl.rewards import RewardPool

            if __name__ == "__main__":
                pool = RewardPool(None, num_workers=2)
                items = [dict(data_source="gsm8k", solution_str="#### 1", ground_truth="1")]
                print(pool.score(items)[0].score, *pool.pids)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    score, *pids = done.stdout.split()
    assert score == "1.0" and all(wait_dead(int(pid)) for pid in pids)


class PoolHolder:
    """A Ray actor holding a RewardPool, as the reward worker will."""

    def __init__(self, spec, timeout_s: float) -> None:
        self.pool = RewardPool(spec, num_workers=1, timeout_s=timeout_s)

    def score(self, items: list[dict]) -> list[tuple[float, str | None]]:
        return [(r.score, r.error) for r in self.pool.score(items)]

    def close(self) -> list[int | None]:
        self.pool.close()
        return self.pool.pids


@pytest.mark.slow
def test_the_pool_spawns_and_kills_workers_inside_a_ray_actor(ray_local, reward_file, tmp_path):
    ray = ray_local
    holder = ray.remote(PoolHolder).remote((str(reward_file), "compute_score"), TIMEOUT_S)
    items = [item("value", "2"), item("hang", pid_file=str(tmp_path / "pid")), item("value", "3")]
    scores = ray.get(holder.score.remote(items), timeout=120)
    assert scores == [(2.0, None), (0.0, f"timed out after {TIMEOUT_S:g} s"), (3.0, None)]
    assert wait_dead(int((tmp_path / "pid").read_text()))
    pids = ray.get(holder.close.remote(), timeout=60)
    assert all(wait_dead(pid) for pid in pids)
    ray.kill(holder)
