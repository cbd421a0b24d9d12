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
  driver re-attached to a detached run, and the autoscaler's status and config.

Everything returns plain Python values (dicts of str/float/bool), never protobufs.
Each function has a test in tests/test_ray_private.py.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

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


def placement_groups() -> list[dict]:
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


def actors() -> list[dict]:
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
    return handle._actor_id.hex()


def actor_row(handle: Any) -> dict:
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


# --- the GCS internal KV -----------------------------------------------------------------


def kv_put(key: str, value: dict) -> None:
    """Store a small JSON record in the GCS under rayrl's namespace (outlives every job)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(
        key, json.dumps(value), overwrite=True, namespace=RAYRL_KV_NAMESPACE
    )


def kv_get(key: str) -> dict | None:
    """A record `kv_put` stored, or None."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(key, namespace=RAYRL_KV_NAMESPACE)
    return json.loads(raw) if raw else None


def kv_list(prefix: str) -> dict[str, dict]:
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


def autoscaler() -> dict | None:
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
