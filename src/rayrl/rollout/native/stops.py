"""Stop strings: a sample ends at the token whose text completes one of them.

After each step the last few tokens of every sample that just grew are decoded in one
``batch_decode`` call (a window longer than the longest stop string, since every
token decodes to at least one character), and the sample stops if the text contains a
stop string. The first step at which it appears is the one that completed it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["StopStrings"]


class StopStrings:
    def __init__(self, tokenizer, strings: Sequence[str]) -> None:
        self.tokenizer, self.strings = tokenizer, tuple(strings)
        self.window = max(len(s) for s in self.strings) + 4

    def checker(self, source) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        """A function of (sample ids, their lengths) -> bool array, reading the generated
        ``source.tokens[s, :length]`` of each sample from ``source.turn_start[s]`` on (a
        multi-turn response: only the current turn's tokens, never an appended tool
        response, can complete a stop string). ``source``'s arrays are read at each call
        (they may be grown between calls)."""

        def check(samples: np.ndarray, lengths: np.ndarray) -> np.ndarray:
            tokens, first = source.tokens, source.turn_start[samples]
            tails = [
                tokens[s, max(int(f), n - self.window) : n].tolist()
                for s, n, f in zip(samples.tolist(), lengths.tolist(), first, strict=True)
            ]
            texts = self.tokenizer.batch_decode(tails)
            return np.array([any(x in t for x in self.strings) for t in texts], dtype=bool)

        return check
