"""Code answers against test cases, verl's way: the code block of a response, the test
cases of a ground truth, the program each case runs, and whether it passed.

verl scores the data sources `CODE_SOURCES` (codecontests, apps, codeforces, taco) by
running the response's code on a SandboxFusion server (`rayrl.rewards.code_sandbox`).
Its rules, which rayrl keeps:

- the code is the last ```` ```python ```` block of the response, else the first
  fenced block (a language line dropped); a block left open runs to the end; a
  response without a fence scores 0;
- the ground truth (a dict or its JSON text) holds ``inputs`` and ``outputs``, one per
  case: each input is the program's stdin, and the case passes when the program ends
  with status 0 and its stdout, trailing newlines dropped, equals the output's text;
- with ``fn_name`` the code defines that function (or a ``Solution`` class with that
  method): each input holds its arguments, one JSON value per line (or, rayrl's
  addition, a list of them), and the case passes when the return value, printed as
  JSON for lists, dicts, tuples, booleans and None and as text otherwise, equals the
  output (an output given as a value rather than text also passes when the printed
  JSON is that value, or the single value of a one-element list: APPS's layout);
- with ``assert_case`` (a list of assertion snippets) each case runs the code followed
  by its snippet and passes when it ends with status 0;
- the score is the fraction of the first `SCORED_CASES` cases that pass (verl's
  ``continuous`` scoring, which its default scorer uses for these sources); only those
  run.

A ground truth that holds no test cases is the data's fault, not the answer's: it is
an error (`ValueError`), counted against ``reward.max_error_rate``, where verl scores 0.
Without a server, `needs_sandbox` is these sources' built-in scorer: it says what to set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CODE_SOURCES",
    "needs_sandbox",
    "SCORED_CASES",
    "TestCases",
    "case_passed",
    "case_program",
    "extract_code",
    "parse_test_cases",
]

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
SCORED_CASES = 10

# Runs the user's code, then calls FN_NAME with the JSON values on stdin's lines and
# prints what it returns (JSON for containers, booleans and None; text otherwise).
_CALL_WRAPPER = """\
{code}


def _rayrl_call_main():
    import json as _json
    import sys as _sys

    _lines = [line for line in _sys.stdin.read().split("\\n") if line.strip()]
    _args = [_json.loads(line) for line in _lines]
    _fn = globals().get({fn_name!r})
    if _fn is None and "Solution" in globals():
        _fn = getattr(globals()["Solution"](), {fn_name!r})
    if _fn is None:
        raise NameError("the code defines no function or Solution method " + {fn_name!r})
    _out = _fn(*_args)
    if isinstance(_out, (dict, list, tuple, bool)) or _out is None:
        print(_json.dumps(_out))
    else:
        print(_out)


_rayrl_call_main()
"""


@dataclass(frozen=True)
class TestCases:
    """A ground truth's cases: ``inputs[i]`` goes with ``outputs[i]`` (and with
    ``asserts[i]``, a snippet run after the code, when given)."""

    __test__ = False  # not a pytest class, whatever imports it

    inputs: list[Any]
    outputs: list[Any]
    fn_name: str | None = None
    asserts: list[str] | None = None

    def __len__(self) -> int:
        return len(self.inputs)


def needs_sandbox(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The built-in scorer of the code data sources without a SandboxFusion server."""
    raise RuntimeError(
        f"the code data sources ({', '.join(CODE_SOURCES)}) are scored by running each "
        "answer against its test cases on a SandboxFusion server: set "
        "reward.sandbox_fusion.url (verl's key, e.g. http://host:8080/run_code), or score "
        "them in a custom_reward_function"
    )


def extract_code(completion: str) -> str | None:
    """The response's code block (module docstring), or None when it has none."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    parts = completion.split("```")
    if len(parts) < 2:
        return None
    block = parts[1]
    first, newline, rest = block.partition("\n")
    return rest if newline and first.strip().isalpha() else block


def parse_test_cases(ground_truth: Any) -> TestCases:
    """The cases of a ground truth (a dict or its JSON text); ValueError saying what is
    wrong with it otherwise."""
    data = ground_truth
    if isinstance(data, str | bytes):
        try:
            data = json.loads(data)
        except ValueError:
            raise ValueError(
                f"ground_truth is not JSON test cases: {_short(ground_truth)}"
            ) from None
    if not isinstance(data, dict):
        raise ValueError(
            "ground_truth must hold test cases {'inputs': [...], 'outputs': [...]} (or "
            f"'assert_case': [...]); got {type(data).__name__} {_short(data)}"
        )
    asserts = data.get("assert_case")
    if isinstance(asserts, list):
        inputs = _listed(data.get("inputs", [""] * len(asserts)))
        outputs = _listed(data.get("outputs", [None] * len(asserts)))
    elif "inputs" in data and "outputs" in data:
        inputs, outputs, asserts = _listed(data["inputs"]), _listed(data["outputs"]), None
    else:
        raise ValueError(
            f"ground_truth test cases need 'inputs' and 'outputs' (or 'assert_case'); "
            f"it has {sorted(map(str, data))}"
        )
    counts = {len(inputs), len(outputs)} | ({len(asserts)} if asserts is not None else set())
    if len(counts) != 1 or not inputs:
        raise ValueError(
            f"ground_truth has {len(inputs)} inputs and {len(outputs)} outputs"
            + (f" and {len(asserts)} assert_case snippets" if asserts is not None else "")
            + ": test cases need as many of each, at least one"
        )
    fn_name = data.get("fn_name") or None
    return TestCases(inputs, outputs, str(fn_name) if fn_name else None, asserts)


def case_program(code: str, cases: TestCases, index: int) -> tuple[str, str | None]:
    """The program and stdin that case ``index`` runs."""
    program = code
    if cases.asserts is not None:
        program = f"{code}\n\n{cases.asserts[index]}"
    value = cases.inputs[index]
    if cases.fn_name is not None:
        program = _CALL_WRAPPER.format(code=program, fn_name=cases.fn_name)
        if isinstance(value, list | tuple):  # the arguments themselves, one per line
            value = "\n".join(json.dumps(arg) for arg in value)
    return program, None if value is None else str(value)


def case_passed(stdout: str, expected: Any) -> bool:
    """Whether a run that ended with status 0 printed ``expected`` (module docstring)."""
    if expected is None:
        return True
    got = stdout.rstrip("\n")
    if got == str(expected).rstrip("\n"):
        return True
    if isinstance(expected, str):
        return False
    try:
        value = json.loads(got)
    except ValueError:
        return False
    single = isinstance(expected, list | tuple) and len(expected) == 1
    return value == expected or (single and value == expected[0])


def _listed(value: Any) -> list[Any]:
    if hasattr(value, "tolist"):  # numpy arrays, as parquet columns come back
        value = value.tolist()
    if not isinstance(value, list | tuple):
        raise ValueError(f"ground_truth inputs and outputs must be lists; got {_short(value)}")
    return list(value)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
