"""The chaos monkey's accounts: every planned kill lands, or is said not to, and why.

A harness asks for `kills` kills at most one a step. A kill can miss its step (the step
ended before the drawn rank was seen at the drawn point, the rank's heartbeat did not
answer, its process was gone before the signal); a missed kill is re-planned into the
next step, and each miss is kept with its step, point and reason. When the run ends
(or the monkey stops) with planned kills that never landed, each is listed with its
attempts and why it could not be re-planned (no step left), so a report of 9 kills
where 10 were planned names the tenth and what happened to it instead of saying
nothing: `ok` is false, `not_landed` holds them, `lines()` says it in words.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Attempt", "KillPlan", "PlannedKill"]


@dataclass(frozen=True)
class Attempt:
    """A try at a planned kill that did not land: where, and why."""

    step: int
    stage: str
    reason: str

    def __str__(self) -> str:
        return f"step {self.step} ({self.stage}): {self.reason}"


@dataclass
class PlannedKill:
    """One of the kills asked for (numbered from 1): its misses, then its kill or why
    it never landed."""

    number: int
    attempts: list[Attempt] = field(default_factory=list)
    kill: Any = None
    why_not: str = ""  # set when the plan ended without it

    @property
    def landed(self) -> bool:
        return self.kill is not None


class KillPlan:
    """`kills` planned kills, tried one after another (module docstring)."""

    def __init__(self, kills: int) -> None:
        if kills < 0:
            raise ValueError(f"kills={kills} must be >= 0")
        self.planned = [PlannedKill(i + 1) for i in range(kills)]
        self.ended = ""  # why the plan ended ("" while it runs)

    @property
    def current(self) -> PlannedKill | None:
        """The next planned kill to try (None once all landed)."""
        return next((p for p in self.planned if not p.landed), None)

    def landed(self, kill: Any) -> None:
        """The current planned kill landed as `kill`."""
        current = self._current("landed")
        current.kill = kill

    def missed(self, step: int, stage: str, reason: str) -> Attempt:
        """The current planned kill missed `step`: kept, and tried again at the next."""
        attempt = Attempt(step, stage, reason)
        self._current("missed").attempts.append(attempt)
        return attempt

    def finish(self, why: str) -> None:
        """The plan ends (the run ended, the monkey stopped or failed): every planned
        kill not landed gets `why` (the first reason given stands)."""
        if self.ended:
            return
        self.ended = why
        for planned in self.not_landed:
            planned.why_not = why

    @property
    def done(self) -> list[Any]:
        """The kills that landed, in order."""
        return [p.kill for p in self.planned if p.landed]

    @property
    def attempts(self) -> list[Attempt]:
        """Every miss, in order (of landed and unlanded planned kills alike)."""
        return [a for p in self.planned for a in p.attempts]

    @property
    def not_landed(self) -> list[PlannedKill]:
        return [p for p in self.planned if not p.landed]

    @property
    def ok(self) -> bool:
        """Whether every planned kill landed."""
        return not self.not_landed

    def report(self) -> dict[str, Any]:
        """planned, landed, the misses and the kills that never landed, as JSON."""
        return {
            "planned": len(self.planned),
            "landed": len(self.done),
            "ok": self.ok,
            "missed": [vars(a) for a in self.attempts],
            "not_landed": [
                {"kill": p.number, "attempts": [str(a) for a in p.attempts], "why": p.why_not}
                for p in self.not_landed
            ],
        }

    def lines(self) -> list[str]:
        """What did not land, in words (empty when every planned kill landed)."""
        total = len(self.planned)
        out = []
        for p in self.not_landed:
            tried = "; ".join(str(a) for a in p.attempts) or "never tried"
            out.append(
                f"planned kill {p.number} of {total} did not land ({tried}): "
                f"{p.why_not or 'the plan has not ended'}"
            )
        return out

    def _current(self, what: str) -> PlannedKill:
        current = self.current
        if current is None:
            raise RuntimeError(f"a kill {what} after all {len(self.planned)} planned ones landed")
        return current
