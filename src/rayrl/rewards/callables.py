"""Python callables as a reward source: reward functions given as objects, not files.

`rayrl.GRPOTrainer(reward_funcs=[...])` takes reward functions in either of two styles:

- rayrl's own (verl's): ``fn(data_source, solution_str, ground_truth, extra_info)``
  returning a number or a dict with a numeric "score" (any function that takes
  ``solution_str``);
- the batch style TRL users write: ``fn(prompts, completions, **columns)`` returning a
  list of numbers, one per completion (None: no opinion on that one). ``columns`` are
  the dataset's other columns, each a list; a completion is a string, or a list of one
  assistant message when the prompt was chat messages.

`RewardFuncs` holds them with their weights and is itself a per-sample function of
rayrl's signature: it calls each function on one sample and returns the weighted sum
(the functions that said None left out), with each function's own score as an extra
metric when there are several (`reward/<name>/mean`). A sample's extra columns and its
original prompt travel in its `extra_info` (the prompt under `PROMPT_KEY`), as the
Python API writes its data.

The reward workers are other processes (Ray actors, and the scoring processes each
spawns), so the functions travel pickled: `pickle_funcs` pickles them with cloudpickle (Ray's)
(an importable function by reference, a closure or a function of a script by value)
into the text of config key `custom_reward_function.pickled`, which the reward loader
resolves as a `PickledFunction` spec (`rayrl.rewards.loader`). A function
that does not pickle is a RewardFunctionError naming it, raised in the driver.
"""

from __future__ import annotations

import base64
import inspect
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from rayrl.rewards.loader import PARAMS, RewardFunctionError

PROMPT_KEY = "prompt"  # the original prompt (a string or chat messages), in extra_info
BATCH_STYLE_ARGS = ("prompts", "completions")  # what a batch-style function is given


def describe(fn: Callable[..., Any]) -> str:
    """A callable's name for messages: module.qualname, or its type's for an object."""
    name = getattr(fn, "__qualname__", None) or f"{type(fn).__qualname__} object"
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{name}" if module and module != "builtins" else name


def metric_name(fn: Callable[..., Any]) -> str:
    """A short name for a function's extra metric (`reward/<name>/mean`)."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "lambda" if name == "<lambda>" else name


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:
        raise RewardFunctionError(
            f"reward function {describe(fn)}: cannot read its signature ({exc})."
        ) from None


def is_rayrl_style(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes rayrl's per-sample arguments (it has a `solution_str`)."""
    return "solution_str" in _parameters(fn)


def takes_kwargs(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes **kwargs."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in _parameters(fn).values())


def required_args(fn: Callable[..., Any]) -> list[str]:
    """The parameters of `fn` that have no default (not *args nor **kwargs)."""
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        p.name
        for p in _parameters(fn).values()
        if p.default is inspect.Parameter.empty and p.kind not in skip
    ]


def check_function(fn: object, columns: Collection[str] | None = None) -> None:
    """Raise RewardFunctionError unless `fn` is a reward function of either style whose
    required arguments are all passed; `columns`, when known, are the dataset's extra
    columns (what a batch-style function may ask for by name)."""
    if not callable(fn):
        raise RewardFunctionError(
            f"reward_funcs holds {fn!r} ({type(fn).__name__}), not a function; pass "
            "callables (for a reward model set reward_model.enable and reward_model.model.path)"
        )
    params = _parameters(fn)
    positional_only = [p.name for p in params.values() if p.kind is p.POSITIONAL_ONLY]
    if positional_only:
        raise RewardFunctionError(
            f"reward function {describe(fn)} takes {positional_only} by position only; "
            "its arguments are passed by name"
        )
    known = set(PARAMS) if is_rayrl_style(fn) else set(BATCH_STYLE_ARGS)
    if not is_rayrl_style(fn) and "completions" not in params and not takes_kwargs(fn):
        raise RewardFunctionError(
            f"reward function {describe(fn)}{inspect.signature(fn)} takes neither "
            "`completions` (the batch style: fn(prompts, completions, **columns) -> list of "
            "floats) nor `solution_str` (rayrl's: fn(data_source, solution_str, "
            "ground_truth, extra_info) -> float)"
        )
    if columns is None and not is_rayrl_style(fn):
        return
    missing = [a for a in required_args(fn) if a not in known and a not in (columns or ())]
    if missing:
        offered = sorted(known | set(columns or ()))
        raise RewardFunctionError(
            f"reward function {describe(fn)} needs {missing}, which nothing passes; it is "
            f"given {offered}. Give those parameters defaults, or add the columns to the dataset"
        )


def pickle_funcs(funcs: RewardFuncs) -> str:
    """`funcs` pickled for the reward workers (base64 text of cloudpickle's bytes).

    Raises RewardFunctionError naming the first function that does not pickle."""
    from ray import cloudpickle  # Ray's own copy: no dependency of its own

    for fn in funcs.funcs:
        try:
            cloudpickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - anything pickling raises is the answer
            raise RewardFunctionError(
                f"reward function {describe(fn)} cannot be sent to the reward workers: it "
                f"does not pickle ({type(exc).__name__}: {exc}). Define it at the top level "
                "of a module or script, or as a closure over values that pickle (not an "
                "open file, lock, socket, client or a model loaded in this process: create "
                "those inside the function, once, e.g. in a module-level cache)"
            ) from None
    return base64.b64encode(cloudpickle.dumps(funcs)).decode("ascii")


class RewardFuncs:
    """Several reward functions, either style, as one per-sample function of rayrl's
    signature returning their weighted sum (module docstring)."""

    def __init__(
        self, funcs: Sequence[Callable[..., Any]], weights: Sequence[float] | None = None
    ) -> None:
        self.funcs = list(funcs)
        self.weights = [1.0] * len(self.funcs) if weights is None else [float(w) for w in weights]
        if not self.funcs:
            raise RewardFunctionError("reward_funcs is empty: give at least one reward function")
        if len(self.weights) != len(self.funcs):
            raise RewardFunctionError(
                f"reward_weights has {len(self.weights)} values for {len(self.funcs)} reward "
                "functions: give one weight per function"
            )
        for fn in self.funcs:
            check_function(fn)
        self.names = _unique([metric_name(fn) for fn in self.funcs])
        # how each is called, read from its signature once, not for every sample
        self.calls = [Call.of(fn) for fn in self.funcs]

    def describe(self) -> str:
        """The functions and their weights, for messages."""
        return " + ".join(
            describe(fn) if w == 1.0 else f"{w:g} * {describe(fn)}"
            for fn, w in zip(self.funcs, self.weights, strict=True)
        )

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
    ) -> float | dict[str, Any] | None:
        sample = Sample(data_source, solution_str, ground_truth, extra_info)
        total, found, extra = 0.0, False, {}
        for call, weight, name in zip(self.calls, self.weights, self.names, strict=True):
            score, more = sample.score_with(call)
            extra.update(more)
            if score is None:
                continue
            total, found = total + weight * score, True
            if len(self.funcs) > 1:
                extra[name] = score
        if not found:
            return None  # every function abstained: a failed sample, counted
        return {"score": total, **extra} if extra else total


@dataclass(frozen=True)
class Call:
    """A reward function with how it is called: rayrl's style or the batch style, and
    the keyword arguments it accepts (None: any, it takes **kwargs)."""

    fn: Callable[..., Any]
    rayrl_style: bool
    accepts: frozenset[str] | None

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> Call:
        accepts = None if takes_kwargs(fn) else frozenset(_parameters(fn))
        return cls(fn, is_rayrl_style(fn), accepts)


@dataclass(frozen=True)
class Sample:
    """One sample as rayrl scores it, callable with a function of either style."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Any

    def score_with(self, call: Call) -> tuple[float | None, dict[str, Any]]:
        """The function's score of this sample (None: it abstained) and its extra
        metrics."""
        fn = call.fn
        if call.rayrl_style:
            value = fn(
                data_source=self.data_source,
                solution_str=self.solution_str,
                ground_truth=self.ground_truth,
                extra_info=self.extra_info,
            )
            if isinstance(value, dict):
                extra = {k: v for k, v in value.items() if k != "score"}
                return _number(fn, value.get("score")), extra
            return _number(fn, value), {}
        return _number(fn, _one(fn, fn(**self.batch_style_args(call.accepts)))), {}

    def batch_style_args(self, accepts: frozenset[str] | None) -> dict[str, list[Any]]:
        """The keyword arguments of a batch-style function accepting `accepts` (None:
        any), as lists of one."""
        columns = dict(self.extra_info) if isinstance(self.extra_info, dict) else {}
        prompt = columns.pop(PROMPT_KEY, None)
        chat = isinstance(prompt, list | tuple)
        completion = [{"role": "assistant", "content": self.solution_str}] if chat else None
        args = {"prompts": [prompt], "completions": [completion or self.solution_str]}
        args |= {key: [value] for key, value in columns.items() if key not in args}
        if accepts is None:
            return args
        return {key: value for key, value in args.items() if key in accepts}


def _one(fn: Callable[..., Any], value: object) -> object:
    """The single score of a batch-style function called on one sample."""
    if hasattr(value, "tolist"):  # a numpy array or a tensor
        value = value.tolist()
    if not isinstance(value, list | tuple) or len(value) != 1:
        got = f"{len(value)} values" if isinstance(value, list | tuple) else repr(value)[:80]
        raise TypeError(
            f"reward function {describe(fn)} was called with 1 completion and must return a "
            f"list of 1 score (float or None); it returned {got}"
        )
    return value[0]


def _number(fn: Callable[..., Any], value: object) -> float | None:
    """`value` as a float; None stays None; anything else is a TypeError naming `fn`."""
    if value is None:
        return None
    if hasattr(value, "item"):  # numpy scalars, one-element tensors
        value = value.item()
    if isinstance(value, bool | int | float) and math.isfinite(float(value)):
        return float(value)
    raise TypeError(f"reward function {describe(fn)} returned {value!r}, not a finite number")


def _unique(names: list[str]) -> list[str]:
    """`names` with repeats numbered (`f`, `f_2`, ...)."""
    seen: dict[str, int] = {}
    out: list[str] = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out
