"""Per-process resource usage of workers, sampled by stage (the method a worker is in).

One `UsageSampler` thread per worker process wakes every `interval_s`, reads the
process's CPU use (its children included: a reward worker's scoring processes count),
its resident memory and, when the process uses CUDA, the GPU's utilisation, and adds
the sample to every stage running at that moment. A stage is `role/method`: the
registered method a worker instance is in (`_rayrl_busy`, set by `calls.running`), so the
roles fused in one process (actor, critic) are told apart. Every registered method
also takes a sample as it ends, so a stage shorter than the period is measured too.

`report(reset=True)` returns, per stage, the number of samples, the mean and peak CPU
use in percent of one core (100 = one core busy), the mean GPU utilisation, the peak
resident memory, plus the process's peak CUDA memory and the CPUs Ray assigned it.
`starved_stages` turns reports into warnings: a stage whose process kept its assigned
CPUs busy while its GPU idled.

Every registered method also records when it ran (`record_call`, wall-clock start and
end); `take_calls` hands them over with the report, so the driver can tell the time
no worker was computing: its own overhead.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

GB = 1024**3
MIN_GAP_S = 0.05  # the least time between two end-of-call samples


@dataclass
class _StageStats:
    samples: int = 0
    cpu_sum: float = 0.0
    cpu_max: float = 0.0
    gpu_sum: float = 0.0
    gpu_samples: int = 0
    rss_max: float = 0.0

    def add(self, cpu: float, gpu: float | None, rss: float) -> None:
        self.samples += 1
        self.cpu_sum += cpu
        self.cpu_max = max(self.cpu_max, cpu)
        if gpu is not None:
            self.gpu_sum += gpu
            self.gpu_samples += 1
        self.rss_max = max(self.rss_max, rss)

    def summary(self) -> dict[str, float | None]:
        return {
            "samples": self.samples,
            "cpu_util": self.cpu_sum / self.samples if self.samples else 0.0,
            "cpu_util_max": self.cpu_max,
            "gpu_util": self.gpu_sum / self.gpu_samples if self.gpu_samples else None,
            "rss_gb_max": self.rss_max / GB,
        }


@dataclass
class UsageSampler:
    """Samples this process every `interval_s` while any tracked worker is in a method."""

    interval_s: float = 0.5
    workers: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self._children: dict[int, Any] = {}
        self._stages: dict[str, _StageStats] = {}
        self._lock = threading.Lock()
        self._sampling = threading.Lock()
        self._last = 0.0
        self._process.cpu_percent(None)  # the first call only starts the measurement
        self._thread = threading.Thread(target=self._loop, name="rayrl-usage", daemon=True)
        self._thread.start()

    def track(self, worker: Any) -> None:
        if worker not in self.workers:
            self.workers.append(worker)

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval_s)
            try:
                self.sample(refresh_children=True)
            except Exception:  # noqa: BLE001 - a sampling hiccup must never hurt the worker
                continue

    def _running(self) -> list[str]:
        stages = []
        for worker in self.workers:
            busy = getattr(worker, "_rayrl_busy", None)
            ctx = getattr(worker, "ctx", None)
            if busy and ctx is not None and not busy[0].startswith("_"):
                stages.append(f"{ctx.role}/{busy[0]}")
        return stages

    def sample(self, refresh_children: bool = False) -> None:
        """Take one sample now. Listing child processes scans /proc, so only the
        periodic thread does it; a sample at the end of a call uses the known ones."""
        now = time.monotonic()
        if not refresh_children and now - self._last < MIN_GAP_S:
            return  # calls in quick succession (no-op calls) would add only noise
        if not self._sampling.acquire(blocking=False):
            return  # the thread and a call's end at once: one sample is enough
        try:
            self._last = now
            cpu = self._process.cpu_percent(None)
            rss = float(self._process.memory_info().rss)
            cpu_c, rss_c = self._children_usage(refresh_children)
        finally:
            self._sampling.release()
        gpu = _gpu_utilisation()
        stages = self._running()
        with self._lock:
            for stage in stages:
                self._stages.setdefault(stage, _StageStats()).add(cpu + cpu_c, gpu, rss + rss_c)

    def _children_usage(self, refresh: bool) -> tuple[float, float]:
        import psutil

        cpu = rss = 0.0
        try:
            children = (
                self._process.children(recursive=True) if refresh else list(self._children.values())
            )
        except psutil.Error:
            return 0.0, 0.0
        alive = {}
        for child in children:
            proc = self._children.get(child.pid, child)
            try:
                cpu += proc.cpu_percent(None)
                rss += proc.memory_info().rss
                alive[child.pid] = proc
            except psutil.Error:
                continue
        self._children = alive
        return cpu, rss

    def report(self, reset: bool = True) -> dict[str, Any]:
        """Per-stage summaries since the last reset, peak CUDA memory, assigned CPUs."""
        with self._lock:
            stages = {name: s.summary() for name, s in self._stages.items()}
            if reset:
                self._stages = {}
        return {
            "stages": stages,
            "max_memory_allocated_gb": _cuda_peak_gb(reset),
            "num_cpus": _assigned("CPU"),
            "num_gpus": _assigned("GPU"),
        }


_SAMPLER: UsageSampler | None = None
# (start, end) wall-clock times of this process's registered-method calls, oldest first;
# bounded for drivers that never ask.
_CALLS: deque[tuple[float, float]] = deque(maxlen=4096)


def record_call(start: float, end: float) -> None:
    """Note that a registered method ran from `start` to `end` (`time.time()`)."""
    _CALLS.append((start, end))


def take_calls(reset: bool = True) -> list[tuple[float, float]]:
    """The calls recorded since the last reset, oldest first (a call ending meanwhile
    on another thread is kept for the next)."""
    if not reset:
        return list(_CALLS)
    calls = []
    while _CALLS:
        calls.append(_CALLS.popleft())
    return calls


def process_sampler(interval_s: float = 0.5) -> UsageSampler:
    """This process's sampler, started on first use."""
    global _SAMPLER
    if _SAMPLER is None:
        _SAMPLER = UsageSampler(interval_s)
    return _SAMPLER


def sample_now() -> None:
    """One sample now, if this process samples (called as a registered method ends)."""
    if _SAMPLER is not None:
        with contextlib.suppress(Exception):  # sampling must never fail a worker call
            _SAMPLER.sample()


def _assigned(resource: str) -> float:
    try:
        import ray

        return float(ray.get_runtime_context().get_assigned_resources().get(resource, 0.0))
    except Exception:  # noqa: BLE001 - not in a Ray worker
        return 0.0


def _cuda_in_use() -> bool:
    import sys

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


def _gpu_utilisation() -> float | None:
    if not _cuda_in_use():
        return None
    import torch

    try:
        return float(torch.cuda.utilization())
    except Exception:  # noqa: BLE001 - no NVML on this machine
        return None


def _cuda_peak_gb(reset: bool) -> float | None:
    if not _cuda_in_use():
        return None
    import torch

    peak: float = torch.cuda.max_memory_allocated() / GB
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def starved_stages(
    reports: dict[str, list[dict[str, Any]]], busy_ratio: float = 0.9, gpu_idle: float = 50.0
) -> list[str]:
    """Warnings for stages whose process kept its CPUs busy while its GPU idled.

    `reports` maps a role to its ranks' `UsageSampler.report()` results. A stage is
    CPU-starved on a rank when its mean CPU use reached `busy_ratio` of the CPUs Ray
    assigned the process and the GPU's mean utilisation stayed under `gpu_idle` %.
    """
    warnings = []
    for group_role, ranks in reports.items():
        for rank, report in enumerate(ranks):
            cpus = report.get("num_cpus") or 0.0
            for stage, s in report.get("stages", {}).items():
                gpu = s.get("gpu_util")
                if gpu is None or cpus <= 0 or not s.get("samples"):
                    continue
                if s["cpu_util"] >= busy_ratio * 100.0 * cpus and gpu < gpu_idle:
                    role, method = stage.split("/", 1)
                    warnings.append(
                        f"{role} rank {rank} is CPU-starved in {method}: {s['cpu_util']:.0f}% CPU "
                        f"(100% = one core) with num_cpus={cpus:g} while its GPU was "
                        f"{gpu:.0f}% busy; give the {group_role} workers more CPUs "
                        "(resources.cpus_per_worker)"
                    )
    return warnings
