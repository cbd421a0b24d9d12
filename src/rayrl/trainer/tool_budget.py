"""Tool turns that the response budget cuts short, said once per run.

A multi-turn episode's response (`data.max_response_length` tokens) holds all of it:
the model's turns, the tools' answers and the turn separators. When one tool turn
takes most of the budget (`-c grpo`'s 32 tokens, where a call and its answer take
about 27), episodes end right after the call, unanswered (finish reason ``length``),
score nothing, and the run trains on them with nothing saying why. `ToolBudget.check`
looks at each step's episodes (the columns a multi-turn rollout returns:
``finish_reason``, ``tool_stats``, ``rollout_sampled``) and, the first time the budget
cut a tool turn in most of them, logs a warning naming `data.max_response_length`
and what a tool turn took: the tokens of the assistant turn that made the last call
and of the tool's answer, as measured.

An episode's tool turn was cut when it ended with ``length`` after calling a tool and

- the tool's answer did not fit: the episode ended before the budget's end (the
  rollout ends an episode whose next observation would leave no room for a sampled
  token), or
- the budget ended in the turn after a tool's answer, which got fewer tokens than the
  turn that made the call (a model that rambles on at length after its answer is not
  cut by a budget that is too small for tool turns).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayrl.batch import Batch
from rayrl.trainer.episodes import is_multi_turn

log = logging.getLogger("rayrl.trainer")


@dataclass(frozen=True)
class CutTurn:
    """One episode's last tool turn, cut by the budget: the tokens of the assistant turn
    that made the call, of the tool's answer (None: it did not fit) and what was left."""

    call: int
    answer: int | None
    left: int


class ToolBudget:
    """The once-per-run check of a run whose responses are `width` tokens long."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.warned = False

    def check(self, batch: Batch) -> str | None:
        """Warn (once per run) when the budget cut a tool turn in most of `batch`'s
        episodes; the warning, or None."""
        if self.warned or not is_multi_turn(batch) or len(batch) == 0:
            return None
        reasons, stats = batch["finish_reason"], batch["tool_stats"]
        called = [i for i in range(len(batch)) if reasons[i] == "length" and _calls(stats[i])]
        if 2 * len(called) <= len(batch):  # cheap columns first: most must qualify
            return None
        sampled = batch["rollout_sampled"]
        cut = [turn for i in called if (turn := cut_turn(sampled[i], self.width)) is not None]
        if 2 * len(cut) <= len(batch):
            return None
        self.warned = True
        message = _message(len(cut), len(batch), self.width, cut[-1])
        log.warning(message)
        return message


def cut_turn(sampled: Sequence[int] | np.ndarray, width: int) -> CutTurn | None:
    """The last tool turn of an episode that ended with ``length``, if the budget cut it
    (module docstring); `sampled` is the episode's record: 1 on sampled tokens."""
    runs = _runs(np.asarray(sampled))
    if not runs or not runs[-1][0]:
        return None  # the rollout ends an episode on a sampled turn
    if len(sampled) < width:  # stopped early: the answer to its last turn's call did not fit
        return CutTurn(call=runs[-1][1], answer=None, left=width - len(sampled))
    if len(runs) < 3:
        return None  # no tool answer before the turn the budget cut
    call, answer, last = runs[-3][1], runs[-2][1], runs[-1][1]
    return CutTurn(call, answer, left=last) if last < call else None


def _runs(sampled: np.ndarray) -> list[tuple[bool, int]]:
    """(sampled?, length) of each stretch of sampled or appended tokens, in order."""
    if len(sampled) == 0:
        return []
    edges = np.flatnonzero(np.diff(sampled.astype(np.int8))) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(sampled)]])
    return [(bool(sampled[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def _calls(stats: dict[str, dict[str, Any]] | None) -> int:
    return int(sum(entry.get("calls", 0) for entry in (stats or {}).values()))


def _message(cut: int, total: int, width: int, last: CutTurn) -> str:
    if last.answer is None:
        took = (
            f"the last such call's turn took {last.call} tokens and the tool's answer did "
            f"not fit in the {last.left} left"
        )
    else:
        took = (
            f"the last such tool turn took {last.call + last.answer} tokens (the assistant's "
            f"call {last.call}, the tool's answer {last.answer}), leaving {last.left} for "
            "the model's answer to it"
        )
    return (
        f"multi-turn: the response budget cut a tool turn short in {cut} of {total} "
        f"episodes of this step (data.max_response_length={width}): {took}. These episodes "
        "end unanswered (finish reason 'length') and score nothing; raise "
        "data.max_response_length to hold every turn an episode needs (its calls, the "
        "tools' answers and the final answer), or shorten the tools' answers "
        "(actor_rollout_ref.rollout.multi_turn.max_tool_response_length)"
    )
