"""Load reward functions: a user file by path (verl's `compute_score`), or a built-in by name.

`load_function(path, name)` imports a Python file (config `custom_reward_function.path` and
`custom_reward_function.name`) and checks that `name` is a function that can be called as
`fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`.
`resolve_function(spec)` turns a picklable *function spec* into that callable; the
pool sends specs, not functions, to its spawned processes:

- None or "default": `registry.compute_score`, dispatching on data_source;
- a registered data_source name ("gsm8k"): that scorer for every sample;
- a `(path, name)` pair: `load_function(path, name)`.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayrl.rewards import registry

PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
DEFAULT_NAME = "compute_score"

RewardFunction = Callable[..., float | dict]
FunctionSpec = str | tuple[str, str] | None


class RewardFunctionError(ValueError):
    """A reward function could not be loaded or has the wrong signature."""


def load_function(path: str | os.PathLike, name: str = DEFAULT_NAME) -> RewardFunction:
    """Import the file at `path` and return its function `name`, signature checked.

    Raises RewardFunctionError naming the file and what to fix when the file is
    missing or fails to import, the function is missing, or its signature cannot take
    the four arguments `data_source, solution_str, ground_truth, extra_info` by name.
    """
    file = Path(path).expanduser().absolute()
    if not file.is_file():
        raise RewardFunctionError(
            f"custom_reward_function.path: no such file {file} (working directory {Path.cwd()}). "
            "Give the path of a Python file that defines compute_score."
        )
    module = _import_file(file)
    fn = getattr(module, name, None)
    if fn is None:
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(name, defined, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RewardFunctionError(
            f"{file} defines no function {name!r}.{hint} Callables in the file: "
            f"{sorted(defined) or 'none'}. Set custom_reward_function.name to the right name."
        )
    if not callable(fn):
        raise RewardFunctionError(f"{file}: {name!r} is a {type(fn).__name__}, not a function.")
    check_signature(fn, where=f"{file}:{name}")
    return fn


def check_signature(fn: Callable, where: str = "reward function") -> None:
    """Raise RewardFunctionError unless `fn` accepts the four reward arguments by name.

    Each of data_source, solution_str, ground_truth, extra_info must be a parameter
    passable by keyword, or `fn` must take **kwargs; any other parameter needs a default.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        raise RewardFunctionError(f"{where}: cannot read its signature ({exc}).") from None
    kinds = inspect.Parameter
    by_name = (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    has_kwargs = any(p.kind is kinds.VAR_KEYWORD for p in params.values())
    missing = [n for n in PARAMS if not (n in params and params[n].kind in by_name)]
    if missing and not has_kwargs:
        raise RewardFunctionError(
            f"{where} must accept {', '.join(PARAMS)} by name (or **kwargs); "
            f"missing or positional-only: {missing}. Its signature is {inspect.signature(fn)}. "
            f"Expected e.g. def compute_score({', '.join(PARAMS)}=None)."
        )
    required = [
        p.name
        for p in params.values()
        if p.name not in PARAMS
        and p.default is kinds.empty
        and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
    ]
    if required:
        raise RewardFunctionError(
            f"{where}: parameters {required} have no default, but only {', '.join(PARAMS)} "
            "are passed. Give them defaults."
        )


class BuiltinScorer:
    """A picklable reward function that scores every sample with one built-in scorer."""

    def __init__(self, source: str) -> None:
        registry.get_scorer(source)  # fail now, with suggestions, if unknown
        self.source = source

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
    ) -> float | dict:
        return registry.get_scorer(self.source)(solution_str, ground_truth, extra_info)

    def __repr__(self) -> str:
        return f"BuiltinScorer({self.source!r})"


def resolve_function(spec: FunctionSpec) -> RewardFunction:
    """The reward function a spec names (see the module docstring)."""
    if spec is None or spec == "default":
        return registry.compute_score
    if isinstance(spec, str):
        return BuiltinScorer(spec)
    if isinstance(spec, tuple | list) and len(spec) == 2:
        return load_function(spec[0], spec[1] or DEFAULT_NAME)
    raise RewardFunctionError(
        f"reward function spec {spec!r} is not None, a built-in name or a (path, name) pair."
    )


def spec_from_config(path: str | None, name: str = DEFAULT_NAME) -> FunctionSpec:
    """The function spec of config `custom_reward_function.{path,name}`: a file, else the registry."""
    return (str(Path(path).expanduser().absolute()), name or DEFAULT_NAME) if path else None


def _import_file(file: Path) -> Any:
    """Import `file` as a fresh module (registered in sys.modules, so dataclasses work)."""
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    module_name = f"rayrl_user_reward_{file.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise RewardFunctionError(f"{file} is not an importable Python file (use a .py file).")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise RewardFunctionError(
            f"importing reward file {file} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module
