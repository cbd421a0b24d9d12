"""verl compatibility: verl's keys and values that are not rayrl's own spelling.

verl command lines and configs carry keys for features rayrl does not have (vLLM
tensor parallelism, profilers, Megatron, ...), older and newer
names of one setting (verl 0.9.1's `reward.*` section beside `reward_model.*` and
`custom_reward_function`, `trainer.default_local_dir`, `optim.warmup_style`, ...), and
deprecated global micro-batch sizes. `apply_rules` maps each source (a YAML file, the
command line) onto rayrl's schema before it is checked and merged: moved keys land on
their schema key, keys without effect are dropped with one warning each saying why,
and values that ask for a feature rayrl lacks are refused with a `ConfigError` naming
it. The tables: `verl_ppo.RULES` (`rayrl train`) and `verl_sft.RULES` (`rayrl sft`).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from rayrl.config.compat.micro_batch import GLOBAL_MICRO_BATCH, resolve_global_micro_batches
from rayrl.config.compat.rules import Inert, Moved, Only, Rule, RuleTable, apply_rules
from rayrl.config.compat.values import (
    ROLLOUT_ALIASES,
    ROLLOUT_KEY,
    map_bool_frequencies,
    map_rollout_name,
)

__all__ = [
    "GLOBAL_MICRO_BATCH",
    "ROLLOUT_ALIASES",
    "ROLLOUT_KEY",
    "Inert",
    "Moved",
    "Only",
    "Rule",
    "RuleTable",
    "apply_rules",
    "map_bool_frequencies",
    "map_rollout_name",
    "resolve_global_micro_batches",
    "rule_table",
]


def _schema_paths(cls: type, prefix: str = "") -> tuple[list[str], list[str]]:
    """(every dotted key of the dataclass schema `cls`, the dict-valued leaves among them)."""
    paths: list[str] = []
    dict_leaves: list[str] = []
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        path = f"{prefix}{f.name}"
        paths.append(path)
        if is_dataclass(default):
            sub, sub_dicts = _schema_paths(type(default), path + ".")
            paths += sub
            dict_leaves += sub_dicts
        elif isinstance(default, dict):
            dict_leaves.append(path)
    return paths, dict_leaves


def rule_table(rules: dict[str, Rule], schema: type) -> RuleTable:
    """The rules `rules` over the dataclass schema `schema`."""
    paths, dict_leaves = _schema_paths(schema)
    return RuleTable(rules, paths, dict_leaves)


def schema_paths(schema: type) -> list[str]:
    """Every dotted key of a dataclass schema, groups included."""
    return _schema_paths(schema)[0]
