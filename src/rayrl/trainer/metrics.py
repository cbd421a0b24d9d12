"""Step metrics with verl's names: batch statistics, reward extras, stage timing, usage.

- `batch_metrics`: `critic/score/*`, `critic/rewards/*`, `response_length/*` (mean, max,
  min, as verl logs them), `reward/errors`
  (`rayrl.workers.reward.reward_metrics` adds `reward/<key>/mean` for every numeric
  extra key a reward function returns in its dict, verl's `{"score": ..., "acc": ...}`,
  from the reward's per-row columns);
- `variance_proxy`: verl's `variance_proxy/*` (how noisy the step's gradient is), when
  the log-prob pass returned `sum_pi_squared` (`rayrl.algos.variance_proxy`);
- `timer`: adds a stage's wall time to `timing_s/<stage>` (and, inside
  `recording_spans`, its start and end on the wall clock: a profiled step's timeline);
- `controller_overhead`: the part of a step when no worker was in a method, i.e. the
  controller's own time on the step's critical path (`timing_s/controller_overhead`);
- `usage_metrics`: per role, the CPU use (percent of one core), GPU utilisation and
  peak memory its workers had during the step (`perf/cpu_util/<role>`,
  `perf/gpu_util/<role>`, `perf/max_memory_allocated_gb/<role>`: peak CUDA memory of
  torch's allocator on a GPU (the native engine's KV cache, mapped outside it, is not
  in it), peak resident memory on CPU), and per stage (the worker method)
  `perf/stage_cpu_util/<role>/<stage>`, `perf/stage_gpu_util/<role>/<stage>` (no
  metric name is a prefix of another: file-based trackers need that).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from rayrl.algos.probs_diff import PROBS_DIFF_COLUMNS, probs_diff_metrics, probs_diff_rows
from rayrl.algos.routing import ROUTING_COLUMNS, routing_metrics
from rayrl.algos.variance_proxy import variance_proxy_metrics
from rayrl.batch import Batch

if TYPE_CHECKING:
    from torch import Tensor


def batch_metrics(batch: Batch, lengths: Tensor) -> dict[str, float]:
    """verl's batch metrics; `lengths` are the response lengths before any masking.
    `critic/rewards/*` come from the token rewards when the batch has them (per-row
    advantages report them themselves: `rayrl.trainer.per_sequence`)."""
    errors = sum(e is not None for e in batch["reward_error"])
    finish = list(batch["finish_reason"])
    rewards = batch.get("token_level_rewards")
    return {
        **spread("critic/score", batch["scores"]),
        **(spread("critic/rewards", rewards.sum(-1)) if rewards is not None else {}),
        **spread("response_length", lengths.float()),
        "response_length/clip_ratio": finish.count("length") / max(len(finish), 1),
        "reward/errors": float(errors),
    }


def variance_proxy(batch: Batch, metrics: dict[str, float]) -> dict[str, float]:
    """verl's `variance_proxy/*` of a step whose log-prob pass returned `sum_pi_squared`
    (after the update: the signal is its `actor/grad_norm`); nothing otherwise."""
    if "sum_pi_squared" not in batch or "advantages" not in batch:
        return {}
    norm = metrics.get("actor/grad_norm")
    return variance_proxy_metrics(
        batch["old_log_probs"],
        batch["sum_pi_squared"],
        batch["advantages"],
        batch["response_mask"],
        rollout_is_weights=batch.get("rollout_is_weights"),
        grad_norm=norm if norm is not None and math.isfinite(norm) else None,
    )


def spread(name: str, values: Tensor, mask: Tensor | None = None) -> dict[str, float]:
    """`<name>/mean`, `/max` and `/min` of `values` (over `mask`'s positions when
    given), as verl logs them; nothing when no position is left."""
    if mask is not None:
        values = values[mask.bool()]
    if values.numel() == 0:
        return {}
    values = values.double()
    return {
        f"{name}/mean": float(values.mean()),
        f"{name}/max": float(values.max()),
        f"{name}/min": float(values.min()),
    }


def rollout_probs_diff(old: Batch, batch: Batch) -> dict[str, float]:
    """How far the rollout's token probabilities are from the actor's on the same
    tokens (`actor_rollout_ref.rollout.calculate_log_probs`, verl's names:
    `rayrl.algos.probs_diff`): from the per-row sums the log-prob pass made (`old`)
    when it has them, else from the token columns. Nothing without a response token."""
    if PROBS_DIFF_COLUMNS[0] in old:
        rows = {key: old[key] for key in PROBS_DIFF_COLUMNS}
        counts = batch.get("response_length")
    else:
        rows = probs_diff_rows(
            batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"]
        )
        counts = None
    if counts is None:
        counts = batch["response_mask"].sum(-1)
    return probs_diff_metrics(rows, counts)


def rollout_routing(old: Batch) -> dict[str, float]:
    """How the log-prob pass's routing of a mixture of experts compares with the
    rollout's record (`actor/routing_mismatch_frac`, ...: `rayrl.algos.routing`), from
    the per-row counts the pass made when the samples had a record; else nothing."""
    if ROUTING_COLUMNS[0] not in old:
        return {}
    return routing_metrics({key: old[key] for key in ROUTING_COLUMNS})


# (stage, wall-clock start, end) of each `timer` block, while `recording_spans` is open
_SPANS: ContextVar[list[tuple[str, float, float]] | None] = ContextVar("spans", default=None)


@contextmanager
def timer(timing: dict[str, float], name: str) -> Iterator[None]:
    start, wall = time.perf_counter(), time.time()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start
        spans = _SPANS.get()
        if spans is not None:
            spans.append((name, wall, time.time()))


@contextmanager
def recording_spans() -> Iterator[list[tuple[str, float, float]]]:
    """The (stage, start, end) wall-clock spans of the `timer` blocks that run inside
    (on this thread), in the order they end."""
    spans: list[tuple[str, float, float]] = []
    token = _SPANS.set(spans)
    try:
        yield spans
    finally:
        _SPANS.reset(token)


def controller_overhead(
    reports: dict[str, list[dict[str, Any]]], start: float, end: float
) -> float:
    """Seconds of the step from `start` to `end` (wall clock) in which no worker of any
    group was in a registered method, from the `calls` of each rank's usage report:
    what the controller itself adds (splitting and joining Batches, moving them
    through the object store, remote-call latency, advantages, metric reduction).
    Time the controller spends while some worker computes is not on the critical path
    and not counted."""
    spans = sorted(
        (max(s, start), min(e, end))
        for ranks in reports.values()
        for report in ranks
        for s, e in report.get("calls", ())
        if e > start and s < end
    )
    busy, reach = 0.0, start
    for s, e in spans:
        if e > reach:
            busy += e - max(s, reach)
            reach = e
    return max(0.0, (end - start) - busy)


def usage_metrics(reports: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Per-role (and per-stage) usage metrics from each group's per-rank reports.

    A stage is `role/method`; means are over the ranks that sampled it.
    """
    cpu: dict[str, list[float]] = defaultdict(list)
    gpu: dict[str, list[float]] = defaultdict(list)
    mem: dict[str, list[float]] = defaultdict(list)
    for ranks in reports.values():
        for report in ranks:
            peak_cuda = report.get("max_memory_allocated_gb")
            for stage, s in report.get("stages", {}).items():
                if not s.get("samples"):
                    continue
                role = stage.split("/", 1)[0]
                for key, prefix in ((role, ""), (stage, "stage_")):
                    cpu[f"perf/{prefix}cpu_util/{key}"].append(s["cpu_util"])
                    if s.get("gpu_util") is not None:
                        gpu[f"perf/{prefix}gpu_util/{key}"].append(s["gpu_util"])
                mem[role].append(peak_cuda if peak_cuda is not None else s["rss_gb_max"])
    out = {k: _mean(v) for k, v in cpu.items()}
    out.update({k: _mean(v) for k, v in gpu.items()})
    out.update({f"perf/max_memory_allocated_gb/{k}": max(v) for k, v in mem.items()})
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def prefix_cache_metrics(counts: dict[str, float]) -> dict[str, float]:
    """`rollout/prefix_cache_hit_rate`: the share of the rollout's prompt tokens (an
    episode's recomputed turns included) its prefix cache held, from the generate
    calls' counts (none where no engine keeps a prefix cache)."""
    looked = counts.get("prefix_tokens", 0.0)
    if not looked:
        return {}
    return {"rollout/prefix_cache_hit_rate": counts.get("prefix_hit_tokens", 0.0) / looked}
