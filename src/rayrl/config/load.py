"""Load a config: built-in defaults, then a YAML file, then dotted overrides.

`load_config("grpo.yaml", ["actor_rollout_ref.actor.optim.lr=1e-6"])` returns a typed
`RayRLConfig`. With no file the defaults are verl's (`rayrl.config.schema`). From Python
the source may also be a config already loaded, and the overrides a mapping of dotted
keys to values (`load_config(cfg, {"actor_rollout_ref.actor.optim.lr": 1e-6})`). Unknown
keys are errors that name the key and the closest valid one; verl's other spellings of
a key move to it, and verl keys rayrl accepts without acting on them are dropped with
a one-line warning each (`rayrl.config.compat`); a value that does not parse names its
key;
wrong types name the key and the expected type; file lists and the logger accept a
string or a list; cross-field rules run last (`rayrl.config.validate`).
"""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rayrl.config.compat import (
    apply_rules,
    map_bool_frequencies,
    map_rollout_name,
    resolve_global_micro_batches,
    rule_table,
)
from rayrl.config.compat.verl_ppo import RULES
from rayrl.config.errors import ConfigError
from rayrl.config.errors import warn as _warn
from rayrl.config.nulls import settle_nulls
from rayrl.config.paths import absolute_paths
from rayrl.config.schema import RayRLConfig, schema_fields

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# the config dataclass a `load_structured` call builds
Schema = TypeVar("Schema", bound="DataclassInstance")

BUILTIN_DIR = Path(__file__).resolve().parent
PARSE_ERRORS = (yaml.YAMLError, OmegaConfBaseException, ValueError)


def builtin_configs(builtin_dir: Path = BUILTIN_DIR) -> list[str]:
    """Names of the YAML files shipped with rayrl (usable as `-c NAME`)."""
    return sorted(p.stem for p in builtin_dir.glob("*.yaml"))


def resolve_source(source: str | os.PathLike[str], builtin_dir: Path = BUILTIN_DIR) -> Path:
    """A config argument is a file path or the name of a built-in config."""
    path = Path(source)
    if path.is_file():
        return path
    builtin = builtin_dir / f"{Path(source).stem}.yaml"
    if path.suffix in ("", ".yaml", ".yml") and builtin.is_file() and path.parent == Path("."):
        return builtin
    raise ConfigError(
        f"config file '{source}' not found; give a path to a YAML file or one of the "
        f"built-in configs: {', '.join(builtin_configs(builtin_dir))}"
    )


def all_paths(cls: type = RayRLConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, leaves and groups."""
    out: list[str] = []
    for name, sub in schema_fields(cls).items():
        path = f"{prefix}{name}"
        out.append(path)
        if sub is not None:
            out.extend(all_paths(sub, path + "."))
    return out


def suggest(path: str, cls: type = RayRLConfig) -> str | None:
    """The valid key of schema `cls` closest to a misspelt or misplaced dotted key (a
    few keys, "'a' or 'b'", when several end with it)."""
    paths = all_paths(cls)
    leaf = path.split(".")[-1]
    by_suffix = [p for p in paths if p.endswith("." + path)]
    if len(by_suffix) == 1:
        return by_suffix[0]
    by_suffix = by_suffix or [p for p in paths if p.split(".")[-1] == leaf]
    if len(by_suffix) == 1:
        return by_suffix[0]
    if 1 < len(by_suffix) <= 3:
        return "' or '".join(sorted(by_suffix, key=lambda p: (p.count("."), p)))
    close = difflib.get_close_matches(path, paths, n=1, cutoff=0.6)
    if close:
        return close[0]
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    siblings = [p for p in paths if p.rsplit(".", 1)[0] == parent] if parent else paths
    leaves = {p.split(".")[-1]: p for p in siblings}
    close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.5)
    return leaves[close[0]] if close else (by_suffix[0] if by_suffix else None)


def _first_leaf(path: str, value: Any) -> str:
    while isinstance(value, dict) and len(value) == 1:
        key, value = next(iter(value.items()))
        path = f"{path}.{key}"
    return path


def check_keys(
    data: dict[str, Any],
    cls: type = RayRLConfig,
    prefix: str = "",
    origin: str = "",
    root: type | None = None,
) -> None:
    """Raise ConfigError for the first key of `data` that the schema does not have
    (`root`: the whole schema, for suggestions; default `cls`)."""
    root = root or cls
    fields = schema_fields(cls)
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            hint = suggest(_first_leaf(path, value), root)
            where = f" (in {origin})" if origin else ""
            did = f"; did you mean '{hint}'?" if hint else ""
            raise ConfigError(f"unknown config key '{path}'{where}{did}")
        sub = fields[key]
        if sub is not None:
            if not isinstance(value, dict):
                raise ConfigError(
                    f"config key '{path}' is a group (keys: {', '.join(schema_fields(sub))}); "
                    f"got the value {value!r}"
                )
            check_keys(value, sub, path + ".", origin, root)


def _merge(base: Any, data: dict[str, Any], origin: str) -> Any:
    try:
        return OmegaConf.merge(base, data)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        reason = str(exc.msg).splitlines()[0]
        raise ConfigError(f"bad value for config key '{key}' (in {origin}): {reason}") from None


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Dotted `key=value` overrides to a nested dict; values are parsed as YAML. A value
    that does not parse is a ConfigError naming the key and the text."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override '{bad[0]}' is not of the form key=value (e.g. trainer.seed=3)")
    # Hydra's `+key=value` / `++key=value` (add or force a key, as verl scripts write
    # them) set the key like `key=value`: every key here is in the schema.
    plain = [o.lstrip("+") for o in overrides]
    try:
        nested: dict[str, Any] = OmegaConf.to_container(OmegaConf.from_dotlist(plain))
        return nested
    except PARSE_ERRORS:
        pass
    for override in plain:  # which one does not parse
        try:
            OmegaConf.from_dotlist([override])
        except PARSE_ERRORS as exc:
            key, text = override.split("=", 1)
            reason = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
            raise ConfigError(
                f"cannot parse the value of config key '{key}': {text!r} ({reason}); values "
                "are YAML: quote strings with special characters, close [lists] and {maps}"
            ) from None
    raise AssertionError("the overrides parse one by one but not together")


def nest_values(values: Mapping[str, object]) -> dict[str, Any]:
    """Dotted keys with Python values (`{"trainer.seed": 3}`) as a nested dict; paths
    become strings and tuples lists. A key that is also the group of another is a
    ConfigError naming both."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        *groups, leaf = key.split(".")
        node = out
        for i, group in enumerate(groups):
            node = node.setdefault(group, {})
            if not isinstance(node, dict):
                raise ConfigError(f"'{'.'.join(groups[: i + 1])}' is set and '{key}' too")
        if isinstance(node.get(leaf), dict):
            raise ConfigError(f"'{key}' is set and keys under it too")
        node[leaf] = _plain_value(value)
    return out


def _plain_value(value: object) -> object:
    """A Python value as OmegaConf takes it: paths as strings, tuples as lists."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple | list):
        return [_plain_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain_value(v) for k, v in value.items()}
    return value


def load_yaml(path: Path) -> dict[str, Any]:
    """A YAML config file as a nested dict; a file that does not parse is a ConfigError
    naming the file and the place."""
    try:
        data = OmegaConf.to_container(OmegaConf.load(path)) or {}
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(f"{path} is not a valid YAML config: {reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a config file holds a mapping of groups, got {type(data).__name__}"
        )
    return data


_TABLE = rule_table(RULES, RayRLConfig)
REWARD_MODEL_MICRO_BATCH = 8  # sequences per reward-model forward when none is given


def source_data(data: dict[str, Any], origin: str, warn: Callable[[str], None]) -> dict[str, Any]:
    """What `load_config` does with one source's nested dict before merging it: verl
    compatibility (`rayrl.config.compat`: rollout names, moved keys, keys
    without effect, refused features), then known keys only, and nulls where a key
    cannot be null (`rayrl.config.nulls`)."""
    try:
        data = apply_rules(data, _TABLE, warn)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in {origin})") from None
    for message in map_rollout_name(data):
        warn(message)
    map_bool_frequencies(data)
    check_keys(data, origin=origin)
    settle_nulls(data, RayRLConfig, origin, warn)
    return data


@functools.cache
def _structured(schema: type) -> Any:
    """The schema's defaults as an OmegaConf config, built once (0.4 s on a loaded
    2-core machine); merges copy it, never change it."""
    return OmegaConf.structured(schema)


def load_structured(
    schema: type[Schema],
    source: str | os.PathLike[str] | object | None,
    overrides: Sequence[str] | Mapping[str, object],
    user_data: Callable[[dict[str, Any], str], dict[str, Any]],
    builtin_dir: Path = BUILTIN_DIR,
) -> Schema:
    """An instance of the dataclass `schema`: its defaults <- YAML file (a path or a
    built-in name in `builtin_dir`), or an instance already loaded <- dotted overrides
    (`key=value` texts, or a mapping of dotted keys to values). `user_data(data,
    origin)` checks (and may rewrite) each source's nested dict before it is merged."""
    merged = _structured(schema)
    if isinstance(source, schema):
        merged = OmegaConf.structured(source)
    elif source is not None:
        if not isinstance(source, str | os.PathLike):
            raise TypeError(
                f"config source should be a path, a built-in config name or a "
                f"{schema.__name__}, not {type(source).__name__}"
            )
        path = resolve_source(source, builtin_dir)
        data = load_yaml(path)
        merged = _merge(merged, user_data(data, str(path)), str(path))
    if overrides:
        if isinstance(overrides, Mapping):
            origin, data = "keyword arguments", nest_values(overrides)
        else:
            origin, data = "command-line overrides", parse_overrides(overrides)
        merged = _merge(merged, user_data(data, origin), origin)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"bad value for config key '{key}': {exc.msg.splitlines()[0]}") from None
    assert is_dataclass(cfg)
    return cast(Schema, cfg)


def load_config(
    source: str | os.PathLike[str] | RayRLConfig | None = None,
    overrides: Sequence[str] | Mapping[str, object] = (),
    *,
    validate: bool = True,
    warn: Callable[[str], None] = _warn,
) -> RayRLConfig:
    """Defaults <- YAML file (a path or a built-in name), or a config already loaded <-
    dotted overrides (texts or a mapping: `load_structured`), then validated.

    ``warn`` receives one line per verl key or setting that has no effect in rayrl
    (default: a `ConfigWarning`).
    """
    cfg = load_structured(
        RayRLConfig, source, overrides, lambda data, origin: source_data(data, origin, warn)
    )
    normalize(cfg, warn)
    if validate:
        from rayrl.config.validate import validate_config

        validate_config(cfg, warn)
    absolute_paths(cfg)  # the driver's paths, whatever directory a worker runs in
    return cfg


def as_str_list(value: Any, key: str) -> list[str]:
    """A string or a list of strings as a list (verl writes file lists either way)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(v, str) for v in items):
        raise ConfigError(f"{key} must be a string or a list of strings; got {value!r}")
    return list(items)


def _dynamic(cfg: RayRLConfig, key: str) -> bool:
    """Whether the role of a deprecated micro-batch key sizes its micro-batches by tokens."""
    arr = cfg.actor_rollout_ref
    return {
        "actor_rollout_ref.actor": arr.actor.use_dynamic_bsz,
        "actor_rollout_ref.rollout": arr.rollout.log_prob_use_dynamic_bsz,
        "actor_rollout_ref.ref": arr.ref.log_prob_use_dynamic_bsz,
        "critic": cfg.critic.use_dynamic_bsz,
    }.get(key.rsplit(".", 1)[0], False)


def normalize(cfg: RayRLConfig, warn: Callable[[str], None] = _warn) -> None:
    """Give the keys that accept several forms their one typed form (verl's deprecated
    global micro-batch sizes become per-GPU ones, with a note)."""
    resolve_global_micro_batches(cfg, cfg.world_size, warn, lambda key: _dynamic(cfg, key))
    rm = cfg.reward_model
    if rm.micro_batch_size_per_gpu is None:  # verl 0.9.1's reward model has no such key
        rm.micro_batch_size_per_gpu = REWARD_MODEL_MICRO_BATCH
    cfg.data.train_files = as_str_list(cfg.data.train_files, "data.train_files")
    cfg.data.val_files = as_str_list(cfg.data.val_files, "data.val_files")
    cfg.trainer.logger = as_str_list(cfg.trainer.logger, "trainer.logger")
    modules = cfg.actor_rollout_ref.model.target_modules
    if not isinstance(modules, str):
        cfg.actor_rollout_ref.model.target_modules = as_str_list(
            modules, "actor_rollout_ref.model.target_modules"
        )


def to_yaml(cfg: object) -> str:
    """The resolved config (a RayRLConfig or an SFTConfig) as YAML (`rayrl config show`)."""
    text: str = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    return text
