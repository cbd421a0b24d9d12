"""Product and test machinery apart: no module of rayrl outside `rayrl.testing` imports
that package (fault injection and the chaos monkey live there), and no fault or chaos
code lives anywhere else. Reads the sources with `ast`; starts nothing."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
TESTING = "rayrl.testing"
TEST_ONLY_CLASSES = {"Fault", "FaultHook", "ChaosMonkey"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every module that `source` (the code of `module`) imports:
    import statements, relative ones resolved, and `importlib.import_module` or
    `__import__` calls with a constant name."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__")


def is_testing(name: str) -> bool:
    return name == TESTING or name.startswith(TESTING + ".")


def product_modules() -> list[tuple[Path, str]]:
    paths = sorted((SRC / "rayrl").rglob("*.py"))
    named = [(p, module_name(p)) for p in paths]
    return [(p, m) for p, m in named if not is_testing(m)]


def test_no_product_module_imports_the_testing_package():
    modules = product_modules()
    assert len(modules) > 100  # the walk found the package
    offenders = [
        f"{path.relative_to(SRC)}:{line} imports {name}"
        for path, module in modules
        for line, name in imports(path.read_text(), module, path.name == "__init__.py")
        if is_testing(name)
    ]
    assert not offenders, "\n".join(offenders)


def test_fault_and_chaos_code_lives_only_in_the_testing_package():
    misplaced = []
    for path, _ in product_modules():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name in TEST_ONLY_CLASSES:
                misplaced.append(f"{path.relative_to(SRC)}: class {node.name}")
        if path.stem in ("faults", "chaos"):
            misplaced.append(str(path.relative_to(SRC)))
    assert not misplaced, misplaced


def test_the_check_sees_every_form_of_import():
    caught = {
        "import rayrl.testing.faults": "rayrl.controller.group",
        "from rayrl.testing.chaos import ChaosMonkey": "rayrl.trainer.ppo",
        "from rayrl import testing": "rayrl.cli.main",
        "from ..testing import faults": "rayrl.controller.group",
        "from . import testing": "rayrl",
        "import importlib\nimportlib.import_module('rayrl.testing.faults')": "rayrl.cli.main",
        "def f():\n    from rayrl.testing.faults import inject": "rayrl.trainer.replay",
    }
    for source, module in caught.items():
        names = [name for _, name in imports(source, module, module == "rayrl")]
        assert any(is_testing(n) for n in names), (source, names)
    clean = "from rayrl.controller import calls\nfrom .. import progress\nimport rayrl.trainer"
    names = [name for _, name in imports(clean, "rayrl.controller.group")]
    assert names and not any(is_testing(n) for n in names), names
