"""Rows set aside at load, told to the user: every one in a file, a summary on screen.

`write_rejected` writes one JSON object per set-aside row (the split, its file, its
row number in that file, its index in the input and the reason) so that no bad row is
named only on the console; `summarize_rejected` groups them by reason (numbers in
reasons folded, so "prompt of 612 tokens ..." and "prompt of 700 tokens ..." are one
kind) with the count and the first few rows of each.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from rayrl.data.dataset import RejectedRow

NUMBER = re.compile(r"\d+")


def write_rejected(path: Path, splits: dict[str, Iterable[RejectedRow]]) -> int:
    """Write every set-aside row of every split (e.g. "train", "val") to `path` as JSON
    lines; the number written. An empty file when nothing was set aside."""
    count = 0
    with open(path, "w") as out:
        for split, rows in splits.items():
            for row in rows:
                source = row.source
                entry = {
                    "split": split,
                    "file": source.file if source else None,
                    "row": source.row if source else None,
                    "index": row.index,
                    "reason": row.reason,
                }
                out.write(json.dumps(entry) + "\n")
                count += 1
    return count


def summarize_rejected(rows: list[RejectedRow], first: int = 3) -> list[str]:
    """One line per kind of reason, most frequent first: its count, the reason (of its
    first row) and where its first `first` rows are."""
    kinds: dict[str, list[RejectedRow]] = defaultdict(list)
    for row in rows:
        kinds[NUMBER.sub("N", row.reason)].append(row)
    lines = []
    for group in sorted(kinds.values(), key=len, reverse=True):
        where = ", ".join(str(r.source or f"row {r.index}") for r in group[:first])
        more = f" and {len(group) - first} more" if len(group) > first else ""
        lines.append(f"{len(group)} x {group[0].reason} ({where}{more})")
    return lines
