"""The name registry: declared entries are known at once and imported on first use."""

import subprocess
import sys

import pytest

from rayrl.registry import Registry, UnknownNameError


def test_a_declared_entry_is_known_before_its_module_is_imported(tmp_path, monkeypatch):
    module = tmp_path / "declared_plugin.py"
    module.write_text(
        "from tests_registry_target import REG\n"
        "@REG.register('late', extra=2)\n"
        "def late_fn():\n"
        "    return 'late'\n"
    )
    target = tmp_path / "tests_registry_target.py"
    target.write_text("from rayrl.registry import Registry\nREG = Registry('thing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from tests_registry_target import REG

    REG.declare("late", "declared_plugin:late_fn", extra=1, early=True)
    assert "late" in REG and "declared_plugin" not in sys.modules
    assert REG.get("late")() == "late"
    assert REG.info("late") == {"extra": 2, "early": True}
    assert "declared_plugin" in sys.modules


def test_a_declared_module_that_does_not_register_fails_with_what_to_fix(tmp_path, monkeypatch):
    (tmp_path / "silent_plugin.py").write_text("def fn():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("thing")
    reg.declare("fn", "silent_plugin:fn")
    with pytest.raises(ImportError, match=r"register\('fn'\)"):
        reg.get("fn")


def test_a_second_object_under_a_declared_name_is_refused():
    reg = Registry("thing")
    reg.declare("x", "some.module:x")
    with pytest.raises(ValueError, match="already registered"):
        reg.add("x", lambda: None)
    with pytest.raises(UnknownNameError, match="Did you mean 'x'"):
        reg.get("xx")


def test_checking_a_config_imports_neither_transformers_nor_ray():
    """`rayrl train` checks names before Ray starts; that check should cost imports of
    torch at most, not of transformers (the hf engine) or Ray."""
    code = (
        "import sys\n"
        "from rayrl.config.load import load_config\n"
        "from rayrl.trainer.names import check_names\n"
        "check_names(load_config('grpo'))\n"
        "print(sorted(m for m in ('transformers', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
