"""What a rollout engine and a multi-turn driver tell each other between turns.

An engine that generates multi-turn episodes takes a `TurnDriver`. Whenever a sample
ends an assistant turn (a stop token or string, with room left in its length limit),
the engine calls ``driver.turn_ended(sample, response)`` with the sample's whole
response so far and goes on decoding the others; the call must return at once (the
driver does its work, e.g. running tools, elsewhere). The engine collects the driver's
answers with ``driver.take_ready(wait)``: one `Continuation` per finished piece of
work, telling it to append tokens to a sample and continue, or to end the sample.
An answer may append images too (`TurnImages`: a tool or environment that shows the
model an image; a vision-language engine feeds their pixels with the appended tokens).
``wait=True`` means the engine has nothing else to do and blocks until at least one
answer is there.

Samples are numbered as the engine's output rows (prompt i's sample k is ``i * n + k``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from torch import Tensor

__all__ = ["Continuation", "TurnDriver", "TurnImages"]


@dataclass
class TurnImages:
    """The images of an appended observation.

    Attributes:
        inputs: their pixel inputs as the processor makes them (``pixel_values``,
            ``image_grid_thw``: one row per image), in the order they appear.
        offsets: where their placeholder tokens sit in the appended tokens (each
            image's merged patch count of them, in order).
    """

    inputs: dict[str, Tensor]
    offsets: np.ndarray


@dataclass
class Continuation:
    """The driver's answer for one sample whose turn ended.

    Attributes:
        sample: the output row.
        tokens: token ids to append to its response before it continues (a tool's
            response and the turn separators); None ends the sample.
        stopped: when ending it, True for finish reason "stop", False for "length".
        images: the images those tokens show (None: none).
    """

    sample: int
    tokens: Sequence[int] | np.ndarray | None
    stopped: bool = True
    images: TurnImages | None = None


class TurnDriver(Protocol):
    """The multi-turn side of a rollout (see the module docstring)."""

    def turn_ended(self, sample: int, response: np.ndarray) -> None: ...

    def take_ready(self, wait: bool) -> list[Continuation]: ...
