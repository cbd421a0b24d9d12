"""KVServer: the Ray actor behind a run's KVStore (one per run, `rayrl/<run>/kv`).

It holds namespaced keys, wakes waiters without polling, records who wrote what and
when (so a wait that times out can say who last wrote nearby), and keeps counters and
wait-time samples for `KVStore.stats()`.

It is an asyncio actor: every call runs on one event loop, so the state needs no lock,
and a parked waiter is a future on that loop, not a thread. Puts, gets and the other
calls are plain methods, which Ray runs on the loop; only `wait` is a coroutine. The
process has Ray's own threads plus the loop's, whatever the number of waiters (it had
a pre-created thread per possible waiter, 1,024, as a threaded actor).

Every call is cheap whatever the namespace's size: keys are also kept sorted per
namespace (bisect for `list`, prefix deletes and the keys around a missing one), and
the last puts under each key prefix are indexed as they happen. A wait that times out
returns raw material (keys around the missing one, the last writer nearby); the client
ranks and formats it (`KVTimeoutError.from_report`), so a burst of timeouts never stalls
the server.

The hot calls (put, get, wait) take one request tuple: Ray serialises each argument of
a call separately, and a value nested in a tuple is never resolved by Ray, so an
ObjectRef the caller stores stays a ref. Large values arrive as an ObjectRef (the
client `ray.put`s them): the server keeps only the reference. Clients talk to it
through `rayrl.cluster.kv.KVStore`; nothing here is public API.
"""

from __future__ import annotations

import asyncio
import bisect
import builtins
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

# The most calls (parked waits included) the server runs at once; each is a coroutine.
MAX_CONCURRENT_CALLS = 8192
# Recent wait-time samples kept for the p50/p99 figures.
WAIT_SAMPLES = 20_000
# Keys on each side of a missing key, and under its parent prefix, sent in a timeout report.
NEIGHBOURS = 8
# Put/delete records kept per namespace (oldest dropped first) for timeout reports.
HISTORY_LIMIT = 10_000
# Recent puts remembered per key prefix (the latest still present is the "last writer").
PUTS_PER_PREFIX = 8


@dataclass
class Entry:
    """One stored value: the payload (inline object or ObjectRef), its size and writer."""

    payload: Any
    is_ref: bool
    size: int
    writer: dict[str, Any]
    time: float


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile `q` (0..100) of `samples`; 0.0 when there are none."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[index]


def parent_prefixes(key: str) -> list[str]:
    """The ancestors of `key` from nearest to root: 'a/b/c' -> ['a/b/', 'a/', '']."""
    parts = key.split("/")[:-1]
    return ["/".join(parts[:i]) + "/" for i in range(len(parts), 0, -1)] + [""]


class KVServer:
    """Actor state: sorted namespaces of keys, waiter futures, write history, counters."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.started = time.time()
        self._data: dict[str, dict[str, Entry]] = {}
        self._sorted: dict[str, list[str]] = {}
        self._waiters: dict[tuple[str, str], list[asyncio.Future[Entry]]] = {}
        # Last put/delete per key, oldest first, kept after deletion, for timeout reports.
        self._history: dict[str, dict[str, dict[str, Any]]] = {}
        # Per namespace and key prefix: the latest puts under it (key, newest last).
        self._puts: dict[str, dict[str, deque[str]]] = {}
        self._wait_ms: deque[float] = deque(maxlen=WAIT_SAMPLES)
        self._counts = {"puts": 0, "gets": 0, "deletes": 0, "waits": 0, "timeouts": 0}
        self._counts["immediate_hits"] = 0

    def ping(self) -> str:
        """Liveness check; returns the run name."""
        return self.run

    def put(self, request: tuple[str, str, Any, bool, int, dict[str, Any]]) -> None:
        """Store (namespace, key, payload, is_ref, size, writer) and wake the key's waiters."""
        namespace, key, payload, is_ref, size, writer = request
        now = time.time()
        self._counts["puts"] += 1
        entry = Entry(payload, is_ref, size, writer, now)
        data = self._data.setdefault(namespace, {})
        if key not in data:
            bisect.insort(self._sorted.setdefault(namespace, []), key)
        data[key] = entry
        self._remember(namespace, key, "put", writer, now)
        self._index_put(namespace, key)
        for future in self._waiters.pop((namespace, key), ()):
            if not future.done():
                future.set_result(entry)

    def get(self, request: tuple[str, str]) -> tuple[bool, Any, bool]:
        """(found, payload, is_ref) for (namespace, key)."""
        namespace, key = request
        self._counts["gets"] += 1
        entry = self._data.get(namespace, {}).get(key)
        if entry is None:
            return False, None, False
        return True, entry.payload, entry.is_ref

    def delete(self, namespace: str, key: str, writer: dict[str, Any]) -> bool:
        """Remove the key; True if it was present. Its ObjectRef (if any) is released."""
        self._counts["deletes"] += 1
        if key not in self._data.get(namespace, {}):
            return False
        self._drop(namespace, [key], writer)
        return True

    def delete_prefix(self, namespace: str, prefix: str, writer: dict[str, Any]) -> int:
        """Remove every key of the namespace starting with `prefix`; returns how many."""
        keys = self.list(namespace, prefix)
        self._counts["deletes"] += len(keys)
        self._drop(namespace, keys, writer)
        return len(keys)

    def _drop(self, namespace: str, keys: list[str], writer: dict[str, Any]) -> None:
        data, ordered, now = (
            self._data.get(namespace, {}),
            self._sorted.get(namespace, []),
            time.time(),
        )
        for key in keys:
            if data.pop(key, None) is None:
                continue
            i = bisect.bisect_left(ordered, key)
            del ordered[i]
            self._remember(namespace, key, "delete", writer, now)
        if not data:
            self._data.pop(namespace, None)
            self._sorted.pop(namespace, None)

    def _remember(
        self, namespace: str, key: str, op: str, writer: dict[str, Any], when: float
    ) -> None:
        """Record the latest operation on a key, keeping at most HISTORY_LIMIT keys."""
        history = self._history.setdefault(namespace, {})
        history.pop(key, None)
        history[key] = {"op": op, "writer": writer, "time": when}
        if len(history) > HISTORY_LIMIT:
            del history[next(iter(history))]

    def _index_put(self, namespace: str, key: str) -> None:
        """Note a put under each ancestor prefix of `key` (bounded per namespace)."""
        index = self._puts.setdefault(namespace, {})
        for prefix in parent_prefixes(key):
            recent = index.pop(prefix, None) or deque(maxlen=PUTS_PER_PREFIX)
            if key in recent:
                recent.remove(key)
            recent.append(key)
            index[prefix] = recent  # re-inserted: the dict stays oldest-first
        while len(index) > HISTORY_LIMIT:
            del index[next(iter(index))]

    def list(self, namespace: str, prefix: str) -> list[str]:
        """Sorted keys of the namespace that start with `prefix`."""
        ordered = self._sorted.get(namespace, [])
        start = bisect.bisect_left(ordered, prefix)
        end = len(ordered)
        if prefix:
            end = bisect.bisect_left(ordered, prefix[:-1] + chr(ord(prefix[-1]) + 1), start)
        return ordered[start:end]

    def info(self, namespace: str, key: str) -> dict[str, Any] | None:
        """How a key is stored (inline or as an ObjectRef), its size, writer and time."""
        entry = self._data.get(namespace, {}).get(key)
        if entry is None:
            return None
        return {
            "stored_as": "ref" if entry.is_ref else "inline",
            "size_bytes": entry.size,
            "writer": entry.writer,
            "time": entry.time,
            "payload_type": type(entry.payload).__name__,
        }

    async def wait(self, request: tuple[str, str, float]) -> tuple[str, Any, bool]:
        """Wait until (namespace, key) exists or `timeout` seconds pass.

        Returns ("ok", payload, is_ref) or ("timeout", report, False) where report holds
        what a `KVTimeoutError` needs (keys around the missing one, last writer, ...).
        """
        namespace, key, timeout = request
        arrived = time.monotonic()
        self._counts["waits"] += 1
        entry = self._data.get(namespace, {}).get(key)
        if entry is not None:
            self._counts["immediate_hits"] += 1
        else:
            entry = await self._park(namespace, key, timeout)
        waited = time.monotonic() - arrived
        if entry is None:
            self._counts["timeouts"] += 1
            return "timeout", self._timeout_report(namespace, key, waited), False
        self._wait_ms.append(waited * 1000.0)
        return "ok", entry.payload, entry.is_ref

    async def _park(self, namespace: str, key: str, timeout: float) -> Entry | None:
        """A future on the key that the next put resolves; None after `timeout` s."""
        future = asyncio.get_running_loop().create_future()
        parked = self._waiters.setdefault((namespace, key), [])
        parked.append(future)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            if future in parked:
                parked.remove(future)
                if not parked and self._waiters.get((namespace, key)) is parked:
                    del self._waiters[(namespace, key)]

    def _timeout_report(self, namespace: str, key: str, waited: float) -> dict[str, Any]:
        """Raw facts about the neighbourhood of a key that never arrived (cheap to build:
        bisect and slices; the client ranks the candidates)."""
        ordered = self._sorted.get(namespace, [])
        at = bisect.bisect_left(ordered, key)
        candidates = ordered[max(0, at - NEIGHBOURS) : at + NEIGHBOURS]
        parent = parent_prefixes(key)[0]
        if parent:
            candidates += self._under(ordered, parent, NEIGHBOURS)
        return {
            "waited_s": waited,
            "candidates": list(dict.fromkeys(candidates)),
            "parent": parent,
            "last_write": self._last_write_near(namespace, key),
            "key_history": self._history.get(namespace, {}).get(key),
            "other_namespaces": sorted(
                ns for ns, d in self._data.items() if ns != namespace and key in d
            ),
            "namespace_size": len(ordered),
        }

    @staticmethod
    def _under(ordered: builtins.list[str], prefix: str, n: int) -> builtins.list[str]:
        start = bisect.bisect_left(ordered, prefix)
        return [k for k in ordered[start : start + n] if k.startswith(prefix)]

    def _last_write_near(self, namespace: str, key: str) -> dict[str, Any] | None:
        """The latest put, of a key still present, under the nearest ancestor prefix of
        `key` that has one."""
        index, data = self._puts.get(namespace, {}), self._data.get(namespace, {})
        for prefix in parent_prefixes(key):
            for near in reversed(index.get(prefix, ())):
                entry = data.get(near)
                if entry is not None:
                    return {
                        "prefix": prefix,
                        "key": near,
                        "writer": entry.writer,
                        "time": entry.time,
                    }
        return None

    def stats(self) -> dict[str, Any]:
        """Counters, wait-time percentiles (ms) and key counts per namespace."""
        samples = list(self._wait_ms)
        refs = [e for d in self._data.values() for e in d.values() if e.is_ref]
        return {
            "run": self.run,
            **self._counts,
            "wait_p50_ms": percentile(samples, 50),
            "wait_p99_ms": percentile(samples, 99),
            "pending_waiters": sum(len(w) for w in self._waiters.values()),
            "keys": {ns: len(d) for ns, d in sorted(self._data.items())},
            "ref_values": len(refs),
            "ref_bytes": sum(e.size for e in refs),
            "uptime_s": time.time() - self.started,
        }

    def waiting(self, namespace: str, key: str) -> int:
        """How many waiters are parked on the key right now (for tests and benchmarks)."""
        return len(self._waiters.get((namespace, key), ()))
