"""What the modules that carry a worker group's phases read of it: `GroupCore`.

`WorkerGroup` (`rayrl.controller.group`) is one class whose phases live in modules of
their own: forming and replacing ranks (`formation`), health checks (`health`),
bundles for new ranks (`placement`), starting several groups at once (`startup`) and
the watchdog (`watchdog`). The group imports them; they read the group through this
protocol, so no arrow runs back from them to the group. `WorkerGroup` satisfies it
(mypy checks where the group hands itself over).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ray import ObjectRef

from rayrl.cluster.bundle import Bundle
from rayrl.cluster.pool import ResourcePool
from rayrl.controller.errors import WorkerDescription, WorkerError
from rayrl.controller.worker import WorkerContext

__all__ = ["GroupCore"]


class GroupCore(Protocol):
    """A worker group as its phase modules read it (module docstring)."""

    name: str
    scope: str  # the group's KV namespace for this life of it
    bundles: list[Bundle]
    pool: ResourcePool | None
    actors: list[Any]  # a rank's actor handle (None: not started, or lost)
    infos: list[dict[str, Any]]
    generation: int
    formed: bool
    built: list[int | None]
    backend: str | None
    dist_timeout_s: float
    pg_timeout_s: float | None
    abort_grace_s: float
    placement_timeout_s: float
    dead: set[int]
    lock: threading.RLock
    _replacing: set[int]
    _init_kwargs: dict[str, Any] | None

    @property
    def world_size(self) -> int: ...

    @property
    def forms_process_group(self) -> bool: ...

    def describe(self, rank: int) -> WorkerDescription: ...

    def replacing(
        self, ranks: Iterable[int]
    ) -> AbstractContextManager[Callable[[Iterable[int]], None]]: ...

    def create(self, timeout_s: float = 60.0, *, blocking: bool = True) -> Any: ...

    def init(
        self,
        timeout_s: float = 600.0,
        retries: int = 0,
        backend: str | None = None,
        dist_timeout_s: float = 60.0,
        pg_timeout_s: float | None = None,
        *,
        blocking: bool = True,
        **kwargs: Any,
    ) -> Any: ...

    def check_health(self, timeout_s: float = 5.0) -> Any: ...

    def replace(self, rank: Any, timeout_s: float = ..., retries: int = ...) -> Any: ...

    def shutdown(self) -> None: ...

    def _context(self, rank: int) -> WorkerContext: ...

    def _spawn(self, rank: int) -> ObjectRef: ...

    def _collect_setup(
        self, pending: dict[int, ObjectRef], timeout_s: float
    ) -> dict[int, BaseException]: ...

    def _kill(self, rank: int) -> None: ...

    def _drop_discovery_keys(self, keep: str | None = None) -> None: ...

    def _raise(
        self,
        error: type[WorkerError],
        stage: str,
        failures: dict[int, Any],
        timeout_s: float,
        attempts: int = 1,
        cleanup: bool = False,
    ) -> None: ...
