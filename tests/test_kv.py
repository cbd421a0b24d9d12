"""KVStore on a real local Ray: put/get/delete/list, namespaces, blocking waits, timeout
reports, 100 concurrent waiters, large values through ObjectRefs, counters."""

from __future__ import annotations

import asyncio
import pickle
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray

from rayrl.cluster.kv import KVStore, KVStoreError, KVTimeoutError, kv_latency


@ray.remote(num_cpus=0)
class Writer:
    """A toy process that writes into a run's KV store."""

    def put(self, kv: KVStore, key: str, value, namespace: str = "default", label=None) -> str:
        kv.put(key, value, namespace=namespace, writer=label)
        return ray.get_runtime_context().get_actor_id()

    def wait(self, kv: KVStore, key: str, timeout: float, namespace: str = "default"):
        return kv.wait(key, timeout, namespace=namespace)

    def get(self, kv: KVStore, key: str, namespace: str = "default"):
        return kv.get(key, namespace=namespace)


def _fresh_store(**kwargs) -> KVStore:
    return KVStore.create(f"test-{uuid.uuid4().hex[:8]}", **kwargs)


@pytest.fixture
def ns() -> str:
    """A namespace of this test's own."""
    return f"ns-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def writer(shared_kv):
    return Writer.remote()


def test_put_get_delete_list(kv, ns):
    kv.put("grp/a", 1, namespace=ns)
    kv.put("grp/b", {"x": [1, 2]}, namespace=ns)
    kv.put("other", "z", namespace=ns)
    assert kv.get("grp/a", namespace=ns) == 1
    assert kv.get("grp/b", namespace=ns) == {"x": [1, 2]}
    assert kv.get("missing", namespace=ns) is None
    assert kv.get("missing", default=7, namespace=ns) == 7
    assert kv.list("grp/", namespace=ns) == ["grp/a", "grp/b"]
    assert kv.list(namespace=ns) == ["grp/a", "grp/b", "other"]
    assert kv.delete("grp/a", namespace=ns) is True
    assert kv.delete("grp/a", namespace=ns) is False
    assert kv.list("grp/", namespace=ns) == ["grp/b"]
    assert kv.get("grp/a", namespace=ns) is None


def test_namespaces_are_isolated(kv, ns):
    kv.put("k", "in-a", namespace=ns + "a")
    kv.put("k", "in-b", namespace=ns + "b")
    assert kv.get("k", namespace=ns + "a") == "in-a"
    assert kv.get("k", namespace=ns + "b") == "in-b"
    assert kv.get("k", namespace=ns) is None
    assert kv.list(namespace=ns + "a") == ["k"]
    assert kv.delete("k", namespace=ns + "a")
    assert kv.get("k", namespace=ns + "b") == "in-b"
    with pytest.raises(KVTimeoutError, match=f"present in namespace.*'{ns}b'"):
        kv.wait("k", 0.05, namespace=ns)


def test_create_is_get_or_create_and_connect(kv, ns):
    kv.put("x", 1, namespace=ns)
    assert KVStore.create(kv.run).get("x", namespace=ns) == 1
    assert KVStore.connect(kv.run).get("x", namespace=ns) == 1
    with pytest.raises(KVStoreError, match="No KV store for run 'no-such-run'.*KVStore.create"):
        KVStore.connect("no-such-run")


def test_store_passes_to_workers_and_records_writer(kv, ns, writer):
    actor_id = ray.get(writer.put.remote(kv, "w/key", 42, ns, label="rank 3"))
    assert kv.get("w/key", namespace=ns) == 42
    info = kv.info("w/key", namespace=ns)
    assert info["writer"]["label"] == "rank 3"
    assert info["writer"]["actor_id"] == actor_id
    assert info["writer"]["task"] == "Writer.put"
    kv.put("w/key2", 1, namespace=ns)
    assert kv.info("w/key2", namespace=ns)["writer"]["actor_id"] is None  # the driver


def _wake_after_put(kv: KVStore, key: str, ns: str) -> float:
    """Seconds from sending a put to the return of a wait already parked on the key."""
    got: dict = {}

    def waiter():
        got["value"] = kv.wait(key, timeout=30, namespace=ns)
        got["woke"] = time.perf_counter()

    thread = threading.Thread(target=waiter)
    thread.start()
    deadline = time.monotonic() + 10
    while kv._call("waiting", ns, key, what="count") < 1:
        assert time.monotonic() < deadline, "waiter never parked on the server"
        time.sleep(0.01)
    sent = time.perf_counter()
    kv.put(key, "here", namespace=ns)
    thread.join(timeout=10)
    assert got["value"] == "here"
    assert kv._call("waiting", ns, key, what="count") == 0
    return got["woke"] - sent


def test_wait_wakes_on_put(kv, ns):
    # Five wake-ups take a few ms in all (about 1 ms each). A poll loop with a 500 ms
    # period would need 1.25 s on average, and five under 0.5 s less than 1% of the time.
    total = sum(_wake_after_put(kv, f"late/{i}", ns) for i in range(5))
    assert total < 0.5, total


def test_wait_from_a_worker_wakes_on_driver_put(kv, ns, writer):
    pending = writer.wait.remote(kv, "from/driver", 30, ns)
    deadline = time.monotonic() + 10
    while kv._call("waiting", ns, "from/driver", what="count") < 1:
        assert time.monotonic() < deadline, "worker's wait never parked on the server"
        time.sleep(0.01)
    kv.put("from/driver", [1, 2, 3], namespace=ns)
    assert ray.get(pending, timeout=10) == [1, 2, 3]


def test_wait_returns_at_once_when_present(kv, ns):
    kv.put("ready", 5, namespace=ns)
    before = kv.stats()["immediate_hits"]
    start = time.perf_counter()
    assert kv.wait("ready", timeout=10, namespace=ns) == 5
    assert time.perf_counter() - start < 2.0
    assert kv.stats()["immediate_hits"] == before + 1


def test_timeout_message_has_every_part(kv, ns, writer):
    actor_id = ray.get(writer.put.remote(kv, "trainer/gen0/mastr", 1, ns, label="rank 0"))
    kv.put("trainer/gen0/rank1", 2, namespace=ns)
    kv.delete("trainer/gen0/rank1", namespace=ns)
    start = time.perf_counter()
    with pytest.raises(KVTimeoutError) as info:
        kv.wait("trainer/gen0/master", 0.4, namespace=ns)
    assert 0.35 < time.perf_counter() - start < 5
    err = info.value
    msg = str(err)
    assert isinstance(err, TimeoutError)
    assert "'trainer/gen0/master'" in msg  # the key
    assert f"namespace '{ns}'" in msg  # the namespace
    assert "after 0.4 s" in msg  # how long it waited
    assert "nearest present keys: 'trainer/gen0/mastr'" in msg  # nearest keys
    assert "under prefix 'trainer/gen0/'" in msg and "'rank 0'" in msg  # last writer
    assert actor_id in msg and "Writer.put" in msg
    assert "What to do" in msg and "alive" in msg
    assert err.key == "trainer/gen0/master" and err.namespace == ns and err.run == kv.run
    assert err.nearest == ["trainer/gen0/mastr"]
    assert err.last_write["writer"]["actor_id"] == actor_id
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == msg and copy.nearest == err.nearest and copy.waited_s == err.waited_s


def test_timeout_names_a_deleted_key(kv, ns):
    kv.put("gone", 1, namespace=ns)
    kv.delete("gone", namespace=ns)
    with pytest.raises(KVTimeoutError, match="this key was deleted .* by .*the driver"):
        kv.wait("gone", 0.05, namespace=ns)


def test_timeout_raised_in_a_worker_reaches_the_driver(kv, ns, writer):
    with pytest.raises(KVTimeoutError, match="'nowhere'"):
        ray.get(writer.wait.remote(kv, "nowhere", 0.1, ns))


def test_timeout_with_empty_namespace(kv, ns):
    with pytest.raises(KVTimeoutError, match="nothing was ever written"):
        kv.wait("a/b", 0.05, namespace=ns)
    with pytest.raises(ValueError, match="timeout"):
        kv.wait("a/b", -1)
    with pytest.raises(ValueError, match="key must be a non-empty string"):
        kv.put("", 1)


def test_hundred_concurrent_waiters(kv, ns):
    before = kv.stats()

    keys = ["go"] * 100 + [f"own/{i}" for i in range(100)]
    with ThreadPoolExecutor(max_workers=len(keys)) as pool:  # one blocked caller each
        waits = [pool.submit(kv.wait, key, 30, namespace=ns) for key in keys]
        deadline = time.monotonic() + 20
        while kv.stats()["pending_waiters"] < before["pending_waiters"] + 200:
            assert time.monotonic() < deadline, kv.stats()
            time.sleep(0.02)
        kv.put("go", "all", namespace=ns)
        for i in range(100):
            kv.put(f"own/{i}", i, namespace=ns)
        results = [w.result(timeout=60) for w in waits]
    assert results[:100] == ["all"] * 100
    assert results[100:] == list(range(100))
    after = kv.stats()
    assert after["waits"] - before["waits"] == 200
    assert after["timeouts"] == before["timeouts"]
    assert after["pending_waiters"] == before["pending_waiters"]


def test_large_value_goes_through_object_ref(kv, ns, writer):
    big = np.arange(200_000, dtype=np.int64)  # 1.6 MB
    before = kv.stats()
    kv.put("big", big, namespace=ns)
    kv.put("small", b"x" * 100, namespace=ns)
    info = kv.info("big", namespace=ns)
    assert info["stored_as"] == "ref" and info["payload_type"] == "ObjectRef"
    assert info["size_bytes"] == big.nbytes
    assert kv.info("small", namespace=ns)["stored_as"] == "inline"
    np.testing.assert_array_equal(kv.get("big", namespace=ns), big)
    np.testing.assert_array_equal(kv.wait("big", 5, namespace=ns), big)
    np.testing.assert_array_equal(ray.get(writer.get.remote(kv, "big", ns)), big)
    stats = kv.stats()
    assert stats["ref_values"] - before["ref_values"] == 1
    assert stats["ref_bytes"] - before["ref_bytes"] == big.nbytes
    assert kv.delete("big", namespace=ns)
    assert kv.stats()["ref_values"] == before["ref_values"]


def test_large_value_threshold_is_configurable(kv, ns):
    tiny = KVStore.connect(kv.run, large_value_bytes=16)
    tiny.put("s", "a string longer than sixteen bytes", namespace=ns)
    assert kv.info("s", namespace=ns)["stored_as"] == "ref"
    assert kv.get("s", namespace=ns) == "a string longer than sixteen bytes"
    tiny.put("t", "short", namespace=ns)
    assert kv.info("t", namespace=ns)["stored_as"] == "inline"


def test_large_value_of_a_dead_writer_is_reported_lost(kv, ns):
    doomed = Writer.remote()
    ray.get(doomed.put.remote(kv, "ckpt/blob", np.ones(100_000), ns, label="rank 2"))
    ray.kill(doomed)
    deadline = time.monotonic() + 20  # the writer's process exits shortly after the kill
    while True:
        try:
            kv.get("ckpt/blob", namespace=ns)
        except KVStoreError as err:
            assert re.search("is lost.*'rank 2'.*has died", str(err)), err
            break
        assert time.monotonic() < deadline, "value of a killed writer still readable after 20 s"
        time.sleep(0.2)


def test_stats_counters(ray_local):
    kv = _fresh_store()
    try:
        kv.put("a", 1)
        kv.put("b", 2, namespace="n2")
        kv.get("a")
        kv.get("zz")
        kv.delete("a")
        kv.wait("b", 1, namespace="n2")
        with pytest.raises(KVTimeoutError):
            kv.wait("c", 0.05)
        stats = kv.stats()
        assert stats["puts"] == 2 and stats["gets"] == 2 and stats["deletes"] == 1
        assert stats["waits"] == 2 and stats["timeouts"] == 1 and stats["immediate_hits"] == 1
        assert stats["keys"] == {"n2": 1} and stats["pending_waiters"] == 0
        assert 0 <= stats["wait_p50_ms"] <= stats["wait_p99_ms"] < 1000
    finally:
        kv.shutdown()
    with pytest.raises(KVStoreError, match="is dead.*KVStore.create"):
        kv.get("a")


def test_kv_latency_reports_percentiles(kv):
    out = kv_latency(kv, 10, namespace="bench-test")
    for name in ("rpc", "put", "get", "wait"):
        assert 0 < out[f"kv_{name}_p50_ms"] <= out[f"kv_{name}_p99_ms"]
    assert kv.list(namespace="bench-test") == []


def test_server_logic_without_ray(monkeypatch):
    """The actor class on a plain event loop: wake-up, timeout report, bounded history."""
    from rayrl.cluster import kv_server
    from rayrl.cluster.kv_errors import nearest_keys
    from rayrl.cluster.kv_server import KVServer, parent_prefixes, percentile

    assert parent_prefixes("a/b/c") == ["a/b/", "a/", ""]
    assert parent_prefixes("flat") == [""]
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile(list(range(100)), 99) == 98
    monkeypatch.setattr(kv_server, "HISTORY_LIMIT", 3)
    me = {"label": "t"}

    async def scenario():
        server = KVServer("unit")
        waiter = asyncio.ensure_future(server.wait(("ns", "g/k", 5.0)))
        while server.waiting("ns", "g/k") != 1:
            await asyncio.sleep(0)
        server.put(("ns", "g/k", "v", False, 1, me))
        assert await waiter == ("ok", "v", False) and server.waiting("ns", "g/k") == 0
        for i in range(5):
            server.put(("ns", f"old/{i}", i, False, 1, me))
            server.delete("ns", f"old/{i}", me)
        status, report, _ = await server.wait(("ns", "g/missing", 0.01))
        assert status == "timeout" and nearest_keys("g/missing", report) == ["g/k"]
        assert report["last_write"]["key"] == "g/k" and report["last_write"]["prefix"] == "g/"
        assert len(server._history["ns"]) == 3  # bounded; the live key's writer is still known
        for key in ("p/a", "p/b", "q/a"):
            server.put(("ns", key, 1, False, 1, me))
        assert server.list("ns", "p/") == ["p/a", "p/b"]
        assert server.delete_prefix("ns", "p/", me) == 2
        assert server.list("ns", "") == ["g/k", "q/a"]

    asyncio.run(scenario())


def test_timeout_report_is_cheap_in_a_big_namespace():
    """10k keys: a timeout report is bisect and slices, not a scan of the namespace."""
    from rayrl.cluster.kv_errors import KVTimeoutError
    from rayrl.cluster.kv_server import KVServer

    me = {"label": "t"}
    server = KVServer("big")
    for i in range(10_000):
        server.put(("ns", f"grp{i % 100}/gen{i}/ranks/{i}", i, False, 1, me))
    server.put(("ns", "trainer/gen0/mastr", 1, False, 1, me))
    start = time.perf_counter()
    for _ in range(100):
        report = server._timeout_report("ns", "trainer/gen0/master", 0.1)
    per_report_ms = (time.perf_counter() - start) * 10
    assert per_report_ms < 5, per_report_ms  # was ~300 ms with difflib over every key
    err = KVTimeoutError.from_report("big", "ns", "trainer/gen0/master", 0.1, report)
    assert err.nearest[0] == "trainer/gen0/mastr" and err.last_write["key"] == "trainer/gen0/mastr"


def test_server_process_has_few_threads(kv):
    """Parked waiters are futures on one event loop, not threads (there were 1,063)."""
    import os

    pid = ray.get(kv._actor.__ray_call__.remote(lambda self: os.getpid()))
    # Ray's own thread pools grow with the machine's cores (49 threads on a 16-core
    # machine, about 30 on 2 cores); the waiters add none
    assert len(os.listdir(f"/proc/{pid}/task")) <= 64 + 2 * (os.cpu_count() or 1)
