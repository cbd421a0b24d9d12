"""Bounded waits on the refs of several ranks at once, for groups and health checks."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray import ObjectRef


def wait_all(
    pending: dict[int, ObjectRef], timeout_s: float
) -> tuple[dict[int, Any], dict[int, BaseException]]:
    """Wait for every ref up to `timeout_s`; returns (results, failures) by rank.

    A failure is the exception the ref raised, or a TimeoutError if it was not ready.
    """
    results: dict[int, Any] = {}
    failures: dict[int, BaseException] = {}
    if not pending:
        return results, failures
    refs = list(pending.values())
    deadline = time.monotonic() + timeout_s
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
    ready_ids = {r.hex() for r in ready}
    for rank, ref in pending.items():
        if ref.hex() not in ready_ids:
            failures[rank] = TimeoutError(f"no answer within {timeout_s:.0f} s")
            continue
        try:
            results[rank] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
        except Exception as err:  # noqa: BLE001 - reported per rank by the caller
            failures[rank] = err
    return results, failures
