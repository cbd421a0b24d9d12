r"""MATH-style scorer: the answer is the last `\boxed{...}` of the response.

The boxed content is found by brace matching (so `\boxed{\frac{1}{2}}` is read whole),
both sides are normalised (spacing, `\left`/`\right`, `\dfrac` -> `\frac`, `\frac12`
-> `\frac{1}{2}`, `\text{...}`, degrees and percent signs, a short `x =` prefix,
trailing zeros) and compared as strings, then as exact numbers when both sides are
numbers or simple fractions (`\frac{1}{2}` == `1/2` == `0.5`). No symbolic algebra:
`\sqrt{8}` and `2\sqrt{2}` differ.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from rayrl.rewards._numbers import parse_number

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_DELETE = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "$")
_UNITS = ("^{\\circ}", "^\\circ", "\\circ", "\\degree", "\\%", "%")
_NUM = r"-?\d+(?:\.\d+)?"


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (or `\fbox{...}`, or `\boxed 5`), or None.

    None also when the last box's braces never close.
    """
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    after = text[start + len(command) :]
    if not after.startswith("{"):
        loose = re.match(r"\s+([^\s$]+)", after)
        return loose.group(1) if loose else None
    depth = 0
    for i, char in enumerate(after):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return after[1:i]
    return None


def normalize_answer(answer: str) -> str:
    """A canonical spelling of a short LaTeX answer, for string comparison."""
    text = answer.strip().replace("\n", "")
    for token in _DELETE + _UNITS:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", text)
    text = text.replace(" ", "")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", text)
    text = re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", text)
    text = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", text)
    lhs = re.fullmatch(r"[a-zA-Z]\w?=(.+)", text)
    if lhs:
        text = lhs.group(1)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    if re.fullmatch(r"-?\d*\.\d+|-?\d+\.", text):
        text = text.rstrip("0").rstrip(".")
        text = re.sub(r"^(-?)\.", r"\g<1>0.", text) or "0"
    return text


def to_number(answer: str) -> Fraction | None:
    r"""The exact value of a normalised answer that is a number, `a/b` or `\frac{a}{b}`."""
    plain = parse_number(answer)
    if plain is not None:
        return plain
    frac = re.fullmatch(rf"(-?)\\frac\{{({_NUM})\}}\{{({_NUM})\}}", answer)
    slash = re.fullmatch(rf"()({_NUM})/({_NUM})", answer)
    match = frac or slash
    if not match or Fraction(match.group(3)) == 0:
        return None
    value = Fraction(match.group(2)) / Fraction(match.group(3))
    return -value if match.group(1) else value


def is_equivalent(answer: str, reference: str) -> bool:
    """True when two answers agree after normalisation, as strings or as exact numbers."""
    a, b = normalize_answer(answer), normalize_answer(reference)
    if a == b:
        return True
    va, vb = to_number(a), to_number(b)
    return va is not None and va == vb


def compute_score(
    solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    r"""1.0 when the last `\boxed{}` of the response equals `ground_truth`, else 0.0.

    `ground_truth` may itself be boxed. Returns {"score": ..., "acc": ...}.
    """
    answer = last_boxed(solution_str)
    reference = str(ground_truth)
    reference = last_boxed(reference) or reference
    correct = answer is not None and is_equivalent(answer, reference)
    return {"score": float(correct), "acc": float(correct)}
