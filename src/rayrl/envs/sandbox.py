"""Running untrusted code (a model's) in a child process that cannot harm the trainer.

`Sandbox.run_python(code)` runs the code in a separate process and returns a
`SandboxResult` (exit code or signal, stdout and stderr, truncated to a limit, whether
it timed out, and how it was isolated). Nothing the code does raises here. Each run:

- starts in a new session with an **empty environment** (no variable of the trainer:
  no credentials), with stdin closed;
- has **resource limits**: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS, so a
  huge allocation fails inside the code), file size (RLIMIT_FSIZE), open files and
  processes (RLIMIT_NPROC: a fork bomb stops at the limit);
- has a **memory limit for the whole call**: the memory of every process the code
  starts, together, is checked a few times a second and the call killed when it
  passes the limit (`rayrl.envs.sandbox_memory`: forked children cannot hold many
  times the limit between them);
- is **killed** at the wall-clock timeout with its whole process group, and with its
  whole PID namespace where there is one (a process that left the group dies too);
- gets a **temporary working directory**, removed after;
- runs, when the trainer is root, as a **fresh unprivileged uid** of its own (so the
  process limit counts only its own processes, it cannot signal or read the trainer's
  processes, and the trainer's files are not writable), in **new namespaces**:
  network (no interface up, so no connection anywhere, not even to 127.0.0.1), mount
  (private tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``: the only
  world-writable places; what is written there vanishes with the run), PID (a fresh
  ``/proc``: the trainer's processes are invisible) and IPC;
- when the trainer is not root, runs as the trainer's uid inside a new user namespace
  where the kernel allows unprivileged ones (network, mount and PID namespaces then
  work as above, but files the trainer's uid can write stay writable); else with the
  limits and the empty environment only.

What was isolated and what was not, with the reason, is in `SandboxResult.isolation`.
The launcher that does all this is `rayrl.envs._sandbox_child`.

When root, the code runs a Python interpreter the sandbox's uid can execute: the
trainer's own if every directory above it is world-readable, else the first of
``/usr/bin/python3``, ``/usr/local/bin/python3`` that is (``python=`` overrides).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rayrl.envs.sandbox_memory import POLL_S, MemoryWatch

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult"]

_LAUNCHER = Path(__file__).with_name("_sandbox_child.py")
_UID_RANGE = (200_000, 260_000)  # fresh uids for sandboxes (no passwd entry needed)
_SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
_CODE_FILE = "main.py"
_RUN_TASKS = 4  # a run's own tasks beside the code's: its 3 pipe readers and the launcher


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run.

    Attributes:
        timeout_s: wall-clock seconds before the run is killed.
        cpu_s: CPU seconds per process (None: the timeout rounded up, plus one).
        memory_bytes: memory of the whole call (its processes together, checked a few
            times a second) and the address space of each of its processes.
        file_size_bytes: largest file it may write.
        max_processes: processes (and threads) it may have at once.
        max_open_files: file descriptors per process.
        max_output_bytes: stdout and stderr kept, each (the rest is dropped, marked).
        scratch_bytes: size of each private tmpfs (the working directory's included).
    """

    timeout_s: float = 10.0
    cpu_s: int | None = None
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    max_processes: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64 << 10
    scratch_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_bytes", "file_size_bytes", "max_processes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)} must be > 0.")


@dataclass
class SandboxResult:
    """How a run ended. ``exit_code`` is None when a signal ended it (``signal``), when
    it was killed at the timeout (``timed_out``) or for holding more memory than the
    limit, its processes together (``memory_exceeded``; ``peak_memory_bytes`` is the
    most they held at a check); ``error`` is set when the sandbox itself could not
    start the code."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    memory_exceeded: bool = False
    peak_memory_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0
    isolation: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the code ran and exited with status 0."""
        return (
            self.exit_code == 0
            and not (self.timed_out or self.memory_exceeded)
            and self.error is None
        )

    def summary(self) -> str:
        """The result as the model sees it: output, then what went wrong, if anything."""
        parts = []
        if self.stdout:
            parts.append(self.stdout + ("\n...(output truncated)" if self.stdout_truncated else ""))
        if self.stderr and not self.ok:
            parts.append(
                "stderr:\n"
                + self.stderr
                + ("\n...(output truncated)" if self.stderr_truncated else "")
            )
        if self.error:
            parts.append(f"Error: the sandbox could not run the code: {self.error}")
        elif self.timed_out:
            parts.append(f"Error: killed after {self.duration_s:.1f} s (time limit).")
        elif self.memory_exceeded:
            held = self.peak_memory_bytes / (1 << 20)
            parts.append(
                f"Error: killed: its processes held {held:.0f} MB together (memory limit)."
            )
        elif self.signal is not None:
            parts.append(f"Error: killed by signal {_signal_name(self.signal)}.")
        elif self.exit_code:
            parts.append(f"Exit code {self.exit_code}.")
        return "\n".join(parts) if parts else "(no output)"


class Sandbox:
    """Runs code in isolated child processes; see the module docstring.

    Args:
        limits: the limits of every run.
        python: the interpreter that runs the code (default: see the module docstring).
        isolate_network: False leaves the network reachable (no network namespace).
        user_namespace: when not root, try a user namespace (for the other namespaces).
        allow_root: run even when root could not drop to an unprivileged uid (never
            on by default: the run fails instead).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        python: str | None = None,
        isolate_network: bool = True,
        user_namespace: bool = True,
        allow_root: bool = False,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.root = os.geteuid() == 0
        self.python = python or _default_python(self.root)
        self.isolate_network = isolate_network
        self.user_namespace = user_namespace
        self.allow_root = allow_root

    def run_python(self, code: str, *, timeout_s: float | None = None) -> SandboxResult:
        """Run ``code`` as a Python script (``python -I main.py``) in a fresh sandbox."""
        return self.run([self.python, "-I", _CODE_FILE], {_CODE_FILE: code}, timeout_s=timeout_s)

    def run(
        self, argv: list[str], files: dict[str, str], *, timeout_s: float | None = None
    ) -> SandboxResult:
        """Run ``argv`` (``argv[0]`` an absolute path) in a working directory holding
        ``files`` (name -> text). Never raises for what the code does."""
        limits = self.limits
        timeout = float(timeout_s or limits.timeout_s)
        host_dir = tempfile.mkdtemp(prefix="rayrl-sandbox-")
        uid = random.randrange(*_UID_RANGE) if self.root else None
        request = self._request(argv, files, host_dir, uid, timeout)
        try:
            return self._launch(request, timeout, uid)
        except OSError as err:  # could not even start the launcher
            return SandboxResult(error=f"{type(err).__name__}: {err}")
        finally:
            if uid is not None:
                _kill_uid(uid)
            shutil.rmtree(host_dir, ignore_errors=True)

    def _request(self, argv, files, host_dir: str, uid: int | None, timeout: float) -> dict:
        limits = self.limits
        if uid is None:  # RLIMIT_NPROC counts every thread of our uid: leave room
            nproc = _process_count(os.getuid()) + _RUN_TASKS + limits.max_processes
        else:
            nproc = limits.max_processes
        return {
            "argv": list(argv),
            "files": dict(files),
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"},
            "host_workdir": host_dir,
            "uid": uid,
            "isolate_network": self.isolate_network,
            "user_namespace": self.user_namespace,
            "cpu_s": int(limits.cpu_s or math.ceil(timeout) + 1),
            "memory_bytes": int(limits.memory_bytes),
            "file_size_bytes": int(limits.file_size_bytes),
            "max_open_files": int(limits.max_open_files),
            "nproc": int(nproc),
            "scratch_bytes": int(limits.scratch_bytes),
        }

    def _launch(self, request: dict, timeout: float, uid: int | None) -> SandboxResult:
        if self.root and uid is None and not self.allow_root:
            return SandboxResult(error="running as root without a uid to drop to")
        report_r, report_w = os.pipe()
        start = time.perf_counter()
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", str(_LAUNCHER), str(report_w)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                cwd="/",
                start_new_session=True,
                pass_fds=(report_w,),
            )
        finally:
            os.close(report_w)
        readers = [
            _Reader(proc.stdout, self.limits.max_output_bytes),
            _Reader(proc.stderr, self.limits.max_output_bytes),
            _Reader(os.fdopen(report_r, "rb"), 1 << 20),
        ]
        assert proc.stdin is not None  # stdin=PIPE
        try:
            proc.stdin.write(json.dumps(request).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        memory = MemoryWatch(proc.pid, self.limits.memory_bytes)
        ended = _wait(proc, start + timeout, memory)
        if ended == "memory":
            memory.kill()  # the processes that left the group too
        _kill_group(proc)
        if uid is not None:  # anything that left the group and the PID namespace
            _kill_uid(uid)
        duration = time.perf_counter() - start
        for reader in readers:
            reader.join(timeout=5.0)
        result = _result(readers, ended != "exit", duration)
        result.timed_out, result.memory_exceeded = ended == "timeout", ended == "memory"
        result.peak_memory_bytes = memory.peak
        return result


def _wait(proc: subprocess.Popen, deadline: float, memory: MemoryWatch) -> str:
    """Wait for the launcher to end, checking the call's memory every `POLL_S`: "exit",
    or "timeout" at ``deadline``, or "memory" when its processes hold more than the
    limit together."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return "timeout"
        try:
            proc.wait(timeout=min(POLL_S, left))
            return "exit"
        except subprocess.TimeoutExpired:
            if memory.over():
                return "memory"


def _result(readers: list[_Reader], killed: bool, duration: float) -> SandboxResult:
    """The result the pipes and the launcher's report tell (`killed`: the parent ended
    the run, so the report's exit is not the code's own)."""
    out, err, report = readers
    result = SandboxResult(
        stdout=out.text(),
        stderr=err.text(),
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        duration_s=duration,
    )
    for line in report.data.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        result.isolation.update(record.get("isolation") or {})
        if "setup_error" in record:
            result.error = record["setup_error"]
        if "exit" in record and not killed:
            result.exit_code = int(record["exit"])
        if "signal" in record and not killed:
            result.signal = int(record["signal"])
    if result.exit_code is None and result.signal is None and not killed and not result.error:
        result.error = "the sandbox launcher ended without a report"
    return result


class _Reader:
    """Drains a pipe on a thread, keeping its first ``limit`` bytes."""

    def __init__(self, stream, limit: int) -> None:
        self.stream, self.limit = stream, limit
        self.data, self.truncated = b"", False
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        chunks, size = [], 0
        try:
            while True:
                chunk = self.stream.read1(65536) if hasattr(self.stream, "read1") else b""
                if not chunk:
                    break
                if size < self.limit:
                    chunks.append(chunk[: self.limit - size])
                if size + len(chunk) > self.limit:
                    self.truncated = True
                size += len(chunk)
        except (OSError, ValueError):
            pass
        finally:
            self.data = b"".join(chunks)
            with contextlib.suppress(OSError):
                self.stream.close()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is ``uid`` (a sandbox's own, never ours),
    and wait up to a second for them to go."""
    if uid in (0, os.getuid()):
        return
    deadline = time.monotonic() + 1.0
    while True:
        pids = _pids_of(uid)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _pids_of(uid: int) -> list[int]:
    """Live processes (zombies excluded: they run nothing) whose real uid is ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if fields.get("State", "").strip().startswith("Z"):
            continue
        if int(fields.get("Uid", "-1 0").split()[0]) == uid:
            pids.append(int(entry))
    return pids


def _process_count(uid: int) -> int:
    """The tasks RLIMIT_NPROC counts for ``uid``: every thread of its processes (the
    trainer alone runs dozens)."""
    count = 0
    for pid in _pids_of(uid):
        try:
            with open(f"/proc/{pid}/status") as f:
                threads = [line for line in f if line.startswith("Threads:")]
            count += int(threads[0].split()[1]) if threads else 1
        except (OSError, ValueError):
            count += 1
    return count


def _default_python(root: bool) -> str:
    if not root or _world_executable(sys.executable):
        return sys.executable
    for candidate in _SYSTEM_PYTHONS:
        if os.path.exists(candidate) and _world_executable(candidate):
            return os.path.realpath(candidate)
    return sys.executable  # the run will fail to exec, with that reason in the result


def _world_executable(path: str) -> bool:
    """True when any uid can run ``path``: every directory above it searchable by others
    and the file itself readable and executable by them."""
    real = Path(os.path.realpath(path))
    try:
        mode = real.stat().st_mode
        if not (mode & stat.S_IROTH and mode & stat.S_IXOTH):
            return False
        return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)
    except OSError:
        return False


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
