"""bench/_kernel_timeline.py: the device's busy time, per stream, and the kernels that
ran beside another stream (a profile's durations alone misled the 2026-12-03 update
work)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _kernel_timeline import Interval, device_intervals, idle_gaps, summary  # noqa: E402


def test_busy_time_is_the_union_and_overlap_is_what_two_streams_shared():
    us = 1000
    intervals = [
        Interval(7, 0, 100 * us, "gemm"),  # compute stream
        Interval(7, 100 * us, 160 * us, "rotary"),
        Interval(7, 200 * us, 250 * us, "silu"),
        Interval(9, 120 * us, 180 * us, "all_gather_copy"),  # another stream
        Interval(9, 150 * us, 170 * us, "cast"),  # overlaps its own stream's copy
    ]
    out = summary(intervals)
    assert out["busy_s"] == pytest.approx(230e-6)  # 0-180 and 200-250
    assert out["kernel_s"] == pytest.approx(290e-6)
    assert out["overlap_s"] == pytest.approx(60e-6)
    assert list(out["streams"]) == ["7", "9"]
    assert out["streams"]["7"] == pytest.approx(210e-6)
    by_name = {k["name"]: k for k in out["overlapped"]}
    # rotary ran 100-160, the other stream 120-180: 40 of its 60 us beside it
    assert by_name["rotary"]["beside_other_streams"] == pytest.approx(40 / 60)
    # the copy ran 120-180, stream 7 busy 120-160: counted once though two kernels
    assert by_name["all_gather_copy"]["beside_other_streams"] == pytest.approx(40 / 60)
    assert "gemm" not in by_name and "silu" not in by_name
    assert out["overlapped"][0]["name"] in ("rotary", "all_gather_copy")


def test_nothing_profiled_gives_zeros():
    assert summary([])["busy_s"] == 0.0


def test_a_cpu_trace_has_no_device_intervals():
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4).add_(1)
    assert device_intervals(prof) == []


def test_idle_gaps_are_where_no_stream_ran_binned_and_named():
    us = 1000
    intervals = [
        Interval(7, 0, 100 * us, "gemm"),
        Interval(9, 50 * us, 130 * us, "copy"),  # ends last before the first gap
        Interval(7, 135 * us, 140 * us, "silu"),  # 5 us gap before it
        Interval(7, 2140 * us, 2200 * us, "optimizer"),  # 2 ms gap: a host wait
        Interval(7, 2250 * us, 2260 * us, "norm"),  # 50 us gap
    ]
    out = idle_gaps(intervals, top=2)
    assert out["idle_s"] == pytest.approx((5 + 2000 + 50) * 1e-6)
    assert out["by_length"]["<10us"] == {"count": 1, "s": pytest.approx(5e-6)}
    assert out["by_length"]["<100us"]["count"] == 1
    assert out["by_length"]["<1000us"]["count"] == 0
    assert out["by_length"][">=1000us"] == {"count": 1, "s": pytest.approx(2e-3)}
    first, second = out["longest"]
    assert first == {"us": 2000.0, "after": "silu", "before": "optimizer"}
    assert second["us"] == 50.0 and second["after"] == "optimizer"
    # the copy ran past the gemm: the first gap follows the copy, not the gemm
    assert idle_gaps(intervals, top=3)["longest"][2]["after"] == "copy"


def test_no_gaps_when_the_device_never_waited():
    out = idle_gaps([Interval(1, 0, 10, "a"), Interval(2, 5, 20, "b"), Interval(1, 20, 30, "c")])
    assert out["idle_s"] == 0.0 and out["longest"] == []
