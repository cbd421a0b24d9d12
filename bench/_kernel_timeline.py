"""The GPU's timeline in a torch.profiler trace: how busy the device was, per stream,
and which kernels ran while another stream was working.

A kernel's profiled duration is wall time on the device. When another stream runs at
the same moment (FSDP2's parameter gathers and gradient reductions run on their own
streams, and on one GPU they are copies), a bandwidth-bound kernel shares the memory
with it and its duration grows, though the step may not wait for it any longer. So a
table of kernels by duration can point at a kernel whose replacement saves nothing:
on 2026-12-03 the update's profile gave the compiled rotary kernels 159 ms of a 1.5 s
step, and a kernel near the bandwidth in their place left the step as it was
(docs/benchmarks.md). `summary` reports, besides the table, the time some kernel ran
(the union of the intervals), each stream's total, and per kernel name the share of its
time that overlapped another stream. `idle_gaps` finds where the device waited: the
longest moments no stream ran anything, each with the activity before and after it
(a launch-bound region shows as many short gaps; a host synchronisation as one long).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

__all__ = ["Interval", "device_intervals", "idle_gaps", "summary"]


@dataclass(frozen=True)
class Interval:
    stream: int
    start_ns: int
    end_ns: int
    name: str


def device_intervals(prof) -> list[Interval]:
    """The CUDA activity (kernels, copies, sets) of a finished ``torch.profiler``
    session, from its Kineto results; empty where the trace has none."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0:
            start = e.start_ns()
            out.append(Interval(e.device_resource_id(), start, start + e.duration_ns(), e.name()))
    return out


def summary(intervals: list[Interval], top: int = 10) -> dict:
    """``busy_s`` (some activity on the device), ``kernel_s`` (the durations' sum),
    ``overlap_s`` (their difference: time two streams ran at once), ``streams`` (each
    stream's total seconds, busiest first), and ``overlapped``: the ``top`` kernel names
    by time spent while another stream ran, each with its total and that share."""
    if not intervals:
        return {"busy_s": 0.0, "kernel_s": 0.0, "overlap_s": 0.0, "streams": {}, "overlapped": []}
    busy = _union_ns(intervals)
    total = sum(i.end_ns - i.start_ns for i in intervals)
    per_stream: dict[int, int] = defaultdict(int)
    for i in intervals:
        per_stream[i.stream] += i.end_ns - i.start_ns
    shared = _time_beside_other_streams(intervals)
    names: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for i, ns in zip(intervals, shared, strict=True):
        names[i.name][0] += i.end_ns - i.start_ns
        names[i.name][1] += ns
    ranked = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "busy_s": busy / 1e9,
        "kernel_s": total / 1e9,
        "overlap_s": (total - busy) / 1e9,
        "streams": {
            str(s): ns / 1e9 for s, ns in sorted(per_stream.items(), key=lambda kv: -kv[1])
        },
        "overlapped": [
            {"name": name[:120], "total_s": t / 1e9, "beside_other_streams": o / t if t else 0.0}
            for name, (t, o) in ranked
            if o > 0
        ],
    }


GAP_BUCKETS_US = (10, 100, 1000)  # idle gaps binned: < 10 us, < 100 us, < 1 ms, longer


def idle_gaps(intervals: list[Interval], top: int = 10) -> dict:
    """Where no stream ran anything, between the first activity and the last:
    ``idle_s`` in all, ``by_length`` (count and seconds of the gaps in each
    `GAP_BUCKETS_US` bin) and ``longest``: the ``top`` gaps, each with its microseconds
    and the names of the activity that ended just before it and began just after."""
    spans = sorted(intervals, key=lambda i: i.start_ns)
    gaps: list[tuple[int, str, str]] = []
    end, last = None, ""
    for i in spans:
        if end is not None and i.start_ns > end:
            gaps.append((i.start_ns - end, last, i.name))
        if end is None or i.end_ns >= end:
            end, last = i.end_ns, i.name
    labels = [f"<{b}us" for b in GAP_BUCKETS_US] + [f">={GAP_BUCKETS_US[-1]}us"]
    bins = {label: [0, 0] for label in labels}
    for ns, _, _ in gaps:
        label = labels[bisect.bisect_right([b * 1000 for b in GAP_BUCKETS_US], ns)]
        bins[label][0] += 1
        bins[label][1] += ns
    return {
        "idle_s": sum(ns for ns, _, _ in gaps) / 1e9,
        "by_length": {k: {"count": c, "s": ns / 1e9} for k, (c, ns) in bins.items()},
        "longest": [
            {"us": ns / 1e3, "after": before[:80], "before": after[:80]}
            for ns, before, after in sorted(gaps, key=lambda g: -g[0])[:top]
        ],
    }


def _union_ns(intervals: list[Interval]) -> int:
    """Nanoseconds covered by at least one interval."""
    covered, end = 0, None
    for i in sorted(intervals, key=lambda i: i.start_ns):
        if end is None or i.start_ns >= end:
            covered += i.end_ns - i.start_ns
            end = i.end_ns
        elif i.end_ns > end:
            covered += i.end_ns - end
            end = i.end_ns
    return covered


def _time_beside_other_streams(intervals: list[Interval]) -> list[int]:
    """For each interval, the nanoseconds of it during which any other stream was busy."""
    streams = {i.stream for i in intervals}
    others = {
        s: _merged([(i.start_ns, i.end_ns) for i in intervals if i.stream != s]) for s in streams
    }
    return [_overlap_with(others[i.stream], i.start_ns, i.end_ns) for i in intervals]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _overlap_with(spans: list[tuple[int, int]], start: int, end: int) -> int:
    """Nanoseconds of ``[start, end)`` inside the sorted, disjoint ``spans``."""
    ns = 0
    k = max(0, bisect.bisect_right(spans, (start, start)) - 1)
    while k < len(spans) and spans[k][0] < end:
        a, b = spans[k]
        ns += max(0, min(b, end) - max(a, start))
        k += 1
    return ns
