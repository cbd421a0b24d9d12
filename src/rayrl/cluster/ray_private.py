"""Every use of Ray's private APIs in rayrl, in one file, so a Ray upgrade touches only this.

rayrl reads the GCS directly because `ray.util.state` needs the dashboard's HTTP
server, which many clusters (and every Ray rayrl starts itself) run without. What we
read, and from where:

* jobs, per-node total and free resources: `ray._private.state`;
* the placement group and actor tables (creator job, detached flag, namespace,
  required resources): GCS protobufs through the global state accessor;
* an actor's row (state, pid, node): `ray._private.state.actors`, and an actor
  handle's id (`handle._actor_id`);
* Ray's log file of a worker process: `ray._private.worker`;
* the GCS internal KV (`ray.experimental.internal_kv`): rayrl's own records of which
  driver re-attached to a detached run, and the autoscaler's status and config;
* the processes of a Ray this driver started (`ray._private.worker._global_node`),
  stopped all at once by `stop_local_ray`;
* whether this Ray can serve a dashboard (`ray._private.utils`): a minimal Ray cannot;
  the dashboard's URL and this session's log directory (`ray._private.worker`); the
  marker that makes Ray's log monitor take a line as an actor's new output prefix
  (`ray._private.ray_constants`).

Everything returns plain Python values (dicts of str/float/bool), never protobufs.
Each function has a test in tests/test_ray_private.py.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import time
from typing import Any, cast

import ray

RAYRL_KV_NAMESPACE = "rayrl"
# Written by the v1 monitor (autoscaler) every few seconds while it runs.
_AUTOSCALER_STATUS_KEY = "__autoscaling_status"


def _state() -> Any:
    from ray._private import state

    return state


def _accessor() -> Any:
    return _state().state._connect_and_get_accessor()


def jobs_dead() -> dict[str, bool]:
    """Job id (hex) -> whether the job has finished."""
    return {j["JobID"]: bool(j["IsDead"]) for j in _state().jobs()}


def node_resources() -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """(total, free) resources per live node id, Ray's bookkeeping entries included."""
    state = _state()
    return state.total_resources_per_node(), state.available_resources_per_node()


def placement_groups() -> list[dict[str, Any]]:
    """Every placement group the GCS holds (removed ones included), as plain dicts:
    group_id, name, state, strategy, job_id, job_dead, detached, namespace, bundles
    (resource dicts in index order) and bundle_nodes (node id or "" per bundle)."""
    from ray.core.generated import gcs_pb2

    table = gcs_pb2.PlacementGroupTableData
    states = {v: k for k, v in table.PlacementGroupState.items()}
    strategies = table.DESCRIPTOR.fields_by_name["strategy"].enum_type.values_by_number
    out = []
    for raw in _accessor().get_placement_group_table():
        data = table.FromString(raw)
        bundles = sorted(data.bundles, key=lambda b: b.bundle_id.bundle_index)
        out.append(
            {
                "group_id": data.placement_group_id.hex(),
                "name": data.name,
                "state": states.get(data.state, str(data.state)),
                "strategy": strategies[data.strategy].name,
                "job_id": data.creator_job_id.hex(),
                "job_dead": bool(data.creator_job_dead),
                "detached": bool(data.is_detached),
                "namespace": data.ray_namespace,
                "bundles": [{k: float(v) for k, v in b.unit_resources.items()} for b in bundles],
                "bundle_nodes": [b.node_id.hex() for b in bundles],
            }
        )
    return out


def actors() -> list[dict[str, Any]]:
    """Every actor the GCS holds, as plain dicts: actor_id, name, namespace, class_name,
    state, job_id, detached, group_id (placement group, "" if none), node_id, pid and
    resources (what it holds while alive)."""
    from ray.core.generated import gcs_pb2

    table = gcs_pb2.ActorTableData
    states = {v: k for k, v in table.ActorState.items()}
    out = []
    for raw in _accessor().get_actor_table(None, None):
        data = table.FromString(raw)
        group = data.placement_group_id.hex()
        out.append(
            {
                "actor_id": data.actor_id.hex(),
                "name": data.name,
                "namespace": data.ray_namespace,
                "class_name": data.class_name,
                "state": states.get(data.state, str(data.state)),
                "job_id": data.job_id.hex(),
                "detached": bool(data.is_detached),
                "group_id": "" if not group.strip("f0") else group,
                "node_id": data.address.node_id.hex() or data.node_id.hex(),
                "pid": int(data.pid),
                "resources": {k: float(v) for k, v in data.required_resources.items()},
            }
        )
    return out


def actor_id(handle: Any) -> str:
    """The hex id of an actor handle."""
    return cast(str, handle._actor_id.hex())


def actor_row(handle: Any) -> dict[str, Any]:
    """What the GCS says of one actor: state, pid (0 before its process starts), node id."""
    row = _state().actors(actor_id(handle))
    return {
        "state": str(row.get("State", "")),
        "pid": int(row.get("Pid") or 0),
        "node_id": (row.get("Address") or {}).get("NodeID", ""),
    }


def current_log_file() -> str:
    """Path of this worker process's Ray log (stderr) file, or "" when there is none.

    Ray names it `worker-<worker_id>-<job_id>-<pid>.err` in the session's log folder;
    the job part is the job the process was started for, so the fallback matches any.
    """
    from ray._private import worker as ray_worker

    current = ray_worker.global_worker
    path = current.get_err_file_path() if hasattr(current, "get_err_file_path") else ""
    if path:
        return str(path)
    logs = _logs_dir()
    if not logs:
        return ""
    worker_id = ray.get_runtime_context().get_worker_id()
    found = glob.glob(os.path.join(logs, f"worker-{worker_id}-*-{os.getpid()}.err"))
    return found[0] if found else ""


def log_file_of(pid: int) -> str:
    """The Ray log (stderr) file of worker process `pid`, if it is on this machine."""
    logs = _logs_dir()
    found = glob.glob(os.path.join(logs, f"worker-*-{pid}.err")) if logs else []
    return found[0] if found else ""


def _logs_dir() -> str:
    from ray._private import worker as ray_worker

    node = ray_worker._global_node
    return node.get_logs_dir_path() if node is not None else ""


# --- the processes of a Ray this driver started -------------------------------------------


def stop_local_ray(grace_s: float = 0.5) -> bool:
    """Disconnect the driver and stop the Ray it started, quickly: the raylet first (it
    stops its workers; it hangs if the GCS goes first), then every other Ray process at
    once, SIGKILL for any still running `grace_s` after its SIGTERM (at once for the
    autoscaler monitor, which ignores SIGTERM). `ray.shutdown()` stops them one after another, giving
    each up to a second, after half a second's sleep at interpreter exit. A driver that
    joined a cluster started elsewhere only disconnects: returns False."""
    from ray._private import ray_constants
    from ray._private import worker as ray_worker

    node = ray_worker._global_node
    if node is None:
        if ray.is_initialized():
            ray.shutdown()
        return False
    kinds = {kind: [info.process for info in infos] for kind, infos in node.all_processes.items()}
    raylets = kinds.pop(ray_constants.PROCESS_TYPE_RAYLET, [])
    monitors = kinds.pop(ray_constants.PROCESS_TYPE_MONITOR, [])
    ray_worker._global_node = None  # ray.shutdown then disconnects and stops nothing
    ray.shutdown()
    if node.is_head():
        node.destroy_external_storage()  # spilled objects, as ray.shutdown does
    _terminate(raylets, max(grace_s, 2.0))
    _terminate(monitors, 0.0)  # stateless, and it ignores SIGTERM: Ray kills it too
    _terminate([p for processes in kinds.values() for p in processes], grace_s)
    return True


def _terminate(processes: list[subprocess.Popen[Any]], grace_s: float) -> None:
    """SIGTERM to all of `processes` at once; SIGKILL to those alive `grace_s` later."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5.0)


# --- the GCS internal KV -----------------------------------------------------------------


def kv_put(key: str, value: dict[str, Any]) -> None:
    """Store a small JSON record in the GCS under rayrl's namespace (outlives every job)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(
        key, json.dumps(value), overwrite=True, namespace=RAYRL_KV_NAMESPACE
    )


def kv_get(key: str) -> dict[str, Any] | None:
    """A record `kv_put` stored, or None."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(key, namespace=RAYRL_KV_NAMESPACE)
    return json.loads(raw) if raw else None


def kv_list(prefix: str) -> dict[str, dict[str, Any]]:
    """Every record whose key starts with `prefix`, by key."""
    from ray.experimental import internal_kv

    keys = internal_kv._internal_kv_list(prefix, namespace=RAYRL_KV_NAMESPACE)
    found = {}
    for key in keys:
        name = key.decode() if isinstance(key, bytes) else key
        record = kv_get(name)
        if record is not None:
            found[name] = record
    return found


def kv_delete(key: str) -> None:
    """Remove a record (no error if absent)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=RAYRL_KV_NAMESPACE)


def autoscaler() -> dict[str, Any] | None:
    """What the GCS shows of an autoscaler, or None when the cluster has none.

    Autoscaler v2 stores the cluster config in the GCS: node types with their resources
    and maximum counts. The v1 monitor, which every head node runs, writes a status
    report every few seconds; without an autoscaling config it runs a read-only
    provider that maps each node to a type named after the node itself, so only a
    mapping to configured type names means an autoscaler can add nodes. Returns
    {"source", "node_types": [{name, resources, max_count}], "max_resources"}
    (node_types empty when only the v1 report is known).
    """
    from ray.autoscaler._private.util import format_readonly_node_type
    from ray.experimental import internal_kv

    config = _state().state.get_cluster_config()
    if config is not None and config.node_group_configs:
        return {
            "source": "cluster config",
            "node_types": [
                {
                    "name": g.name,
                    "resources": {k: float(v) for k, v in g.resources.items()},
                    "max_count": int(g.max_count),
                }
                for g in config.node_group_configs
            ],
            "max_resources": {k: float(v) for k, v in config.max_resources.items()},
        }
    raw = internal_kv._internal_kv_get(_AUTOSCALER_STATUS_KEY)
    report = (json.loads(raw).get("autoscaler_report") or {}) if raw else {}
    mapping = report.get("node_type_mapping") or {}
    if any(kind != format_readonly_node_type(node) for node, kind in mapping.items()):
        return {"source": "autoscaler status", "node_types": [], "max_resources": {}}
    return None


def dashboard_dependency_error() -> str | None:
    """Why this Ray cannot start a dashboard (a minimal install lacks its packages), or
    None when it can."""
    from ray._private import utils

    check = getattr(utils, "get_dashboard_dependency_error", None)
    error = check() if check else None
    return str(error) if error else None


def dashboard_url() -> str | None:
    """The dashboard's URL (with its scheme) of the Ray this driver is connected to."""
    try:
        url = ray._private.worker.get_dashboard_url()
    except Exception:  # noqa: BLE001 - no dashboard in this cluster
        return None
    if not url:
        return None
    return url if "://" in url else f"http://{url}"


def session_logs_dir() -> str | None:
    """The log directory of the Ray session this process started (None when it joined
    one it did not start)."""
    node = ray._private.worker._global_node
    return node.get_logs_dir_path() if node is not None else None


def actor_name_marker() -> str | None:
    """The prefix that makes Ray's log monitor take a printed line as the actor's new
    name on the driver (None on a Ray without it)."""
    try:
        from ray._private.ray_constants import LOG_PREFIX_ACTOR_NAME
    except ImportError:  # pragma: no cover - a Ray without the marker
        return None
    return cast(str, LOG_PREFIX_ACTOR_NAME)
