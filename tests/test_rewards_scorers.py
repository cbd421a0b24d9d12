"""Built-in reward scorers (gsm8k, math, countdown, arithmetic) and the data_source registry."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayrl.rewards import arithmetic, countdown, gsm8k, registry
from rayrl.rewards import math as math_scorer
from rayrl.rewards.registry import UnknownDataSourceError, compute_score, get_scorer


def score(module, solution, truth, **options) -> float:
    return module.compute_score(solution, truth, None, **options)["score"]


# --- gsm8k -------------------------------------------------------------------------


def test_gsm8k_strict_reads_the_number_after_the_last_hashes():
    reply = "48 / 2 = 24 clips in May. 48 + 24 = 72.\n#### 72"
    assert gsm8k.compute_score(reply, "72") == {"score": 1.0, "acc": 1.0}
    assert score(gsm8k, "#### 71", "72") == 0.0
    assert score(gsm8k, "#### 12\nwait, no.\n#### 72", "72") == 1.0
    assert score(gsm8k, "####72", "72") == 1.0
    assert score(gsm8k, "#### $1,000.", "1000") == 1.0
    assert score(gsm8k, "#### -3.50", "-3.5") == 1.0


def test_gsm8k_strict_needs_the_marker_flexible_takes_the_last_number():
    assert score(gsm8k, "The answer is 72.", "72") == 0.0
    assert score(gsm8k, "The answer is 72.", "72", method="flexible") == 1.0
    assert score(gsm8k, "72 apples, so 70", "72", method="flexible") == 0.0
    assert gsm8k.extract_solution("no digits here", "flexible") is None
    assert gsm8k.extract_solution("####   ", "strict") is None


def test_gsm8k_format_score_rewards_a_wrong_answer_in_the_right_format():
    assert score(gsm8k, "#### 71", "72", format_score=0.1) == 0.1
    assert score(gsm8k, "no answer", "72", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1)["acc"] == 0.0
    with pytest.raises(ValueError, match="method="):
        gsm8k.extract_solution("#### 1", method="loose")


@settings(max_examples=100, deadline=None)
@given(st.integers(-(10**9), 10**9))
def test_gsm8k_any_integer_with_thousands_separators_matches(n):
    assert score(gsm8k, f"so\n#### {n:,}", str(n)) == 1.0
    assert score(gsm8k, f"so\n#### {n + 1}", str(n)) == 0.0


# --- math --------------------------------------------------------------------------


def test_math_last_boxed_matches_nested_braces():
    assert math_scorer.last_boxed(r"so \boxed{\frac{\sqrt{3}}{2}} done") == r"\frac{\sqrt{3}}{2}"
    assert math_scorer.last_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert math_scorer.last_boxed(r"\fbox{7}") == "7"
    assert math_scorer.last_boxed(r"$\boxed 7$") == "7"
    assert math_scorer.last_boxed(r"\boxed{\frac{1}{2}") is None  # never closed
    assert math_scorer.last_boxed("no box") is None


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\dfrac{1}{2}}", r"\frac12"),
        (r"\boxed{\frac12}", "0.5"),
        (r"\boxed{1/2}", r"\frac{1}{2}"),
        (r"\boxed{-\frac{3}{4}}", "-0.75"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
        (r"\boxed{5.0}", "5"),
        (r"\boxed{ 0.50 }", ".5"),
        (r"\boxed{x = 3}", "3"),
        (r"\boxed{90^\circ}", "90"),
        (r"\boxed{10\%}", "10"),
        (r"\boxed{\text{(A)}}", "(A)"),
        (r"\boxed{1,000}", "1000"),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)"),
        (r"The answer is $\boxed{3}$.", r"\boxed{3}"),
    ],
)
def test_math_equivalent_answers_score_one(response, truth):
    assert math_scorer.compute_score(response, truth) == {"score": 1.0, "acc": 1.0}


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}"),
        (r"\boxed{0.33}", r"\frac{1}{3}"),
        (r"\boxed{\sqrt{8}}", r"2\sqrt{2}"),
        (r"\boxed{(1,2)}", "(2,1)"),
        (r"the answer is 5", "5"),  # no box
        (r"\boxed{5", "5"),  # malformed
        (r"\boxed{\frac{1}{0}}", "0"),
    ],
)
def test_math_wrong_or_malformed_answers_score_zero(response, truth):
    assert score(math_scorer, response, truth) == 0.0


# --- countdown ---------------------------------------------------------------------

TRUTH = {"target": 24, "numbers": [6, 1, 3, 4]}


def test_countdown_correct_equation_scores_one():
    assert countdown.compute_score("<answer>6 / (1 - 3 / 4)</answer>", TRUTH) == {
        "score": 1.0,
        "acc": 1.0,
    }
    assert score(countdown, "<think>x</think><answer>(6-3+1)*4 + 0*0</answer>", TRUTH) == 0.1
    assert score(countdown, "<answer>(6 - 3 + 1) * 4</answer>", {**TRUTH, "target": 16}) == 1.0
    assert score(countdown, "<answer>1</answer> no, <answer>6/(1-3/4)</answer>", TRUTH) == 1.0
    assert score(countdown, "<answer>-(1 - 3) * (6 + 4)</answer>", {**TRUTH, "target": 20}) == 1.0


@pytest.mark.parametrize(
    "equation",
    [
        "6 * 4 * 1",  # 3 unused
        "6 * 4 * 1 * 1",  # 1 used twice, 3 unused
        "(6 + 6) * (4 - 3 + 1)",  # 6 twice
        "6 + 1 + 3 + 4",  # wrong value
        "6 * 4 ** 1 * 3",  # power is not allowed
        "6 * 4 // 1 * 3",  # floor division is not allowed
        "6 * 4 * (3 - 3 + 1)",
        "6 / (4 - 3 - 1) * 1",  # division by zero
        "6 * 4 * 1.0 * 3",  # floats are not the given numbers
        "abs(-24) + 6 - 6",
        "",
        "6 * (4",
        "(" * 300 + "1" + ")" * 300,
    ],
)
def test_countdown_wrong_or_disallowed_equations_get_only_the_format_score(equation):
    assert countdown.compute_score(f"<answer>{equation}</answer>", TRUTH) == {
        "score": 0.1,
        "acc": 0.0,
    }


def test_countdown_never_evaluates_code(tmp_path):
    marker = tmp_path / "pwned"
    attack = f"__import__('pathlib').Path('{marker}').write_text('x') or 6 * 4 * (3 - 1 - 1)"
    assert score(countdown, f"<answer>{attack}</answer>", TRUTH) == 0.1
    assert not marker.exists()
    with pytest.raises(countdown.EquationError, match="Call|Attribute|Name"):
        countdown.parse_equation("print(1)")


def test_countdown_without_an_answer_or_with_a_bad_ground_truth():
    assert score(countdown, "6 / (1 - 3 / 4)", TRUTH) == 0.0
    with pytest.raises(ValueError, match="ground_truth must be a dict"):
        countdown.compute_score("<answer>1</answer>", "24")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789+-*/() .abc_*%<>'\"[]", max_size=40))
def test_countdown_arbitrary_answers_never_raise(equation):
    result = countdown.compute_score(f"<answer>{equation}</answer>", TRUTH)
    assert result["score"] in (0.1, 1.0)


# --- arithmetic --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("19", "19", 1.0),
        ("12+7=19", "19", 1.0),
        ("The answer is 19.", 19, 1.0),
        ("19.0", "19", 1.0),
        ("-3", "-3", 1.0),
        ("18", "19", 0.1),
        ("19 or maybe 20", "19", 0.1),
        ("nineteen", "19", 0.0),
        ("", "19", 0.0),
    ],
)
def test_arithmetic_right_wrong_and_malformed(response, truth, expected):
    result = arithmetic.compute_score(response, truth)
    assert result == {"score": expected, "acc": float(expected == 1.0)}


# --- registry ----------------------------------------------------------------------


def test_registry_maps_aliases_to_one_scorer_and_dispatches():
    assert get_scorer("openai/gsm8k") is get_scorer("gsm8k") is gsm8k.compute_score
    assert get_scorer("lighteval/MATH") is get_scorer("math")
    assert compute_score("openai/gsm8k", "#### 72", "72", None)["score"] == 1.0
    assert compute_score("arithmetic", "7", "7")["score"] == 1.0
    assert compute_score("countdown", "<answer>1+2</answer>", {"target": 3, "numbers": [2, 1]})[
        "acc"
    ]
    assert {"gsm8k", "math", "countdown", "arithmetic"} <= set(registry.known_sources())


def test_registry_unknown_source_suggests_the_nearest():
    with pytest.raises(UnknownDataSourceError) as info:
        compute_score("openai/gsm8", "#### 1", "1")
    message = str(info.value)
    assert "'openai/gsm8'" in message and "Did you mean 'openai/gsm8k'" in message
    assert "Known sources:" in message and "countdown" in message
    with pytest.raises(KeyError):  # still a KeyError for callers that catch that
        get_scorer("nothing-like-it")


def test_register_scorer_adds_refuses_duplicates_and_replaces(monkeypatch):
    monkeypatch.setattr(registry, "SCORERS", registry.SCORERS.copy())

    @registry.register_scorer("my/task", "mine")
    def exact(solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)

    assert compute_score("mine", " a ", "a") == 1.0
    with pytest.raises(ValueError, match="already has a scorer"):
        registry.register_scorer("gsm8k")(exact)
    registry.register_scorer("gsm8k", replace=True)(exact)
    assert compute_score("gsm8k", "#### 72", "72") == 0.0
    with pytest.raises(ValueError, match="at least one"):
        registry.register_scorer()


def test_scorers_and_results_pickle_for_worker_processes():
    fn = pickle.loads(pickle.dumps(get_scorer("math")))
    assert fn(r"\boxed{2}", "2")["score"] == 1.0


# --- return values -----------------------------------------------------------------


def test_to_result_accepts_numbers_and_refuses_the_rest():
    import numpy as np
    import torch

    from rayrl.rewards import to_result

    for value, expected in [
        (1, 1.0),
        (True, 1.0),
        (np.bool_(False), 0.0),
        (np.float32(0.5), 0.5),
        (torch.tensor(2.0), 2.0),
        ({"score": np.int64(3), "acc": 1}, 3.0),
    ]:
        result = to_result(value, elapsed_s=0.2)
        assert (result.score, result.error, result.elapsed_s) == (expected, None, 0.2)
    assert to_result({"score": 1, "acc": 0.5, "pred": "x"}).extra == {"acc": 0.5, "pred": "x"}
    for bad in ["1", None, [1], torch.tensor([1.0, 2.0]), 1 + 2j, float("inf"), {"acc": 1}]:
        result = to_result(bad)
        assert result.score == 0.0 and not result.ok and result.error
