"""verl 0.9.1's own implementations of the algorithms rayrl cross-checks, read from verl's
published wheel at test time (nothing of verl's is kept in this repository).

`verl_wheel` finds the ``verl==0.9.1`` wheel (downloaded once by `scripts/setup.sh`
into ``.cache/verl/``, or here with ``pip download --no-deps`` when it is missing);
`load_verl` reads each function named in `FILES` from the file named there, from its
``def`` line (its registration decorator left out), and the module-level constants
named in `CONSTANTS` they use, and executes them into a namespace of torch, numpy,
math and the few small stand-ins they import (verl's config classes), so
the tests can compare rayrl's implementations with verl's on the same random inputs.
Without the wheel (no package index) the tests that need it skip, saying why.
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys
import types
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

VERL = "verl==0.9.1"
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "verl"

FILES: dict[str, str] = {
    "masked_sum": "verl/utils/torch_functional.py",
    "masked_mean": "verl/utils/torch_functional.py",
    "compute_gpg_outcome_advantage": "verl/trainer/ppo/core_algos.py",
    "compute_optimal_token_baseline_advantage": "verl/trainer/ppo/core_algos.py",
    "agg_loss": "verl/trainer/ppo/core_algos.py",
    "compute_policy_loss_sapo": "verl/trainer/ppo/core_algos.py",
    "compute_policy_loss_gpg": "verl/trainer/ppo/core_algos.py",
    "compute_policy_loss_geo_mean": "verl/trainer/ppo/core_algos.py",
    "compute_policy_loss_cispo": "verl/trainer/ppo/core_algos.py",
    "compute_pf_ppo_reweight_data": "verl/trainer/ppo/core_algos.py",
    "compute_variance_proxy_metrics": "verl/trainer/ppo/metric_utils.py",
    "_parse_rollout_rs_thresholds": "verl/trainer/ppo/rollout_corr_helper.py",
    "compute_rs_metrics": "verl/trainer/ppo/rollout_corr_helper.py",
    "compute_rollout_rejection_mask": "verl/trainer/ppo/rollout_corr_helper.py",
}
CONSTANTS: dict[str, str] = {
    "SAFETY_BOUND": "verl/trainer/ppo/rollout_corr_helper.py",
    "SUPPORTED_ROLLOUT_RS_OPTIONS": "verl/trainer/ppo/rollout_corr_helper.py",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS": "verl/trainer/ppo/rollout_corr_helper.py",
}


class DictConfig(dict):
    """Stand-in for omegaconf.DictConfig (only named in an annotation)."""


class AlgoConfig:
    """Stand-in for verl.trainer.config.AlgoConfig (only used in isinstance checks)."""


class ActorConfig:
    """Stand-in for verl.workers.config.ActorConfig: the fields the losses read, with
    verl's defaults, and an empty ``global_batch_info`` (local counts, one rank)."""

    def __init__(self, **fields: Any) -> None:
        self.clip_ratio = 0.2
        self.clip_ratio_low = 0.2
        self.clip_ratio_high = 0.2
        self.clip_ratio_c = 3.0
        self.tau_pos = 1.0
        self.tau_neg = 1.05
        self.global_batch_info: dict[str, Any] = {}
        self.__dict__.update(fields)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


class TensorDict(dict):
    """Stand-in for a TensorDict: a dict of tensors with a ``batch_size`` attribute."""

    batch_size: Any = None


class DataProto:
    """Stand-in for verl's DataProto: ``batch``, ``non_tensor_batch``, ``meta_info``."""

    def __init__(self, batch: dict, non_tensor_batch: dict, meta_info: dict | None = None):
        self.batch = TensorDict(batch)
        self.batch.batch_size = torch.Size([len(next(iter(batch.values())))])
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info or {}


def verl_wheel() -> Path | None:
    """The verl 0.9.1 wheel in `CACHE`, downloaded there if missing; None if it cannot
    be had."""
    found = sorted(CACHE.glob("verl-0.9.1-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                VERL,
                "-d",
                str(CACHE),
            ],
            capture_output=True,
            timeout=300,
            check=False,
        )
        found = sorted(CACHE.glob("verl-0.9.1-*.whl"))
    return found[0] if found else None


def _top_level_name(node: ast.stmt) -> str | None:
    """The name a module-level ``def`` or ``NAME = ...`` / ``NAME: T = ...`` binds."""
    if isinstance(node, ast.FunctionDef):
        return node.name
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        return target.id if isinstance(target, ast.Name) else None
    return None


def read_functions(wheel: Path) -> dict[str, str]:
    """Each function of `FILES` (its text from its ``def`` line to its end) and each
    constant of `CONSTANTS` (its assignment)."""
    wanted = {**CONSTANTS, **FILES}
    texts: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as archive:
        for path in sorted(set(wanted.values())):
            source = archive.read(path).decode()
            lines = source.splitlines()
            for node in ast.parse(source).body:
                name = _top_level_name(node)
                is_def = isinstance(node, ast.FunctionDef)
                if name is not None and wanted.get(name) == path and is_def == (name in FILES):
                    texts[name] = "\n".join(lines[node.lineno - 1 : node.end_lineno]) + "\n"
    missing = sorted(set(wanted) - set(texts))
    if missing:
        raise LookupError(f"{wheel.name} has no {missing} where FILES or CONSTANTS says")
    return texts


def load_verl() -> types.SimpleNamespace | None:
    """Execute every function of `FILES` into one namespace and return it (None without
    the wheel)."""
    wheel = verl_wheel()
    if wheel is None:
        return None
    sources = read_functions(wheel)
    namespace: dict[str, Any] = {
        "math": math,
        "torch": torch,
        "np": np,
        "defaultdict": defaultdict,
        "Any": Any,
        "Optional": Optional,
        "DictConfig": DictConfig,
        "AlgoConfig": AlgoConfig,
        "ActorConfig": ActorConfig,
        "DataProto": DataProto,
    }
    for name in ("masked_sum", "masked_mean"):
        exec(compile(sources[name], f"{FILES[name]}:{name}", "exec"), namespace)
    namespace["verl_F"] = types.SimpleNamespace(
        masked_sum=namespace["masked_sum"], masked_mean=namespace["masked_mean"]
    )
    for name in CONSTANTS:
        exec(compile(sources[name], f"{CONSTANTS[name]}:{name}", "exec"), namespace)
    for name, text in sources.items():
        if name in FILES and name not in ("masked_sum", "masked_mean"):
            exec(compile(text, f"{FILES[name]}:{name}", "exec"), namespace)
    return types.SimpleNamespace(**{name: namespace[name] for name in {**CONSTANTS, **FILES}})
