"""`rayrl train` on two real machines: two network namespaces on a veth pair, each with
its own address, a hostname that resolves to 127.0.1.1 (Debian's /etc/hosts) and its own
HOME, TMPDIR and Ray; a Ray head on one, a worker node on the other, token
authentication as the README describes, and one actor rank per machine.

The ranks' process group must form over the machines' own addresses (gloo left alone
would advertise 127.0.1.1, which the other machine cannot reach), and a rank killed
on the second machine is replaced and recorded in workers.json; the second machine
lost whole moves its rank to a spare on the first, at the normal step time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from two_machines import available, two_machines

UNAVAILABLE = available()
# `rayrl train` as a user runs it on two machines: in CI too, wherever it runs as root
pytestmark = [
    pytest.mark.slow,
    pytest.mark.command,
    pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE),
]

SRC = str(Path(__file__).resolve().parents[1] / "src")
RAY_ENV = {"PYTHONPATH": SRC, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def cluster(tmp_path):
    """A Ray head on one machine and a worker node on the other, token auth on."""
    root = Path(tempfile.mkdtemp(prefix="rr2m-", dir="/tmp"))  # Ray's socket paths are short
    machines = two_machines(root)
    try:
        machines.up()
        head, worker = machines.head, machines.worker
        head.env.update(RAY_ENV)
        worker.env.update(RAY_ENV)
        token = _checked(head.run(["ray", "get-auth-token", "--generate"], timeout=120)).stdout
        assert (head.home / ".ray" / "auth_token").is_file()
        # logical CPUs: each machine's actor and reward bundles, and spares for the other's
        start = ["ray", "start", "--num-cpus=4", "--disable-usage-stats"]
        _checked(
            head.run(
                [*start, "--head", f"--node-ip-address={head.ip}", "--port=6379"]
                + ["--include-dashboard=false", f"--temp-dir={head.ray_temp}"],
                timeout=300,
            )
        )
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token.strip()}
        _checked(
            worker.run(
                [*start, f"--address={head.ip}:6379", f"--node-ip-address={worker.ip}"]
                + [f"--temp-dir={worker.ray_temp}"],
                env=auth,
                timeout=300,
            )
        )
        yield machines
    finally:
        machines.down()
        shutil.rmtree(root, ignore_errors=True)


def _checked(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, f"{done.args[-6:]}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _train_command(address: str, out: Path, steps: int) -> list[str]:
    return [
        "python",
        "-m",
        "rayrl.cli.main",
        "train",
        "-c",
        "grpo",
        f"resources.address={address}",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cpu",
        f"trainer.total_training_steps={steps}",
        "data.train_batch_size=2",
        "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.val_before_train=false",
        "trainer.log_worker_output=false",
        f"trainer.output_dir={out}",
    ]


def _worker_on(out: Path, hostname: str) -> dict:
    """workers.json's actor worker on the machine named `hostname`."""
    workers = json.loads((out / "workers.json").read_text())["workers"]
    (mine,) = [w for w in workers if w["group"] == "actor_rollout_ref" and w["host"] == hostname]
    return mine


@pytest.mark.timeout(1500)  # two Ray nodes and a run, started and stopped, on a loaded machine
def test_train_on_two_machines_and_replace_a_killed_rank(cluster, tmp_path):
    head, worker = cluster.head, cluster.worker
    out = tmp_path / "run"
    log = (tmp_path / "train.log").open("w")
    train = subprocess.Popen(
        head.command(_train_command(f"{head.ip}:6379", out, 4), env={"RAY_AUTH_MODE": "token"}),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        killed = _kill_rank_once_ready(train, out, head, worker, tmp_path / "train.log")
        code = train.wait(timeout=1500)
    finally:
        if train.poll() is None:
            train.send_signal(signal.SIGINT)
            try:
                train.wait(timeout=60)
            except subprocess.TimeoutExpired:
                train.kill()
        log.close()
    text = (tmp_path / "train.log").read_text()
    assert code == 0, text[-4000:] + _backend_errors(head, worker)
    # one actor rank per machine, their process group formed across the veth pair
    hosts = sorted(
        w["host"]
        for w in json.loads((out / "workers.json").read_text())["workers"]
        if w["group"] == "actor_rollout_ref"
    )
    assert hosts == sorted([head.hostname, worker.hostname]), hosts
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], steps
    assert (out / "checkpoints" / "global_step_4" / "actor" / "rng" / "rank1.pt").is_file()
    assert (out / "hf" / "model.safetensors").is_file()
    # the killed rank was replaced, and workers.json names its new process
    assert "recovering from a worker failure" in text, text[-4000:]
    now = _worker_on(out, worker.hostname)
    assert now["pid"] != killed["pid"], (killed, now)
    assert now["log_file"] != killed["log_file"], (killed, now)
    # the new process's own Ray log, written on the worker machine (named by its pid)
    assert now["log_file"].endswith(f"-{now['pid']}.err"), now
    assert Path(now["log_file"]).is_relative_to(worker.ray_temp), now
    assert Path(now["log_file"]).is_file(), now


STEPS = 30  # a step takes a fraction of a second: the loss lands inside the run


@pytest.mark.timeout(1500)
def test_losing_the_second_machine_moves_its_rank_to_a_spare_at_the_normal_step_time(
    cluster, tmp_path
):
    """The worker machine goes down whole (its Ray and every process on it) in the
    middle of a run that reserved spares and keeps each step's snapshot on the other
    machine too: its ranks move to the spare bundles on the head machine, the step
    runs again from its snapshot, and the run ends at the step time it had before."""
    head, worker = cluster.head, cluster.worker
    out = tmp_path / "run"
    command = _train_command(f"{head.ip}:6379", out, STEPS) + [
        "resources.capacity_factor=1.5",  # spares, each on another machine than its rank's
        "trainer.snapshot_replicas=1",  # each step's snapshot kept on the other machine too
    ]
    log_path = tmp_path / "train.log"
    log = log_path.open("w")
    train = subprocess.Popen(
        head.command(command, env={"RAY_AUTH_MODE": "token"}),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _until_steps(train, out, 3, log_path)
        os.kill(worker.pid1, signal.SIGKILL)  # its pid 1: every process on it dies at once
        code = train.wait(timeout=1200)
    finally:
        if train.poll() is None:
            train.kill()
        log.close()
    text = log_path.read_text()
    assert code == 0, text[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1)), text[-3000:]
    hosts = {w["host"] for w in json.loads((out / "workers.json").read_text())["workers"]}
    assert hosts == {head.hostname}, hosts  # every worker now on the head machine
    recovered = [i for i, row in enumerate(rows) if "recovery/ranks_reloading" in row]
    # the step under way replayed from the last boundary, or (when the machine went while
    # that boundary's copy was still on its way) from the one before, kept in memory:
    # never a rewind to the start
    assert recovered and recovered[0] >= 2, text[-3000:]
    assert "rewound" not in text, text[-3000:]
    before = sorted(row["timing_s/step"] for row in rows[1 : recovered[0]])
    after = sorted(row["timing_s/step"] for row in rows[recovered[-1] + 1 :])
    assert after, rows
    # the normal step time: no slower than before the loss (within a loaded machine's
    # noise), not the seconds a step takes while a lost node's groups load Ray's GCS
    assert after[len(after) // 2] < 2 * before[len(before) // 2] + 0.5, (before, after)


def _until_steps(train, out: Path, steps: int, log_path: Path) -> None:
    """Wait until the run has logged `steps` steps."""
    deadline = time.monotonic() + 1200
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if train.poll() is not None:
            raise AssertionError(f"train ended early:\n{log_path.read_text()[-4000:]}")
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.5)
    raise AssertionError(f"{steps} steps not done within 1200 s:\n{log_path.read_text()[-4000:]}")


def _kill_rank_once_ready(train, out: Path, head, worker, log_path: Path) -> dict:
    """SIGKILL the actor rank on `worker` (its pid from workers.json) once the run has
    started its workers and begins training ("ready in"); returns its workers.json
    entry. (After step 1 it would race the end of a fast run: a step takes a second.)"""
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        if train.poll() is not None:
            early = log_path.read_text()[-4000:] + _backend_errors(head, worker)
            raise AssertionError(f"train ended early:\n{early}")
        if "ready in" in log_path.read_text():
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"not ready within 1200 s:\n{log_path.read_text()[-4000:]}")
    victim = _worker_on(out, worker.hostname)
    _checked(worker.run(["kill", "-9", str(victim["pid"])], timeout=60))
    return victim


def _backend_errors(*machines) -> str:
    """The torch.distributed lines of the machines' Ray worker logs (why a group did
    not form: "Gloo connectFullMesh failed ... remote=[127.0.1.1]"), for a failure."""
    lines = []
    for machine in machines:
        for path in sorted(machine.ray_temp.glob("session_*/logs/worker-*.err")):
            text = path.read_text(errors="replace").splitlines()
            lines += [f"{machine.hostname}: {t}" for t in text if "Gloo" in t or "c10d" in t]
    return "\nbackend lines of the workers' logs:\n" + "\n".join(lines[-20:])
