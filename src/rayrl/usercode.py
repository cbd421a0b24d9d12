"""The one loader of user code named in a config: reward functions, tools,
environments, interactions, dataset classes and samplers.

`load_object(spec, kind)` imports what a spec names:

- ``"package.module:Name"`` or ``"package.module.Name"`` (verl's ``class_name``);
- ``"/path/to/file.py:Name"`` or a ``(path, name)`` pair: the file imported as a
  module of its own (`import_file`).

`import_file(file, kind)` imports a Python file under a name made from its path, kept
in ``sys.modules`` (so dataclasses and pickling by reference work) and imported once
per process; ``fresh=True`` imports it again (a reward file read anew for each
bundle). `attribute(module, name, where, kind)` takes one name from it, with a
did-you-mean. Each raises ``error`` (a `UserCodeError` by default; the packages pass
their own subclass of ValueError) with what to fix.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["UserCodeError", "attribute", "import_file", "load_object"]


class UserCodeError(ValueError):
    """User code named in a config could not be imported or found."""


def load_object(
    spec: str | tuple[str, str] | list, kind: str = "object", error: type[Exception] = UserCodeError
) -> Any:
    """The object a spec names (see the module docstring); ``error`` says what to fix."""
    if isinstance(spec, tuple | list):
        if len(spec) != 2:
            raise error(f"{kind} spec {spec!r}: give (path, name).")
        return _from_file(Path(spec[0]), str(spec[1]), kind, error)
    text = str(spec).strip()
    if ":" in text:
        where, name = text.rsplit(":", 1)
    elif "." in text and not text.endswith(".py"):
        where, name = text.rsplit(".", 1)
    else:
        raise error(
            f"{kind} {text!r} is neither a registered name nor 'module.Name', "
            "'module:Name' or '/path/file.py:Name'."
        )
    if where.endswith(".py") or os.sep in where:
        return _from_file(Path(where), name, kind, error)
    try:
        module = importlib.import_module(where)
    except Exception as err:
        raise error(
            f"{kind} {text!r}: importing module {where!r} failed ({type(err).__name__}: {err}). "
            "Is it installed, or on PYTHONPATH of every worker?"
        ) from err
    return attribute(module, name, f"module {where}", kind, error)


def _from_file(file: Path, name: str, kind: str, error: type[Exception]) -> Any:
    module = import_file(file, kind, error=error)
    return attribute(module, name, str(file.expanduser().absolute()), kind, error)


def import_file(
    file: str | os.PathLike,
    kind: str,
    *,
    fresh: bool = False,
    error: type[Exception] = UserCodeError,
) -> Any:
    """The module of a Python file, under a name made from its absolute path."""
    file = Path(file).expanduser().absolute()
    if not file.is_file():
        raise error(f"{kind}: no such file {file} (working directory {Path.cwd()}).")
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    module_name = f"rayrl_user_{file.stem}_{digest}"
    module = None if fresh else sys.modules.get(module_name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise error(f"{kind}: {file} is not an importable Python file (use a .py file).")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise error(f"{kind}: importing {file} failed: {type(err).__name__}: {err}") from err
    return module


def attribute(
    module: Any, name: str, where: str, kind: str, error: type[Exception] = UserCodeError
) -> Any:
    """``module``'s ``name``, or ``error`` naming the closest name it defines."""
    if hasattr(module, name):
        return getattr(module, name)
    defined = [k for k in vars(module) if not k.startswith("_")]
    close = difflib.get_close_matches(name, defined, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise error(f"{kind}: {where} defines no {name!r}.{hint}")
