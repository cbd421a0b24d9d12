"""What a rollout engine and a multi-turn driver tell each other between turns.

An engine that generates multi-turn episodes takes a `TurnDriver`. Whenever a sample
ends an assistant turn (a stop token or string, with room left in its length limit),
the engine calls ``driver.turn_ended(sample, response)`` with the sample's whole
response so far and goes on decoding the others; the call must return at once (the
driver does its work, e.g. running tools, elsewhere). The engine collects the driver's
answers with ``driver.take_ready(wait)``: one `Continuation` per finished piece of
work, telling it to append tokens to a sample and continue, or to end the sample.
``wait=True`` means the engine has nothing else to do and blocks until at least one
answer is there.

Samples are numbered as the engine's output rows (prompt i's sample k is ``i * n + k``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["Continuation", "TurnDriver"]


@dataclass
class Continuation:
    """The driver's answer for one sample whose turn ended.

    Attributes:
        sample: the output row.
        tokens: token ids to append to its response before it continues (a tool's
            response and the turn separators); None ends the sample.
        stopped: when ending it, True for finish reason "stop", False for "length".
    """

    sample: int
    tokens: Sequence[int] | np.ndarray | None
    stopped: bool = True


class TurnDriver(Protocol):
    """The multi-turn side of a rollout (see the module docstring)."""

    def turn_ended(self, sample: int, response: np.ndarray) -> None: ...

    def take_ready(self, wait: bool) -> list[Continuation]: ...
