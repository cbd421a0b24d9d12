"""`GroupMembers`: what the controller's helpers use of a WorkerGroup, as a Protocol.

`RoleView` (`rayrl.controller.colocate`) and `GroupSnapshot`
(`rayrl.controller.recovery`) take the group they work on as an argument; the
concrete `WorkerGroup` imports both modules, so they cannot import it back. This
Protocol names exactly the attributes they use, and `WorkerGroup` satisfies it (mypy
checks that wherever a WorkerGroup is passed to them). It imports nothing of
`rayrl.controller.group`.
"""

from __future__ import annotations

from typing import Any, Protocol

from rayrl.controller.errors import WorkerDescription
from rayrl.controller.layout import DataLayout
from rayrl.controller.watchdog import Watchdog

__all__ = ["GroupMembers"]


class GroupMembers(Protocol):
    """A WorkerGroup as `RoleView` and `GroupSnapshot` see it."""

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def worker_cls(self) -> type: ...

    @property
    def world_size(self) -> int: ...

    @property
    def watchdog(self) -> Watchdog | None: ...

    def actor_handle(self, rank: int, stage: str = ...) -> Any: ...

    def describe(self, rank: int) -> WorkerDescription: ...

    def data_layout(self, name: str | None) -> DataLayout | None: ...

    def _note_error(self, rank: int, err: BaseException) -> None: ...
