"""Number parsing shared by the built-in scorers: "1,234", "$5", "-3.50", "7." as exact values."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

NUMBER_PATTERN = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER = re.compile(NUMBER_PATTERN)


def parse_number(text: object) -> Fraction | None:
    """The exact value of a plain number ("1,234", "$-5", "3.50", "7."), or None.

    Thousands separators, a leading "$", surrounding spaces and one trailing "." are
    ignored. Anything else (words, several numbers, fractions like "1/2") gives None.
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return Fraction(text)
    cleaned = str(text).strip().replace(",", "").replace("$", "").rstrip(".")
    if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", cleaned):
        return None
    try:
        return Fraction(Decimal(cleaned))
    except (InvalidOperation, ValueError):
        return None


def last_number(text: str) -> str | None:
    """The last number-looking substring of `text` (see NUMBER_PATTERN), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None
