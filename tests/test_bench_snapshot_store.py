"""bench/snapshot_store.py runs as a user runs it and prints one hand-over per round."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_snapshot_store_prints_each_round():
    out = subprocess.run(
        [sys.executable, "snapshot_store.py", "--gib", "0.01", "--pieces", "4", "--rounds", "3"],
        cwd=BENCH,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    rounds = [r for r in rows if r["metric"] == "handover_s"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(r["value"] > 0 and r["gib"] == 0.01 for r in rounds)
    first = next(r for r in rows if r["metric"] == "handover_first_s")
    assert first["value"] == rounds[0]["value"]
