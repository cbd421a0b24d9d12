"""What a reward source is to its caller: the reward worker and the judge hold one
(`make_scorer`'s pools, `NumberAsAcc`, `CodeSandboxReward`) and only call these three
methods, so any object that has them can score a step's samples."""

from __future__ import annotations

from typing import Any, Protocol

from rayrl.rewards.result import RewardResult

__all__ = ["RewardSource"]


class RewardSource(Protocol):
    """Scores samples: `score(items)` one result per item (each item the keyword
    arguments of one `compute_score` call), `stats()` its counters, `close()` its
    processes or connections."""

    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
