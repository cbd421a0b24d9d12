"""The one loader of user code (`rayrl.usercode`): each error names what to fix, a
file is imported once per process (fresh on request), and the packages' loaders
(tools and environments, reward files, dataset classes, samplers) all go through it."""

from __future__ import annotations

import pytest

from rayrl import usercode
from rayrl.envs import LoadError, load_object
from rayrl.rewards.loader import RewardFunctionError, load_function
from rayrl.usercode import UserCodeError, attribute, import_file


@pytest.fixture
def user_file(tmp_path):
    file = tmp_path / "mine.py"
    file.write_text(
        "COUNT = []\nCOUNT.append(1)\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    return file


def test_a_file_is_imported_once_unless_asked_fresh(user_file):
    first = import_file(user_file, "test")
    assert import_file(str(user_file), "test") is first and first.COUNT == [1]
    again = import_file(user_file, "test", fresh=True)
    assert again is not first and again.COUNT == [1]


def test_specs_by_file_pair_module_and_errors(user_file):
    assert load_object(f"{user_file}:COUNT") is import_file(user_file, "x").COUNT
    assert load_object((str(user_file), "compute_score"))(None, None, None) == 1.0
    assert usercode.load_object("os.path:join") is __import__("os").path.join
    with pytest.raises(LoadError, match="defines no 'compute_scor'.*Did you mean 'compute_score'"):
        load_object(f"{user_file}:compute_scor", "environment")
    with pytest.raises(UserCodeError, match="importing module 'no_such_pkg'.*PYTHONPATH"):
        usercode.load_object("no_such_pkg:Thing")
    with pytest.raises(UserCodeError, match="neither a registered name"):
        usercode.load_object("plainword")
    with pytest.raises(UserCodeError, match="no such file"):
        import_file(user_file.with_name("gone.py"), "tool")


def test_each_package_error_is_a_user_code_error(user_file, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardFunctionError, match="reward file: importing .*broken.py") as err:
        load_function(broken)
    assert isinstance(err.value, UserCodeError)
    with pytest.raises(LoadError, match="tool: importing .*broken.py") as err:
        load_object(f"{broken}:x", "tool")
    assert isinstance(err.value, UserCodeError)
    assert attribute(import_file(user_file, "x"), "COUNT", "here", "x") == [1]
