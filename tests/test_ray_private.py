"""One test per private Ray API rayrl uses (all behind rayrl.cluster.ray_private), on the
real local Ray: when a Ray upgrade breaks one, the failing test names it."""

from __future__ import annotations

import os
import uuid

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rayrl.cluster import ray_private


@ray.remote(num_cpus=0.5)
class _Probe:
    def where(self) -> tuple[int, str, str]:
        return os.getpid(), ray_private.current_log_file(), ray.get_runtime_context().get_node_id()


def test_jobs_and_node_resources(ray_local):
    me = ray.get_runtime_context().get_job_id()
    assert ray_private.jobs_dead()[me] is False
    totals, free = ray_private.node_resources()
    node = ray.get_runtime_context().get_node_id()
    assert totals[node]["CPU"] == 8 and totals[node]["GPU"] == 4
    assert 0 <= free[node]["CPU"] <= 8


def test_placement_group_table(ray_local):
    name = f"rayrl/priv-{uuid.uuid4().hex[:6]}/p/0"
    pg = placement_group([{"CPU": 0.25}, {"CPU": 0.25}], strategy="PACK", name=name)
    assert pg.wait(30)
    try:
        row = next(g for g in ray_private.placement_groups() if g["name"] == name)
        assert row["group_id"] == pg.id.hex() and row["state"] == "CREATED"
        assert row["strategy"] == "PACK" and row["detached"] is False
        assert row["job_id"] == ray.get_runtime_context().get_job_id() and not row["job_dead"]
        assert row["bundles"] == [{"CPU": 0.25}, {"CPU": 0.25}]
        assert row["bundle_nodes"] == [ray.get_runtime_context().get_node_id()] * 2
    finally:
        remove_placement_group(pg)


def test_actor_table_row_and_log_files(ray_local):
    probe = _Probe.remote()
    pid, log_file, node = ray.get(probe.where.remote(), timeout=60)
    try:
        row = next(a for a in ray_private.actors() if a["actor_id"] == ray_private.actor_id(probe))
        assert row["state"] == "ALIVE" and row["class_name"] == "_Probe"
        assert row["pid"] == pid and row["node_id"] == node and row["group_id"] == ""
        assert row["resources"] == {"CPU": 0.5} and row["detached"] is False
        assert ray_private.actor_row(probe) == {"state": "ALIVE", "pid": pid, "node_id": node}
        assert log_file.endswith(f"-{pid}.err") and os.path.exists(log_file)
        assert ray_private.log_file_of(pid) == log_file
    finally:
        ray.kill(probe)


def test_internal_kv_records(ray_local):
    key = f"test/{uuid.uuid4().hex[:6]}"
    ray_private.kv_put(key + "/a", {"jobs": ["01"]})
    ray_private.kv_put(key + "/b", {"x": 2})
    assert ray_private.kv_get(key + "/a") == {"jobs": ["01"]}
    assert ray_private.kv_list(key + "/") == {key + "/a": {"jobs": ["01"]}, key + "/b": {"x": 2}}
    ray_private.kv_delete(key + "/a")
    ray_private.kv_delete(key + "/b")
    assert ray_private.kv_get(key + "/a") is None and ray_private.kv_list(key + "/") == {}


def test_no_autoscaler_on_a_plain_cluster(ray_local):
    assert ray_private.autoscaler() is None


def test_dashboard_dependency_error_is_none_with_ray_default():
    """With ray[default] (CI's venv) nothing is missing; a minimal Ray (the GPU
    machine's) names the missing package."""
    try:
        import aiohttp_cors  # noqa: F401  (one of ray[default]'s dashboard packages)
    except ImportError:
        assert "No module named" in ray_private.dashboard_dependency_error()
        return
    assert ray_private.dashboard_dependency_error() is None


def test_session_logs_dir_dashboard_url_and_actor_name_marker(ray_local):
    logs = ray_private.session_logs_dir()
    assert logs is None or os.path.isdir(logs)  # None when the test Ray was joined
    url = ray_private.dashboard_url()
    assert url is None or url.startswith("http")
    marker = ray_private.actor_name_marker()
    assert marker and marker.strip()  # Ray 2.60 has it; the worker prints it + role/rank
