"""Registry of built-in scorers keyed by `data_source`, and the default `compute_score`.

A scorer is `fn(solution_str, ground_truth, extra_info) -> float | dict`. Several
data_source names may share one scorer ("openai/gsm8k" and "gsm8k"). The default
`compute_score(data_source, solution_str, ground_truth, extra_info)` has verl's reward
function signature and dispatches on `data_source`; an unknown source is an error that
lists the known ones and suggests the nearest. Add a scorer with `register_scorer`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from rayrl.registry import Registry
from rayrl.rewards import arithmetic, code_tests, countdown, gsm8k, words
from rayrl.rewards import math as math_scorer

Scorer = Callable[[str, Any, dict[str, Any] | None], float | dict[str, Any]]

# one entry per data_source name (several names may hold the same scorer)
SCORERS: Registry[Scorer] = Registry("reward scorer", config_key="data_source")


class UnknownDataSourceError(KeyError):
    """No scorer is registered for a data_source."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


def register_scorer(*sources: str, replace: bool = False) -> Callable[[Scorer], Scorer]:
    """Decorator: register `fn` as the scorer of every name in `sources`.

    Re-registering a name raises ValueError unless `replace=True`.
    """
    if not sources:
        raise ValueError("register_scorer needs at least one data_source name.")

    def decorate(fn: Scorer) -> Scorer:
        taken = [s for s in sources if s in SCORERS and SCORERS.get(s) is not fn]
        if taken and not replace:
            raise ValueError(
                f"data_source {taken} already has a scorer; pass replace=True to override."
            )
        for source in sources:
            SCORERS.add(source, fn, replace=True)
        return fn

    return decorate


def known_sources() -> list[str]:
    """Every registered data_source name, sorted."""
    return sorted(SCORERS)


def get_scorer(data_source: str) -> Scorer:
    """The scorer registered for `data_source`; UnknownDataSourceError with suggestions if none."""
    if data_source in SCORERS:
        return SCORERS.get(data_source)
    close = difflib.get_close_matches(str(data_source), list(SCORERS), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise UnknownDataSourceError(
        f"No built-in reward scorer for data_source={data_source!r}.{hint} Known sources: "
        f"{', '.join(known_sources())}. Register one with rayrl.rewards.register_scorer, "
        "or point custom_reward_function.path at a file defining compute_score."
    )


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> float | dict[str, Any]:
    """Score one sample with the built-in scorer of its `data_source` (verl's signature)."""
    return get_scorer(data_source)(solution_str, ground_truth, extra_info)


register_scorer("openai/gsm8k", "gsm8k")(gsm8k.compute_score)
register_scorer(
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math",
)(math_scorer.compute_score)
register_scorer("countdown", "Jiayi-Pan/Countdown-Tasks-3to4")(countdown.compute_score)
# The synthetic tasks (`rayrl.data.synthetic`): the answer is a number.
register_scorer("arithmetic", "rayrl/arithmetic", "larger")(arithmetic.compute_score)
register_scorer("multiply")(arithmetic.compute_exact)
# The synthetic visual tasks (`rayrl.data.synthetic_images`): a word, or a count.
register_scorer("colors")(words.compute_score)
register_scorer("count_squares")(arithmetic.compute_score)
# verl's code sources run on a SandboxFusion server (`rayrl.rewards.code_sandbox`); without
# one (reward.sandbox_fusion.url) they fail with what to set.
register_scorer(*code_tests.CODE_SOURCES)(code_tests.needs_sandbox)
