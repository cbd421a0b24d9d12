"""Detached lifetime: a driver reserves a detached pool and KV store and exits; a new
driver process re-attaches to both; `rayrl doctor` lists them as in use while it lives,
as stale once it has exited, and `--cleanup` removes them."""

from __future__ import annotations

import io
import subprocess
import sys

import ray
from rich.console import Console

from rayrl.cli import doctor_cmd
from rayrl.cluster import ray_private
from rayrl.cluster.inspect import attach_key, snapshot

FIRST = """
import sys
import ray
from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import PoolSpec, ResourcePool
ray.init(address=sys.argv[1], log_to_driver=False)
spec = PoolSpec("gen", [2], {"CPU": 0.25}, lifetime="detached", capacity_factor=1.5)
ResourcePool(spec, run="reattach").bootstrap(timeout_s=60)
KVStore.create("reattach", detached=True).put("step", 7)
"""

SECOND = """
import sys
import ray
from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import ResourcePool
ray.init(address=sys.argv[1], log_to_driver=False)
pool = ResourcePool.attach("reattach/gen")
kv = KVStore.attach("reattach")
task = ray.remote(lambda: "placed").options(
    num_cpus=0.25, scheduling_strategy=pool.bundles[1].scheduling_strategy()
)
print(len(pool.bundles), len(pool.spares), pool.spec.strategy, kv.get("step"),
      ray.get(task.remote(), timeout=60), flush=True)
sys.stdin.readline()  # stay attached until the test says so
"""


def _doctor(gcs: str, **kwargs) -> tuple[int, str]:
    buf = io.StringIO()
    code = doctor_cmd.doctor(
        gcs, console=Console(file=buf, width=220, no_color=True), versions_timeout_s=60, **kwargs
    )
    return code, buf.getvalue()


def _detached_row(out: str, what: str) -> str:
    return next(line for line in out.splitlines() if what in line)


def test_a_new_driver_reattaches_then_doctor_tracks_and_cleans_up(ray_local):
    gcs = ray.get_runtime_context().gcs_address
    subprocess.run([sys.executable, "-c", FIRST, gcs], check=True, timeout=120)
    second = subprocess.Popen(
        [sys.executable, "-c", SECOND, gcs],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert second.stdout.readline().split() == ["2", "1", "STRICT_PACK", "7", "placed"]
        assert len(ray_private.kv_get(attach_key("reattach"))["jobs"]) == 1
        code, out = _doctor(gcs, cleanup=True, yes=True)
        assert code == 0 and "Nothing to clean up" in out, out  # in use: not stale
        assert "no" in _detached_row(out, "pool rayrl/reattach/gen (3 bundles)"), out
        assert "no" in _detached_row(out, "actor rayrl/reattach/kv"), out
    finally:
        second.communicate(input="\n", timeout=60)
    code, out = _doctor(gcs)
    assert code == 1 and "STALE" in _detached_row(out, "pool rayrl/reattach/gen"), out
    code, out = _doctor(gcs, cleanup=True, yes=True)
    assert code == 0, out
    assert "killed actor rayrl/reattach/kv" in out and "removed placement group" in out
    assert not [g for g in snapshot().groups if g.name.startswith("rayrl/reattach/")]
    assert ray_private.kv_get(attach_key("reattach")) is None
