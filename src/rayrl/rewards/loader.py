"""Load reward functions: a user file by path (verl's `compute_score`), or a built-in by name.

`load_function(path, name)` imports a Python file (config `custom_reward_function.path` and
`custom_reward_function.name`) and checks that `name` is a function that can be called as
`fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`.
`check_file(path, name)` finds the same mistakes in a file without running it (a
missing file, a syntax error, no such function), for the driver before Ray starts.
`resolve_function(spec)` turns a picklable *function spec* into that callable; the
pool sends specs, not functions, to its spawned processes:

- None or "default": `registry.compute_score`, dispatching on data_source;
- a registered data_source name ("gsm8k"): that scorer for every sample;
- a `(path, name)` pair: `load_function(path, name)`;
- `(path or None, name, kwargs)`: either of the above, called with the extra keyword
  arguments `kwargs` (verl's `reward_kwargs`);
- a `PickledFunction`: Python callables given to `rayrl.GRPOTrainer`, pickled
  (`rayrl.rewards.callables`; config `custom_reward_function.pickled`).

`resolve_function(spec, batched=True)` gives a function of whole batches (verl's batch
reward manager): a user function taking `data_sources, solution_strs, ground_truths,
extra_infos`, or the per-sample one called sample by sample.
"""

from __future__ import annotations

import ast
import base64
import difflib
import inspect
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from rayrl.rewards import registry
from rayrl.usercode import UserCodeError, import_file

PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
DEFAULT_NAME = "compute_score"

# A score, a dict with one under "score", or None: no score (a failed sample); a batched
# function (`resolve_function(batched=True)`), one of those per sample
RewardFunction = Callable[..., float | dict[str, Any] | list[Any] | None]


class RewardFunctionError(UserCodeError):
    """A reward function could not be loaded or has the wrong signature."""


@dataclass(frozen=True)
class PickledFunction:
    """A function spec: reward functions pickled by `rayrl.rewards.callables.pickle_funcs`
    (config `custom_reward_function.pickled`), loaded where they run."""

    payload: str

    def load(self) -> RewardFunction:
        try:
            fn = pickle.loads(base64.b64decode(self.payload))
        except Exception as exc:  # noqa: BLE001 - a missing module, a bad payload, ...
            raise RewardFunctionError(
                "the reward functions given as Python callables (custom_reward_function."
                f"pickled) cannot be loaded here: {type(exc).__name__}: {exc}. A function "
                "pickled by reference needs its module importable on every node (install "
                "it, or put its folder on PYTHONPATH)"
            ) from None
        if not callable(fn):
            raise RewardFunctionError(
                f"custom_reward_function.pickled holds a {type(fn).__name__}, not a function"
            )
        return cast(RewardFunction, fn)

    def __repr__(self) -> str:
        return f"PickledFunction({len(self.payload)} characters)"


# None, a built-in name, (path, name), (path or None, name, extra keyword arguments),
# or pickled Python callables
FunctionSpec = (
    str | tuple[str, str] | tuple[str | None, str, dict[str, Any]] | PickledFunction | None
)


def load_function(path: str | os.PathLike[str], name: str = DEFAULT_NAME) -> RewardFunction:
    """Import the file at `path` and return its function `name`, signature checked.

    Raises RewardFunctionError naming the file and what to fix when the file is
    missing or fails to import, the function is missing, or its signature cannot take
    the four arguments `data_source, solution_str, ground_truth, extra_info` by name.
    """
    fn = import_function(path, name)
    check_signature(fn, where=f"{Path(path).expanduser().absolute()}:{name}")
    return fn


def import_function(path: str | os.PathLike[str], name: str) -> RewardFunction:
    """The function `name` of the file at `path`, its signature not checked (the caller
    checks it for how it calls it)."""
    file = Path(path).expanduser().absolute()
    _check_exists(file)
    module = import_file(file, "reward file", fresh=True, error=RewardFunctionError)
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
    return cast(RewardFunction, fn)


def check_file(path: str | os.PathLike[str], name: str = DEFAULT_NAME) -> None:
    """Raise RewardFunctionError, as `load_function` would, when the file at `path` is
    missing, is not valid Python, or defines no top-level `name` (a function, a class,
    an assignment or an import of that name); the file is read, not run, so a file
    that builds its names some other way (``import *``, a module `__getattr__`) passes."""
    file = Path(path).expanduser().absolute()
    _check_exists(file)
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (SyntaxError, ValueError) as exc:
        lineno = getattr(exc, "lineno", None)
        where = f" line {lineno}" if lineno else ""
        raise RewardFunctionError(
            f"reward file {file}{where} is not valid Python: {exc}. Fix it, or point "
            "custom_reward_function.path at another file."
        ) from None
    defined = _top_level_names(tree)
    if name in defined or "*" in defined or "__getattr__" in defined:
        return
    functions = sorted(n for n in defined if not n.startswith("_"))
    close = difflib.get_close_matches(name, functions, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise RewardFunctionError(
        f"{file} defines no function {name!r}.{hint} Names in the file: "
        f"{functions or 'none'}. Set custom_reward_function.name to the right name."
    )


def _check_exists(file: Path) -> None:
    if not file.is_file():
        raise RewardFunctionError(
            f"custom_reward_function.path: no such file {file} (working directory {Path.cwd()}). "
            "Give the path of a Python file that defines compute_score."
        )


def _top_level_names(tree: ast.Module) -> set[str]:
    """The names a module's top level binds ("*" for a star import)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        else:  # names bound under if / try / with at the top level
            names.update(_top_level_names(ast.Module(body=_blocks(node), type_ignores=[])))
    return names


def _blocks(node: ast.stmt) -> list[ast.stmt]:
    """The statements of an if / try / with / for at the top level, all branches."""
    out: list[ast.stmt] = []
    for field in ("body", "orelse", "finalbody"):
        out += getattr(node, field, None) or []
    for handler in getattr(node, "handlers", None) or []:
        out += handler.body
    return out


def check_signature(
    fn: Callable[..., Any], where: str = "reward function", params: tuple[str, ...] = PARAMS
) -> None:
    """Raise RewardFunctionError unless `fn` accepts the reward arguments `params` by name
    (default: the four per-sample ones; `BATCH_PARAMS` for a batched function).

    Each of them must be a parameter passable by keyword, or `fn` must take **kwargs;
    any other parameter needs a default.
    """
    try:
        found = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        raise RewardFunctionError(f"{where}: cannot read its signature ({exc}).") from None
    kinds = inspect.Parameter
    by_name = (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    has_kwargs = any(p.kind is kinds.VAR_KEYWORD for p in found.values())
    missing = [n for n in params if not (n in found and found[n].kind in by_name)]
    if missing and not has_kwargs:
        raise RewardFunctionError(
            f"{where} must accept {', '.join(params)} by name (or **kwargs); "
            f"missing or positional-only: {missing}. Its signature is {inspect.signature(fn)}. "
            f"Expected e.g. def compute_score({', '.join(params)}=None)."
        )
    required = [
        p.name
        for p in found.values()
        if p.name not in params
        and p.default is kinds.empty
        and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
    ]
    if required:
        raise RewardFunctionError(
            f"{where}: parameters {required} have no default, but only {', '.join(params)} "
            "are passed. Give them defaults."
        )


class BuiltinScorer:
    """A picklable reward function that scores every sample with one built-in scorer."""

    def __init__(self, source: str) -> None:
        registry.get_scorer(source)  # fail now, with suggestions, if unknown
        self.source = source

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
    ) -> float | dict[str, Any]:
        return registry.get_scorer(self.source)(solution_str, ground_truth, extra_info)

    def __repr__(self) -> str:
        return f"BuiltinScorer({self.source!r})"


BATCH_PARAMS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


class BatchedCalls:
    """A picklable batched reward function that scores each sample with a per-sample
    one (the built-in scorers under `reward_manager=batch`)."""

    def __init__(self, fn: RewardFunction) -> None:
        self.fn = fn

    def __call__(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict[str, Any] | None] | None = None,
        **kwargs: Any,
    ) -> list[float | dict[str, Any] | list[Any] | None]:
        infos = extra_infos if extra_infos is not None else [None] * len(data_sources)
        return [
            self.fn(data_source=d, solution_str=s, ground_truth=g, extra_info=e, **kwargs)
            for d, s, g, e in zip(data_sources, solution_strs, ground_truths, infos, strict=True)
        ]

    def __repr__(self) -> str:
        return f"BatchedCalls({self.fn!r})"


class WithKwargs:
    """A reward function called with extra keyword arguments (verl's `reward_kwargs`);
    picklable when the function is."""

    def __init__(self, fn: RewardFunction, kwargs: dict[str, Any]) -> None:
        self.fn, self.kwargs = fn, dict(kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **{**kwargs, **self.kwargs})


def resolve_function(spec: FunctionSpec, batched: bool = False) -> RewardFunction:
    """The reward function a spec names (see the module docstring). With `batched`, the
    function takes the lists of a whole batch (`BATCH_PARAMS`) and returns one score per
    sample; the built-in scorers are called one sample at a time behind it."""
    if isinstance(spec, PickledFunction):
        pickled = spec.load()
        check_signature(pickled, where="the reward functions given as Python callables")
        return BatchedCalls(pickled) if batched else pickled
    kwargs: dict[str, Any] = {}
    if isinstance(spec, tuple | list) and len(spec) == 3:
        path, name, kwargs = spec
        spec = (path, name) if path else None
    if spec is None or spec == "default":
        fn: RewardFunction = registry.compute_score
    elif isinstance(spec, str):
        fn = BuiltinScorer(spec)
    elif isinstance(spec, tuple | list) and len(spec) == 2:
        return _user_function(spec[0], spec[1] or DEFAULT_NAME, batched, dict(kwargs))
    else:
        raise RewardFunctionError(
            f"reward function spec {spec!r} is not None, a built-in name or a (path, name) pair."
        )
    if kwargs:
        raise RewardFunctionError(
            f"reward_kwargs {sorted(kwargs)} were given, but the built-in scorers take no "
            "extra arguments; they are for a compute_score of your own "
            "(custom_reward_function.path)"
        )
    return BatchedCalls(fn) if batched else fn


def _user_function(path: str, name: str, batched: bool, kwargs: dict[str, Any]) -> RewardFunction:
    """A user file's function, its signature checked for how it is called: the reward
    arguments (per sample or batched) and the extra keyword arguments `kwargs`
    (`reward_kwargs`; a generative reward model's `reward_router_address`, ...)."""
    fn = import_function(path, name)
    where = f"{Path(path).expanduser().absolute()}:{name}"
    if kwargs:
        check_accepts(fn, list(kwargs), where=where)
    params = (BATCH_PARAMS if batched else PARAMS) + tuple(kwargs)
    check_signature(fn, where=where, params=params)
    return WithKwargs(fn, kwargs) if kwargs else fn


def check_accepts(fn: Callable[..., Any], names: list[str], where: str) -> None:
    """Raise RewardFunctionError unless `fn` takes each of `names` by keyword."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [n for n in names if n not in params]
    if missing:
        raise RewardFunctionError(
            f"{where} takes no argument {missing} (from reward_kwargs); its signature is "
            f"{inspect.signature(fn)}"
        )


def spec_from_config(
    path: str | None,
    name: str = DEFAULT_NAME,
    kwargs: dict[str, Any] | None = None,
    pickled: str | None = None,
) -> FunctionSpec:
    """The function spec of config `custom_reward_function.{path,name}` (a file, else the
    registry), with the extra keyword arguments of every call (`reward_kwargs`); or of
    `custom_reward_function.pickled` (Python callables), which takes no `reward_kwargs`."""
    if pickled:
        if kwargs:
            raise RewardFunctionError(
                f"reward_kwargs {sorted(kwargs)} were given with reward functions passed as "
                "Python callables; give the functions default arguments (or functools.partial) "
                "instead"
            )
        return PickledFunction(pickled)
    file = str(Path(path).expanduser().absolute()) if path else None
    if kwargs:
        return (file, name or DEFAULT_NAME, dict(kwargs))
    return (file, name or DEFAULT_NAME) if file else None
