"""`rayrl doctor`: report, stale groups left by finished jobs, and --cleanup."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys

import pytest
import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from rich.console import Console

from rayrl.cli import doctor_cmd
from rayrl.cluster.guard import ResourcesBusy
from rayrl.cluster.inspect import resolve_address, snapshot, version_mismatches
from rayrl.cluster.pool import PoolSpec, ResourcePool

OLD_DRIVER = """
import sys
import ray
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1], log_to_driver=False)
pg = placement_group([{"GPU": 4}], strategy="STRICT_PACK", name="rayrl/old-run/rollout",
                     lifetime="detached")
assert pg.wait(30)
if len(sys.argv) > 2:  # a group of another tool, left behind too
    other = placement_group([{"CPU": 0.5}], name=sys.argv[2], lifetime="detached")
    assert other.wait(30)

@ray.remote(num_cpus=0)
class Store:
    def ping(self):
        return "pong"

store = Store.options(name="rayrl/old-run/kv", lifetime="detached").remote()
assert ray.get(store.ping.remote(), timeout=60) == "pong"
"""


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, no_color=True), buf


def test_parser_and_version_mismatch():
    parser = argparse.ArgumentParser()
    doctor_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["doctor", "--address", "1.2.3.4:6379", "--cleanup", "--yes"])
    assert (args.address, args.cleanup, args.yes, args.func) == (
        "1.2.3.4:6379",
        True,
        True,
        doctor_cmd.run,
    )
    found = version_mismatches(
        {
            "a": {"ray": "2.60.0", "torch": "2.13.0"},
            "b": {"ray": "2.60.0", "torch": "2.11.0"},
            "c": None,
        }
    )
    assert found == {"torch": {"2.13.0", "2.11.0"}}


def test_report_lists_nodes_versions_and_groups(ray_local):
    gcs = ray.get_runtime_context().gcs_address
    pool = ResourcePool(PoolSpec("ref", [1], {"GPU": 1, "CPU": 1}), run="doc")
    pool.bootstrap(timeout_s=20)
    try:
        console, buf = _console()
        assert doctor_cmd.doctor(gcs, console=console, versions_timeout_s=60) == 0
        out = buf.getvalue()
        for needle in (
            gcs,
            "1 live node",
            "(head)",
            "2.60.0",
            "python",
            "transformers",
            "rayrl/doc/ref/0",
            "running",
        ):
            assert needle in out, out
        assert "MISMATCH" not in out and "STALE" not in out
    finally:
        pool.teardown()


def test_stale_group_blocks_then_cleanup_frees_it(ray_local):
    gcs = ray.get_runtime_context().gcs_address
    subprocess.run([sys.executable, "-c", OLD_DRIVER, gcs], check=True, timeout=120)
    spec = PoolSpec("rollout", [2], {"GPU": 1, "CPU": 1})

    with pytest.raises(ResourcesBusy) as err:
        ResourcePool(spec, run="new-run").bootstrap(timeout_s=3)
    text = str(err.value)
    assert "rayrl/old-run/rollout" in text and "STALE" in text and "finished" in text
    assert "rayrl doctor --cleanup" in text

    console, buf = _console()
    assert doctor_cmd.doctor(gcs, cleanup=True, console=console, confirm=lambda q: False) == 1
    assert "Left as is" in buf.getvalue()
    assert [g.name for g in snapshot().stale_groups()] == ["rayrl/old-run/rollout"]

    console, buf = _console()
    assert (
        doctor_cmd.doctor(gcs, cleanup=True, yes=True, console=console, versions_timeout_s=60) == 0
    )
    out = buf.getvalue()
    assert "removed placement group rayrl/old-run/rollout" in out, out
    assert "killed actor rayrl/old-run/kv" in out, out
    assert snapshot().stale_groups() == []

    pool = ResourcePool(spec, run="new-run")
    assert len(pool.bootstrap(timeout_s=20)) == 2
    pool.teardown()


def test_cleanup_exits_1_while_stale_groups_of_other_tools_remain(ray_local):
    gcs = ray.get_runtime_context().gcs_address
    subprocess.run([sys.executable, "-c", OLD_DRIVER, gcs, "other/left"], check=True, timeout=120)
    console, buf = _console()
    try:
        code = doctor_cmd.doctor(
            gcs, cleanup=True, yes=True, console=console, versions_timeout_s=60
        )
        out = buf.getvalue()
        assert code == 1, out
        assert "removed placement group rayrl/old-run/rollout" in out
        assert "Still stale after the cleanup: other/left" in out, out
    finally:
        for g in snapshot().groups:
            if g.name == "other/left":
                remove_placement_group(
                    PlacementGroup(ray.PlacementGroupID(bytes.fromhex(g.group_id)))
                )


def test_address_comes_from_flag_then_config_then_ray_address(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    assert resolve_address("1.1.1.1:1", "2.2.2.2:2") == "1.1.1.1:1"
    assert resolve_address(None, "2.2.2.2:2") == "2.2.2.2:2"
    assert resolve_address(None, None) == "10.0.0.9:6379"
    monkeypatch.delenv("RAY_ADDRESS")
    assert resolve_address(None, None) is None


def test_doctor_honours_ray_address(ray_local):
    """No --address: RAY_ADDRESS names the cluster to inspect (not a new local one)."""
    gcs = ray.get_runtime_context().gcs_address
    pool = ResourcePool(PoolSpec("seen", [1], {"CPU": 0.25}), run="env-doc")
    pool.bootstrap(timeout_s=20)
    try:
        env = dict(os.environ, RAY_ADDRESS=gcs)
        done = subprocess.run(
            [sys.executable, "-m", "rayrl.cli.main", "doctor", "--timeout", "60"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert f"Ray cluster at {gcs}" in done.stdout, done.stdout + done.stderr
        assert "rayrl/env-doc/seen/0" in done.stdout
        assert "Started a local Ray instance" not in done.stderr
    finally:
        pool.teardown()


@pytest.mark.slow
def test_doctor_without_any_address_starts_its_own_local_ray():
    """No --address, no resources.address, no RAY_ADDRESS: a private local Ray."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    code = (
        "import sys; from rayrl.cli import doctor_cmd; "
        "sys.exit(doctor_cmd.doctor(versions_timeout_s=60))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 live node(s)" in done.stdout and "No placement groups." in done.stdout
    assert "Started a local Ray instance" in done.stderr
