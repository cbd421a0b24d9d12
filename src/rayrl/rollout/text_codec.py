"""Text to tokens and back between an episode's turns, as the tokenizer itself would.

A multi-turn rollout decodes every assistant turn (for the parser) and encodes every
observation's contents, thousands of times per step, on threads beside the engine's
loop; the reward decodes every response of a step before it scores them. Through a Hugging Face tokenizer's ``encode`` / ``decode`` each call spends most of
its time in Python (argument checks, ``BatchEncoding``, converting the id list item by
item): about half a millisecond per turn, all of it holding the GIL the engine's loop
needs (docs/benchmarks.md). `TextCodec` calls the tokenizer's Rust backend directly,
on a private copy with no truncation and no padding (a shared backend keeps whatever
the last batch call set), and checks at construction that it agrees with the
tokenizer on probe texts; where the tokenizer has no such backend, cleans up decoded
spaces, or disagrees, it calls the tokenizer as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

__all__ = ["TextCodec"]

log = logging.getLogger(__name__)

_PROBES = (
    "Hello world",
    "  two leading spaces, trailing ones  ",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>',
    "naïve café – 数字 🙂\n\n\tend",
)


class TextCodec:
    """``encode(text)`` without special tokens added, ``decode(ids, skip_special_tokens)``
    and ``decode_batch(rows, skip_special_tokens)``."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = _private_backend(tokenizer)
        if self.backend is not None and not self._agrees():
            log.info("multi-turn: the tokenizer's backend differs from it; using the tokenizer")
            self.backend = None

    @property
    def fast(self) -> bool:
        """Whether calls go straight to the Rust backend."""
        return self.backend is not None

    def encode(self, text: str) -> list[int]:
        if self.backend is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        if self.backend is None:
            return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, rows: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        """`decode` of each row, the rows decoded together (the backend's threads)."""
        if self.backend is None:
            return self.tokenizer.batch_decode(
                [list(r) for r in rows], skip_special_tokens=skip_special_tokens
            )
        return self.backend.decode_batch(
            [list(r) for r in rows], skip_special_tokens=skip_special_tokens
        )

    def _agrees(self) -> bool:
        """The backend gives the tokenizer's tokens and texts on the probes (and on the
        special tokens' own texts)."""
        specials = "".join(str(t) for t in getattr(self.tokenizer, "all_special_tokens", []))
        for text in (*_PROBES, specials, f"a{specials}b"):
            ids = list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))
            if self.backend.encode(text, add_special_tokens=False).ids != ids:
                return False
            for skip in (False, True):
                if self.backend.decode(ids, skip_special_tokens=skip) != self.tokenizer.decode(
                    ids, skip_special_tokens=skip
                ):
                    return False
        return True


def _private_backend(tokenizer):
    """A copy of a fast tokenizer's Rust backend with no truncation and no padding, or
    None (no backend, or decoded text is post-processed in Python)."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    if not isinstance(backend, Tokenizer):
        return None
    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy
