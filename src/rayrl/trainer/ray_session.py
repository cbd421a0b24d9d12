"""Connecting the driver to Ray: a local Ray with its dashboard, or an existing cluster.

- `resources.address` unset: rayrl starts a local Ray with the dashboard on
  `resources.dashboard_host:dashboard_port` (127.0.0.1 by default: reachable from
  this machine only; an SSH tunnel reaches it from elsewhere). Its processes, workers
  included, inherit `WORKER_ENV` (unless the environment sets those variables): OpenMP
  threads that sleep at a barrier instead of spinning. A worker runs as many torch
  threads as its bundle has CPUs; threads spinning on CPUs that other processes need
  (the driver, Ray's own, other work) slow a small model's generation down many times
  over on a busy machine, where sleeping ones keep up with one thread
  (`bench/cpu_threads.py`; figures in docs/benchmarks.md).
- `resources.address=auto` or `HOST:PORT` (or `RAY_ADDRESS`): joins a running cluster (`ray start
  --head` on one machine, `ray start --address=HOST:PORT` on the others).
- `trainer.log_worker_output`: worker prints reach the driver, each line prefixed
  with the worker's role and rank (`(actor_rollout_ref rank 0 pid=...)`); the prefix
  has no colour codes when the driver's output is not a terminal (a log file, a pipe:
  `plain_worker_prefixes`).
- `trainer.debug`: Ray's distributed debugger in every worker: `breakpoint()` pauses
  a worker method, and an exception in one stops there for post-mortem inspection.
  `trainer.debugger=vscode` (debugpy; attach with the VS Code "Ray Distributed
  Debugger" extension) or `cli` (Ray's legacy pdb; attach with `ray debug`).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray

from rayrl.cluster.inspect import resolve_address
from rayrl.cluster.spec import PoolSpec
from rayrl.config.schema import RayRLConfig, ResourcesConfig
from rayrl.config.sft import SFTConfig
from rayrl.trainer.resources import local_ray_cpus

log = logging.getLogger(__name__)

DEBUG_MODES = {"vscode": "1", "cli": "legacy"}
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def debug_env(cfg: RayRLConfig | SFTConfig) -> dict[str, str]:
    """Environment variables that switch Ray's debugger on in workers (empty when off)."""
    if not cfg.trainer.debug:
        return {}
    return {"RAY_DEBUG": DEBUG_MODES[cfg.trainer.debugger], "RAY_DEBUG_POST_MORTEM": "1"}


def check_debugger(cfg: RayRLConfig | SFTConfig) -> None:
    """The VS Code debugger needs debugpy in the workers' environment."""
    if cfg.trainer.debug and cfg.trainer.debugger == "vscode":
        try:
            import debugpy  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "trainer.debug=true with trainer.debugger=vscode needs debugpy: "
                "pip install 'rayrl[debug]' (or trainer.debugger=cli for `ray debug`)"
            ) from None


@dataclass(frozen=True)
class RaySession:
    address: str
    dashboard_url: str | None
    started_here: bool
    log_dir: str | None


def connect(
    cfg: RayRLConfig | SFTConfig,
    cpu_pools: Callable[[], list[PoolSpec]] | None = None,
    print_fn: Callable[[str], None] = print,
    data_cpus: float = 0.0,
) -> RaySession:
    """Start or join Ray as the config says; a driver already connected is kept. A
    CPU-only run that starts its own Ray gives it enough logical CPUs for the pools
    `cpu_pools()` returns and `data_cpus` for the data loader's tasks outside them
    when the machine has fewer cores (`local_cpu_count`)."""
    res, t = cfg.resources, cfg.trainer
    started = False
    if not ray.is_initialized():
        plain_worker_prefixes()
        kwargs: dict[str, Any] = {"log_to_driver": t.log_worker_output}
        env = debug_env(cfg)
        if env:
            kwargs["runtime_env"] = {"env_vars": env}
        address = resolve_address(None, res.address)  # resources.address, or RAY_ADDRESS
        if address:
            kwargs["address"] = address
            ray.init(**kwargs)
        else:
            cpus = _local_cpus(cfg, cpu_pools, print_fn, data_cpus) if cpu_pools else None
            if cpus:
                kwargs["num_cpus"] = cpus
            _start_local(kwargs, res)
        started = not address
    ctx = ray.get_runtime_context()
    return RaySession(
        address=ctx.gcs_address,
        dashboard_url=_dashboard_url(),
        started_here=started,
        log_dir=_log_dir(),
    )


def _local_cpus(
    cfg: RayRLConfig | SFTConfig,
    cpu_pools: Callable[[], list[PoolSpec]],
    print_fn: Callable[[str], None],
    data: float = 0.0,
) -> int | None:
    """Logical CPUs for the local Ray of a CPU-only run whose pools need more than this
    machine's cores (said once), else None (Ray counts the cores itself). Raises
    ResourcesUnsatisfiable, before Ray starts, when they need more than a few a core
    (`local_ray_cpus`)."""
    cpus = local_ray_cpus(cfg, cpu_pools(), extra=data)
    if cpus:
        cores = len(os.sched_getaffinity(0))
        also = f" (Ray Data's tasks {data:g} of them)" if data else ""
        print_fn(
            f"this machine has {cores} cores and the run's work needs {cpus} CPUs{also}: "
            f"the local Ray starts with {cpus} logical CPUs and the workers share the cores"
        )
    return cpus


def plain_worker_prefixes(streams: tuple[Any, ...] = ()) -> bool:
    """Plain text from Ray when the driver's stdout or stderr (or ``streams``) is not a
    terminal, so that redirected logs hold no ANSI colour codes: the worker-output
    prefixes (Ray's driver reads `RAY_COLOR_PREFIX`, 0: no colour, at each line it
    prints; a value the environment already sets is kept) and Ray's own log lines (its
    "View the dashboard at" line is coloured; `_PlainText`). Whether it turned them off."""
    import sys

    streams = streams or (sys.stdout, sys.stderr)
    if all(_is_tty(s) for s in streams):
        return False
    ray_logger = logging.getLogger("ray")
    if not any(isinstance(f, _PlainText) for f in ray_logger.filters):
        ray_logger.addFilter(_PlainText())
        for name in RAY_COLOURED_LOGGERS:  # a logger's filters see only its own records
            logging.getLogger(name).addFilter(_PlainText())
    if "RAY_COLOR_PREFIX" in os.environ:
        return False
    os.environ["RAY_COLOR_PREFIX"] = "0"
    return True


# Ray's loggers that colour their messages (`ray.init`'s dashboard line).
RAY_COLOURED_LOGGERS = ("ray._private.worker",)
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _PlainText(logging.Filter):
    """Strips ANSI escape sequences from a record's message and arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = ANSI_ESCAPE.sub("", record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(
                ANSI_ESCAPE.sub("", a) if isinstance(a, str) else a for a in record.args
            )
        return True


def _is_tty(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed stream
        return False


def _start_local(kwargs: dict[str, Any], res: ResourcesConfig) -> None:
    """Start a local Ray; with its dashboard, on a port no concurrent start takes too
    (`reserve_dashboard_port`)."""
    kwargs.update(address="local", include_dashboard=False)
    if not (res.dashboard and _dashboard_installed()):
        with _inherited(WORKER_ENV):
            ray.init(**kwargs)
        return
    with reserve_dashboard_port(res.dashboard_host, res.dashboard_port) as port:
        kwargs.update(include_dashboard=True, dashboard_host=res.dashboard_host)
        kwargs["dashboard_port"] = port
        with _inherited(WORKER_ENV):
            ray.init(**kwargs)


@contextmanager
def reserve_dashboard_port(host: str, wanted: int, listen_timeout_s: float = 20.0) -> Iterator[int]:
    """A free dashboard port (``wanted``, or the next free one above), chosen under a
    host-wide lock that is held until something listens there (the dashboard binds
    after ``ray.init`` returns) or ``listen_timeout_s`` passed: two runs started
    together otherwise both find the port free and the second dies when its dashboard
    cannot bind it."""
    import fcntl
    import tempfile
    from pathlib import Path

    lock = Path(tempfile.gettempdir()) / "rayrl-dashboard-port.lock"
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            port = free_port(host, wanted)
            yield port
            _wait_listening(host, port, listen_timeout_s)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _wait_listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts connections on (host, port) within ``timeout_s``."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.1)
    log.warning("nothing listens on dashboard port %d after %.0f s", port, timeout_s)
    return False


def _dashboard_installed() -> bool:
    """False, with a warning, on a minimal Ray (no ``ray[default]``): the run goes on
    without the dashboard instead of failing at ``ray.init``."""
    from rayrl.cluster import ray_private

    error = ray_private.dashboard_dependency_error()
    if error:
        warnings.warn(
            f"resources.dashboard=true but this Ray cannot serve a dashboard ({error}); "
            "running without it. pip install 'ray[default]' for the dashboard, or set "
            "resources.dashboard=false to silence this.",
            stacklevel=3,
        )
    return not error


def free_port(host: str, wanted: int, tries: int = 20) -> int:
    """``wanted`` if nothing listens there, else the next free port above it (another
    Ray on this machine holds 8265, say); Ray fails to start on a taken port."""
    import socket

    for port in range(wanted, wanted + tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        if port != wanted:
            log.warning("dashboard port %d is taken; using %d", wanted, port)
        return port
    return wanted


@contextmanager
def _inherited(env: dict[str, str]) -> Iterator[None]:
    """`env` (where this process does not set it) in the environment of the processes
    started inside, then this process's own environment as it was. Inherited, the
    variables cost nothing, where a job runtime_env would start every worker afresh."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _dashboard_url() -> str | None:
    from rayrl.cluster import ray_private

    return ray_private.dashboard_url()


def _log_dir() -> str | None:
    from rayrl.cluster import ray_private

    return ray_private.session_logs_dir()
