"""The per-epoch ledger of asynchronous training: which prompts trained, what went back.

Under `rollout.mode=async` a prompt can be generated more than once (its samples grew
too stale, its replica was lost, its call aborted) but must train exactly once per
epoch. The ledger records every (epoch, prompt uid) that trained and refuses a second
one (`LedgerError`: a bug, never a condition to recover from), and counts the prompts
sent back for generation, by reason. It is part of the async trainer's checkpointed
state (`rayrl.trainer.async_queue.SampleQueue.state_dict`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

# why a prompt went back to be generated again
REQUEUE_REASONS = ("stale", "aborted", "replica_lost", "restored")


class LedgerError(RuntimeError):
    """A prompt would train twice in one epoch."""


class Ledger:
    """Trained (epoch, uid) pairs and re-queue counts (module docstring)."""

    def __init__(self) -> None:
        self.trained: dict[int, set[str]] = {}
        self.requeued: Counter[str] = Counter()

    def record(self, epoch: int, uid: str, step: int) -> None:
        """Prompt `uid` of `epoch` trained at `step`; raises LedgerError on a second time."""
        seen = self.trained.setdefault(int(epoch), set())
        if uid in seen:
            raise LedgerError(
                f"prompt {uid} of epoch {epoch} would train a second time (step {step}); "
                "the async sample queue handed it out twice"
            )
        seen.add(uid)

    def requeue(self, reason: str, count: int = 1) -> None:
        if reason not in REQUEUE_REASONS:
            raise ValueError(f"unknown re-queue reason {reason!r}; one of {REQUEUE_REASONS}")
        self.requeued[reason] += count

    def count(self, epoch: int) -> int:
        """Prompts of `epoch` trained so far."""
        return len(self.trained.get(int(epoch), ()))

    def state_dict(self) -> dict[str, Any]:
        return {
            "trained": {e: sorted(uids) for e, uids in self.trained.items()},
            "requeued": dict(self.requeued),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The trained pairs as `state` has them; the re-queue counts never go back (a
        prompt generated again was work done, whatever the run restores)."""
        self.trained = {int(e): set(uids) for e, uids in state.get("trained", {}).items()}
        saved = Counter(state.get("requeued", {}))
        self.requeued = Counter({r: max(saved[r], self.requeued[r]) for r in saved | self.requeued})
