"""The memory limit of a whole sandbox call: every process the code starts, together.

A per-process limit (RLIMIT_AS) lets code that forks hold many times the limit (four
children of 400 MB under 512 MB each). So while a call runs, the sandbox's parent
measures the call's process tree (the launcher and everything below it, found through
``/proc/<pid>/task/<tid>/children``; orphans stay in the tree, reparented to the
call's PID-namespace init or to the launcher, a child subreaper) every `POLL_S`
seconds, and kills the tree when its memory together passes the limit.

Memory is what the code itself holds: its anonymous and shared-memory pages
(``RssAnon`` + ``RssShmem`` of ``/proc/<pid>/status``, read in microseconds); the
interpreter's and libraries' file pages are shared with the rest of the machine and
not counted. A forked child shares its parent's pages until it writes them, and the
resident sizes count such a page in both, so a total over the limit is measured again
as proportional sizes (``Pss_Anon`` + ``Pss_Shmem`` of ``smaps_rollup``: a shared
page split among its sharers; milliseconds per process, so only then) before the tree
is killed. A cgroup would count the same pages exactly, but needs a cgroup v2 memory
controller delegated to the trainer, which containers and CI machines rarely have;
reading ``/proc`` works wherever the code runs.

Between two checks the code may allocate past the limit; each process's address space
is also bounded by the limit (RLIMIT_AS), so no single allocation gets far.
"""

from __future__ import annotations

import contextlib
import os
import signal

__all__ = ["POLL_S", "MemoryWatch", "process_tree"]

POLL_S = 0.1  # a few checks a second: a handful of small /proc reads each


def process_tree(root: int) -> list[int]:
    """``root`` and every live process below it (empty when ``root`` is gone)."""
    if not os.path.isdir(f"/proc/{root}/task"):
        return []
    if not _HAS_CHILDREN:
        return _tree_by_scan(root)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:  # ended meanwhile
            continue
        for tid in tasks:
            path = f"/proc/{pid}/task/{tid}/children"
            with contextlib.suppress(OSError, ValueError), open(path) as f:
                todo.extend(int(child) for child in f.read().split())
    return found


def _tree_by_scan(root: int) -> list[int]:
    """`process_tree` on a kernel without ``children`` files: every process's parent."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with (
                contextlib.suppress(OSError, ValueError, IndexError),
                open(f"/proc/{entry}/stat") as f,
            ):
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, ()))
    return found


_HAS_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


class MemoryWatch:
    """The memory of the process tree under ``root`` against ``limit_bytes``."""

    def __init__(self, root: int, limit_bytes: int) -> None:
        self.root, self.limit = root, int(limit_bytes)
        self.peak = 0  # the most the tree held together at a check, in bytes

    def over(self) -> bool:
        """Whether the tree holds more than the limit now (module docstring)."""
        pids = process_tree(self.root)
        total = sum(_kib(pid, "status", ("RssAnon", "RssShmem")) or 0 for pid in pids) << 10
        if total > self.limit:  # pages a fork shares are counted once per process: split them
            total = sum(_proportional_kib(pid) for pid in pids) << 10
        self.peak = max(self.peak, total)
        return total > self.limit

    def kill(self) -> None:
        """SIGKILL every process of the tree (those that left its process group too)."""
        for pid in process_tree(self.root):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _proportional_kib(pid: int) -> int:
    pss = _kib(pid, "smaps_rollup", ("Pss_Anon", "Pss_Shmem"))
    return pss if pss is not None else _kib(pid, "status", ("RssAnon", "RssShmem")) or 0


def _kib(pid: int, name: str, keys: tuple[str, ...]) -> int | None:
    """The sum of ``keys`` (kB lines) of ``/proc/<pid>/<name>``; None when unreadable
    or when it has none of them (an older kernel)."""
    try:
        with open(f"/proc/{pid}/{name}") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    values = [int(line.split()[1]) for line in lines if line.split(":", 1)[0] in keys]
    return sum(values) if values else None
