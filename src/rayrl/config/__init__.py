"""Typed config: schema (dataclasses), YAML + dotted overrides, cross-field validation."""

from rayrl.config.errors import ConfigError
from rayrl.config.load import load_config, to_yaml
from rayrl.config.schema import RayRLConfig

__all__ = ["ConfigError", "RayRLConfig", "load_config", "to_yaml"]
