"""Loading reward functions from user files and resolving picklable function specs."""

from __future__ import annotations

import pickle
import textwrap
from pathlib import Path

import pytest

from rayrl.rewards import registry
from rayrl.rewards.loader import (
    BuiltinScorer,
    RewardFunctionError,
    check_file,
    check_signature,
    load_function,
    resolve_function,
    spec_from_config,
)

GOOD = """
from dataclasses import dataclass

@dataclass
class Verdict:
    score: float

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": Verdict(float(solution_str == ground_truth)).score, "source": data_source}

def with_kwargs(**kwargs):
    return len(kwargs)

def keyword_only(*, data_source, solution_str, ground_truth, extra_info, bonus=0.5):
    return 1.0 + bonus

def positional_only(data_source, solution_str, ground_truth, extra_info, /):
    return 1.0

def missing_extra(data_source, solution_str, ground_truth):
    return 1.0

def needs_more(data_source, solution_str, ground_truth, extra_info, scale):
    return scale

NOT_A_FUNCTION = 3
"""


def write(tmp_path: Path, text: str, name: str = "reward.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_load_function_imports_a_file_by_path(tmp_path):
    path = write(tmp_path, GOOD)
    fn = load_function(path)
    assert fn(data_source="d", solution_str="a", ground_truth="a", extra_info=None) == {
        "score": 1.0,
        "source": "d",
    }
    assert load_function(str(path), "with_kwargs")(a=1, b=2) == 2
    assert (
        load_function(path, "keyword_only")(
            data_source="d", solution_str="s", ground_truth="g", extra_info={}
        )
        == 1.5
    )


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(RewardFunctionError, match=r"no such file .*nope\.py"):
        load_function(tmp_path / "nope.py")


def test_missing_function_lists_what_the_file_has(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(RewardFunctionError) as info:
        load_function(path, "compute_scores")
    message = str(info.value)
    assert "no function 'compute_scores'" in message and "Did you mean 'compute_score'" in message
    assert str(path) in message and "custom_reward_function.name" in message
    with pytest.raises(RewardFunctionError, match="is a int, not a function"):
        load_function(path, "NOT_A_FUNCTION")


@pytest.mark.parametrize(
    ("name", "complaint"),
    [
        ("positional_only", r"missing or positional-only: \['data_source'"),
        ("missing_extra", r"missing or positional-only: \['extra_info'\]"),
        ("needs_more", r"parameters \['scale'\] have no default"),
    ],
)
def test_wrong_signatures_are_refused_with_the_signature_shown(tmp_path, name, complaint):
    path = write(tmp_path, GOOD)
    with pytest.raises(RewardFunctionError, match=complaint) as info:
        load_function(path, name)
    assert f"{path}:{name}" in str(info.value)


def test_a_file_that_fails_to_import_says_so(tmp_path):
    path = write(tmp_path, "import not_a_real_module_xyz\n")
    with pytest.raises(RewardFunctionError, match="reward file: importing .*ModuleNotFoundError"):
        load_function(path)
    syntax = write(tmp_path, "def compute_score(:\n", name="broken.py")
    with pytest.raises(RewardFunctionError, match="SyntaxError"):
        load_function(syntax)
    data = write(tmp_path, "x = 1\n", name="reward.txt")
    with pytest.raises(RewardFunctionError, match="not an importable Python file"):
        load_function(data)


def test_check_signature_accepts_builtins_and_lambdas():
    check_signature(registry.compute_score)
    check_signature(lambda data_source, solution_str, ground_truth, extra_info: 0.0)
    with pytest.raises(RewardFunctionError, match="must accept"):
        check_signature(lambda solution_str, ground_truth: 0.0)


def test_resolve_function_specs(tmp_path):
    path = write(tmp_path, GOOD)
    assert resolve_function(None) is registry.compute_score
    assert resolve_function("default") is registry.compute_score
    from_file = resolve_function((str(path), "compute_score"))
    assert from_file(data_source="x", solution_str="1", ground_truth="1", extra_info=None)["score"]
    gsm8k = resolve_function("gsm8k")  # one built-in for every sample, whatever its source
    assert gsm8k("anything", "#### 3", "3")["score"] == 1.0
    assert pickle.loads(pickle.dumps(gsm8k))("x", "#### 4", "3")["score"] == 0.0
    with pytest.raises(KeyError, match="Did you mean 'gsm8k'"):
        BuiltinScorer("gsm8")
    with pytest.raises(RewardFunctionError, match="not None, a built-in name"):
        resolve_function(42)  # type: ignore[arg-type]


def test_spec_from_config(tmp_path):
    assert spec_from_config(None) is None
    assert spec_from_config("", "f") is None
    assert spec_from_config(str(tmp_path / "r.py"), "f") == (str(tmp_path / "r.py"), "f")
    assert spec_from_config("rel.py", "")[1] == "compute_score"
    assert Path(spec_from_config("rel.py")[0]).is_absolute()


def test_check_file_finds_what_loading_would_refuse_without_running_the_file(tmp_path):
    """`check_file` reads the file (a side effect at import would show): a missing file,
    invalid Python and a missing name fail as `load_function` would; a name bound by a
    def, a class, an assignment, an import or inside a top-level if/try passes, and so
    does a file whose names come from `import *` (it cannot tell)."""
    marker = tmp_path / "ran"
    body = f"open({str(marker)!r}, 'w').close()\n"
    cases = {
        "def compute_score(data_source, solution_str, ground_truth):\n    return 0\n": True,
        "class compute_score:\n    pass\n": True,
        "compute_score = lambda **kw: 0\n": True,
        "from math import floor as compute_score\n": True,
        "try:\n    import json\nexcept ImportError:\n    pass\nelse:\n    compute_score = 1\n": True,
        "if True:\n    def compute_score(**kw):\n        return 0\n": True,
        "from math import *\n": True,
        "def compute_scores(**kw):\n    return 0\n": "Did you mean 'compute_scores'?",
        "x = 1\n": "defines no function 'compute_score'",
        "def compute_score(:\n": "line 2 is not valid Python",
    }
    for i, (text, outcome) in enumerate(cases.items()):
        path = tmp_path / f"r{i}.py"
        path.write_text(body + text)
        if outcome is True:
            check_file(path)
        else:
            with pytest.raises(RewardFunctionError, match=outcome):
                check_file(path)
    assert not marker.exists()  # read, never run
    with pytest.raises(RewardFunctionError, match="no such file"):
        check_file(tmp_path / "absent.py")
    check_file(tmp_path / "r7.py", name="compute_scores")
