"""KVStore: a run's namespaced key-value store, for coordination between its processes.

One named asyncio Ray actor per run (`rayrl/<run>/kv` in Ray namespace "rayrl", see
`kv_server.KVServer`) holds the keys. `KVStore` is the small picklable client that the
driver and the workers share: `put`, `get`, `delete`, `delete_prefix`, `list(prefix)`, and
`wait(key, timeout)` that blocks without polling and, on timeout, raises a `KVTimeoutError` naming
the key, the namespace, the wait, the nearest present keys and the last writer nearby.

Values larger than `large_value_bytes` (64 KiB by default) are `ray.put` by the writer
and only their ObjectRef is stored; `get`/`wait` resolve them transparently. Ray ties an
object's life to the process that put it (Ray 2.56 removed `ray.put(_owner=...)`), so a
large value is lost when its writer dies: reading it then raises a KVStoreError naming
the writer. Small values live in the server and survive their writers.

    kv = KVStore.create("run1")                  # driver
    kv.put("grp/gen0/master", ("10.0.0.1", 29500), namespace="discovery")
    addr, port = kv.wait("grp/gen0/master", timeout=60, namespace="discovery")  # worker
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable
from typing import Any, cast

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError

from rayrl.cluster.kv_errors import (
    KVStoreError,
    KVTimeoutError,
    describe_writer,
    writer_identity,
)
from rayrl.cluster.kv_server import MAX_CONCURRENT_CALLS, KVServer, percentile

__all__ = ["KVServer", "KVStore", "KVStoreError", "KVTimeoutError", "kv_latency"]

RAY_NAMESPACE = "rayrl"
DEFAULT_NAMESPACE = "default"
LARGE_VALUE_BYTES = 64 * 1024
# Slack on top of a wait's own timeout, and the bound on every other call to the server.
RPC_TIMEOUT_S = 60.0

# How long `shutdown` waits for the server to be gone (ray.kill returns at once).
SHUTDOWN_WAIT_S = 10.0

_KVActor = ray.remote(KVServer)


def actor_name(run: str) -> str:
    """The Ray actor name of a run's KV server."""
    return f"rayrl/{run}/kv"


class KVStore:
    """Client handle of a run's KV server; picklable, so pass it to workers as an argument."""

    def __init__(self, run: str, actor: Any, large_value_bytes: int = LARGE_VALUE_BYTES) -> None:
        self.run = run
        self.large_value_bytes = int(large_value_bytes)
        self._actor = actor

    def __repr__(self) -> str:
        return f"KVStore(run={self.run!r}, actor={actor_name(self.run)!r})"

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    def create(
        cls, run: str, *, detached: bool = False, large_value_bytes: int = LARGE_VALUE_BYTES
    ) -> KVStore:
        """Get or create the run's KV server (0 CPUs).

        A non-detached server is owned by the process that creates it and dies with it:
        create it in the driver. `detached=True` makes it outlive the driver (then
        `shutdown()` it, or `rayrl doctor --cleanup`). Values over `large_value_bytes`
        (pickled) are stored as ObjectRefs. The server is pinned to the creator's node
        (the driver's): losing a worker node never takes discovery with it.
        """
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        _check_name(run, "run")
        options: dict[str, Any] = dict(
            name=actor_name(run),
            namespace=RAY_NAMESPACE,
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=MAX_CONCURRENT_CALLS,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False
            ),
        )
        if detached:
            options["lifetime"] = "detached"
        actor = _KVActor.options(**options).remote(run)
        store = cls(run, actor, large_value_bytes)
        store._call("ping", what="start the KV server")
        return store

    @classmethod
    def connect(cls, run: str, *, large_value_bytes: int = LARGE_VALUE_BYTES) -> KVStore:
        """Attach to the run's existing KV server; KVStoreError naming the live ones if absent."""
        try:
            actor = ray.get_actor(actor_name(run), namespace=RAY_NAMESPACE)
        except ValueError:
            live = sorted(
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == RAY_NAMESPACE and a["name"].endswith("/kv")
            )
            raise KVStoreError(
                f"No KV store for run {run!r}: Ray actor {actor_name(run)!r} does not exist in "
                f"namespace {RAY_NAMESPACE!r} of the cluster at "
                f"{ray.get_runtime_context().gcs_address}. Live KV stores: {live or 'none'}. "
                "Create it in the driver with KVStore.create(run) first, or check the run name."
            ) from None
        return cls(run, actor, large_value_bytes)

    @classmethod
    def attach(cls, run: str, *, large_value_bytes: int = LARGE_VALUE_BYTES) -> KVStore:
        """Re-attach a new driver to the detached KV store of `run` (the driver that
        created it has exited). Small values survive their writers; large ones (held
        as ObjectRefs) died with them. Records this driver's job as a user of the run,
        so `rayrl doctor` does not call the store stale while this driver lives."""
        from rayrl.cluster.inspect import record_attachment

        store = cls.connect(run, large_value_bytes=large_value_bytes)
        store._call("ping", what="reach the detached KV server")
        record_attachment(run)
        return store

    def shutdown(self, wait_s: float = SHUTDOWN_WAIT_S) -> None:
        """Kill the KV server and wait (at most `wait_s`) until it is gone, so that any
        later call fails; its keys and ObjectRef-held values are released."""
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self._actor, no_restart=True)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                ray.get(self._actor.ping.remote(), timeout=1.0)
            except (RayActorError, GetTimeoutError):
                return
            except Exception:  # noqa: BLE001 - e.g. Ray shutting down: gone for us
                return
            time.sleep(0.02)

    # -- blocking API ----------------------------------------------------------------

    def put(
        self, key: str, value: Any, *, namespace: str = DEFAULT_NAMESPACE, writer: str | None = None
    ) -> None:
        """Store `value` under `key`; wakes every waiter. `writer` labels the caller.

        A value over `large_value_bytes` is put in Ray's object store by this process
        and lives as long as this process does (see the module docstring).
        """
        self._call("put", self._put_request(key, value, namespace, writer), what=f"put {key!r}")

    def get(self, key: str, default: Any = None, *, namespace: str = DEFAULT_NAMESPACE) -> Any:
        """The value under `key`, or `default` if absent."""
        _check_key(key, namespace)
        found, payload, is_ref = self._call("get", (namespace, key), what=f"get {key!r}")
        return self._unbox(payload, is_ref, namespace, key) if found else default

    def delete(self, key: str, *, namespace: str = DEFAULT_NAMESPACE) -> bool:
        """Remove `key`; True if it was present."""
        _check_key(key, namespace)
        removed = self._call("delete", namespace, key, writer_identity(), what=f"delete {key!r}")
        return cast(bool, removed)

    def delete_prefix(self, prefix: str, *, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Remove every key of `namespace` starting with `prefix` (non-empty); returns how many."""
        _check_key(prefix, namespace)
        removed = self._call(
            "delete_prefix", namespace, prefix, writer_identity(), what=f"delete {prefix!r}*"
        )
        return cast(int, removed)

    def list(self, prefix: str = "", *, namespace: str = DEFAULT_NAMESPACE) -> list[str]:
        """Sorted keys of `namespace` starting with `prefix`."""
        _check_name(namespace, "namespace")
        return cast("list[str]", self._call("list", namespace, prefix, what=f"list {prefix!r}"))

    def wait(self, key: str, timeout: float, *, namespace: str = DEFAULT_NAMESPACE) -> Any:
        """Block until `key` is present and return its value; KVTimeoutError after `timeout` s."""
        _check_key(key, namespace)
        timeout = _check_timeout(timeout)
        status, payload, is_ref = self._call(
            "wait", (namespace, key, timeout), what=f"wait {key!r}", timeout=timeout + RPC_TIMEOUT_S
        )
        if status == "timeout":
            raise KVTimeoutError.from_report(self.run, namespace, key, timeout, payload)
        return self._unbox(payload, is_ref, namespace, key)

    def info(self, key: str, *, namespace: str = DEFAULT_NAMESPACE) -> dict[str, Any] | None:
        """How `key` is stored: stored_as ("inline" or "ref"), size_bytes, writer, time."""
        _check_key(key, namespace)
        return cast(
            "dict[str, Any] | None", self._call("info", namespace, key, what=f"info {key!r}")
        )

    def stats(self) -> dict[str, Any]:
        """Counters (puts, gets, deletes, waits, timeouts, immediate_hits), wait_p50_ms,
        wait_p99_ms (arrival to wake-up), pending_waiters, keys per namespace, ref values."""
        return cast("dict[str, Any]", self._call("stats", what="stats"))

    # -- internals -------------------------------------------------------------------

    def _put_request(
        self, key: str, value: Any, namespace: str, writer: str | None
    ) -> tuple[str, str, Any, bool, int, dict[str, Any]]:
        """The server's put request; a large value goes to the object store as an ObjectRef."""
        _check_key(key, namespace)
        size = estimate_size(value, key)
        is_ref = size > self.large_value_bytes
        payload = ray.put(value) if is_ref else value
        return namespace, key, payload, is_ref, size, writer_identity(writer)

    def _unbox(self, payload: Any, is_ref: bool, namespace: str, key: str) -> Any:
        """The stored value: `payload` itself, or the object its ObjectRef points to."""
        if not is_ref:
            return payload
        try:
            return self._resolve(payload, RPC_TIMEOUT_S, f"fetch the large value of {key!r}")
        except ObjectLostError as err:
            info = self._call("info", namespace, key, what=f"info {key!r}")
            raise self._lost(namespace, key, err, info) from err

    def _lost(
        self, namespace: str, key: str, err: Exception, info: dict[str, Any] | None
    ) -> KVStoreError:
        info = info or {}
        return KVStoreError(
            f"The large value of key {key!r} (namespace {namespace!r}, run {self.run!r}) is lost "
            f"({type(err).__name__}): it lived in Ray's object store, owned by its writer, "
            f"{describe_writer(info.get('writer'))}, which has died. "
            "Have the writer's replacement put it again."
        )

    def _call(self, method: str, *args: Any, what: str, timeout: float = RPC_TIMEOUT_S) -> Any:
        ref = getattr(self._actor, method).remote(*args)
        return self._resolve(ref, timeout, what)

    def _resolve(self, ref: Any, timeout: float, what: str) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except RayActorError as err:
            raise self._dead(what, err) from err
        except GetTimeoutError as err:
            raise self._silent(what, timeout) from err

    def _dead(self, what: str, err: Exception) -> KVStoreError:
        return KVStoreError(
            f"KV store of run {self.run!r} could not {what}: its server actor "
            f"{actor_name(self.run)!r} is dead ({type(err).__name__}). It dies with the driver "
            "that created it unless created with detached=True, and on KVStore.shutdown(). "
            "Check that the driver is alive; recreate the store with KVStore.create(run)."
        )

    def _silent(self, what: str, timeout: float) -> KVStoreError:
        return KVStoreError(
            f"KV store of run {self.run!r} did not answer to {what} within {timeout:g} s. "
            f"Its server {actor_name(self.run)!r} may be overloaded or its node unreachable; "
            "check `ray status` and `rayrl doctor`."
        )


def estimate_size(value: Any, key: str = "") -> int:
    """Bytes `value` takes when serialised, cheaply for buffers, arrays and tensors."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    if isinstance(value, str):
        return len(value)
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = ray.cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except Exception as err:
        raise TypeError(
            f"KV value for key {key!r} cannot be serialised ({type(value).__name__}): {err}. "
            "Store plain data (numbers, strings, lists, dicts, tensors, arrays)."
        ) from err
    return len(data) + sum(b.raw().nbytes for b in buffers)


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"KV {what} must be a non-empty string, got {name!r}")


def _check_key(key: str, namespace: str) -> None:
    _check_name(key, "key")
    _check_name(namespace, "namespace")


def _check_timeout(timeout: float) -> float:
    if timeout is None or float(timeout) < 0:
        raise ValueError(f"KV wait needs a timeout >= 0 seconds, got {timeout!r}")
    return float(timeout)


def kv_latency(kv: KVStore, n: int = 200, *, namespace: str = "bench") -> dict[str, Any]:
    """Time `n` puts, gets and waits from this process; percentiles in milliseconds.

    The wait figure is put-to-wake-up: a wait is parked on the server first, then the
    clock starts, a put is sent, and it stops when the waiter's reply arrives here.
    `kv_rpc_*` is a no-op round trip to the same server: the floor the others sit on.
    """
    timings: dict[str, list[float]] = {"rpc": [], "put": [], "get": [], "wait": []}

    def timed(name: str, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        timings[name].append(time.perf_counter() - t0)

    for i in range(n):
        key = f"lat/{time.monotonic_ns()}/{i}"
        timed("rpc", kv._call, "ping", what="ping")
        timed("put", kv.put, key, i, namespace=namespace)
        timed("get", kv.get, key, namespace=namespace)
        timings["wait"].append(_put_to_wake(kv, key + "/w", namespace))
        kv.delete(key, namespace=namespace)
        kv.delete(key + "/w", namespace=namespace)
    out = {
        f"kv_{name}_p{q}_ms": percentile(values, q) * 1000
        for name, values in timings.items()
        for q in (50, 99)
    }
    return {**out, "n": n}


def _put_to_wake(kv: KVStore, key: str, namespace: str) -> float:
    """Seconds from a put to the wake-up of a waiter already parked on the key."""
    pending = kv._actor.wait.remote((namespace, key, RPC_TIMEOUT_S))
    deadline = time.monotonic() + RPC_TIMEOUT_S
    while kv._call("waiting", namespace, key, what="count waiters") < 1:
        if time.monotonic() > deadline:
            raise KVStoreError(f"benchmark waiter on {key!r} never parked on the KV server")
        time.sleep(0.0005)
    request = kv._put_request(key, 0, namespace, "bench")
    t0 = time.perf_counter()
    kv._actor.put.remote(request)
    status, _, _ = ray.get(pending, timeout=RPC_TIMEOUT_S)
    elapsed = time.perf_counter() - t0
    if status != "ok":
        raise KVStoreError(f"benchmark waiter on {key!r} timed out")
    return elapsed
