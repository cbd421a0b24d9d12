"""Errors of the KV store and the writer identity that makes them actionable.

Every put records who wrote it (Ray actor, task, worker, node, pid, or an explicit
label), so a wait that times out can name the last writer near the missing key.
"""

from __future__ import annotations

import difflib
import os
import time
from collections.abc import Callable
from typing import Any

# How many nearby keys a timeout message lists.
NEAREST_KEYS = 8


class KVStoreError(RuntimeError):
    """The KV store could not serve a call: no such store, server dead or not answering."""


class KVTimeoutError(TimeoutError):
    """A `KVStore.wait` gave up: the key did not appear in time.

    Attributes: `key`, `namespace`, `run`, `waited_s`, `nearest` (present keys close to
    the missing one), `last_write` (dict: prefix, key, writer, time; or None).
    """

    def __init__(
        self,
        message: str,
        *,
        key: str = "",
        namespace: str = "",
        run: str = "",
        waited_s: float = 0.0,
        nearest: list[str] | None = None,
        last_write: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.namespace = namespace
        self.run = run
        self.waited_s = waited_s
        self.nearest = list(nearest or [])
        self.last_write = last_write

    def __reduce__(
        self,
    ) -> tuple[Callable[[str, dict[str, Any]], KVTimeoutError], tuple[str, dict[str, Any]]]:
        state = {k: getattr(self, k) for k in ("key", "namespace", "run", "waited_s")}
        state.update(nearest=self.nearest, last_write=self.last_write)
        return (_rebuild_timeout, (self.message, state))

    @classmethod
    def from_report(
        cls, run: str, namespace: str, key: str, timeout: float, report: dict[str, Any]
    ) -> KVTimeoutError:
        """Build the error (and its message) from the server's timeout report."""
        report = {**report, "nearest": nearest_keys(key, report)}
        lines = [
            f"KV wait timed out after {report['waited_s']:.1f} s (timeout {timeout:g} s): "
            f"key {key!r} in namespace {namespace!r} of run {run!r} is not present."
        ]
        lines += _history_lines(key, report)
        lines.append(
            "What to do: check that the process that should write this key (e.g. rank 0 of "
            "the group) is alive and read its log (`ray list actors`, "
            "`ray logs actor --id <actor id>`, `rayrl doctor`); compare the key, namespace "
            "and generation with the nearest keys above; if the writer is only slow to "
            "start, raise the timeout."
        )
        return cls(
            "\n".join(lines),
            key=key,
            namespace=namespace,
            run=run,
            waited_s=report["waited_s"],
            nearest=report["nearest"],
            last_write=report["last_write"],
        )


def nearest_keys(key: str, report: dict[str, Any]) -> list[str]:
    """Present keys close to a missing one: close spellings first, then its siblings.

    Ranked here, in the client, from the few candidates the server sent."""
    candidates = report.get("candidates", [])
    nearest = difflib.get_close_matches(key, candidates, n=NEAREST_KEYS, cutoff=0.6)
    parent = report.get("parent", "")
    if parent:
        nearest += [k for k in candidates if k.startswith(parent)]
    return list(dict.fromkeys(nearest))[:NEAREST_KEYS]


def _rebuild_timeout(message: str, state: dict[str, Any]) -> KVTimeoutError:
    return KVTimeoutError(message, **state)


def _history_lines(key: str, report: dict[str, Any]) -> list[str]:
    """The 'what is around the missing key' part of a timeout message."""
    nearest = report["nearest"]
    if nearest:
        lines = ["  nearest present keys: " + ", ".join(repr(k) for k in nearest)]
    else:
        lines = [f"  nearest present keys: none (namespace holds {report['namespace_size']} keys)"]
    own = report.get("key_history")
    if own and own["op"] == "delete":
        lines.append(
            f"  this key was deleted {_ago(own['time'])} by {describe_writer(own['writer'])}"
        )
    last = report["last_write"]
    if last is None:
        lines.append("  last writer: nothing was ever written in this namespace")
    else:
        where = f"under prefix {last['prefix']!r}" if last["prefix"] else "in this namespace"
        lines.append(
            f"  last writer {where}: {describe_writer(last['writer'])} wrote {last['key']!r} "
            f"{_ago(last['time'])}"
        )
    if report["other_namespaces"]:
        found = ", ".join(repr(ns) for ns in report["other_namespaces"])
        lines.append(f"  the same key is present in namespace(s) {found}")
    return lines


def _ago(when: float) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(when))
    return f"at {stamp} ({time.time() - when:.1f} s ago)"


def writer_identity(label: str | None = None) -> dict[str, Any]:
    """Who is calling: an explicit `label` plus Ray actor/task/worker/node ids and the pid.

    Computed per call (a few microseconds): a driver may reconnect to another cluster.
    """
    identity: dict[str, Any] = {"pid": os.getpid(), "label": label, "task": None}
    try:
        import ray

        ctx = ray.get_runtime_context()
        identity.update(
            actor_id=ctx.get_actor_id(),
            worker_id=ctx.get_worker_id(),
            node_id=ctx.get_node_id(),
            job_id=ctx.get_job_id(),
            node_ip=ray.util.get_node_ip_address(),
        )
        if ctx.worker.mode == ray.WORKER_MODE:  # the driver has no task name
            identity["task"] = ctx.get_task_name()
    except Exception:  # Ray not initialised: a plain process
        pass
    return identity


def describe_writer(writer: dict[str, Any] | None) -> str:
    """One line naming a writer: label, actor or driver, task, pid and node."""
    if not writer:
        return "an unknown writer"
    parts = [f"{writer['label']!r}"] if writer.get("label") else []
    actor = writer.get("actor_id")
    kind = f"actor {actor}" if actor else "the driver"
    if writer.get("task"):
        kind += f" in task {writer['task']}"
    parts.append(kind)
    where = f"pid {writer.get('pid')}"
    if writer.get("node_ip") or writer.get("node_id"):
        where += f" on node {writer.get('node_ip')} ({str(writer.get('node_id'))[:12]})"
    parts.append(where)
    return ", ".join(parts)
