"""Null values given to config keys that cannot be null.

A launch script's ``key=${VAR}`` with ``VAR`` unset passes ``key=``: a null. verl's
loader takes it, and its code then reads a null switch as false (``if
config.use_kl_loss:``); one of verl 0.9.1's own multi-turn examples does exactly this
(examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.sh). So here, for
`rayrl train` and `rayrl sft` alike, a null on a yes/no key is read as false, with a
warning naming it; a null on any other key that cannot be null is an error that names
the key and the likely cause, where OmegaConf's own message would only say
``Incompatible value 'None'``.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable
from typing import Any

from rayrl.config.errors import ConfigError
from rayrl.config.schema import schema_fields

__all__ = ["settle_nulls"]


def settle_nulls(
    data: dict[str, Any], cls: type, origin: str, warn: Callable[[str], None], prefix: str = ""
) -> None:
    """Read nulls on the yes/no keys of ``data`` (a nested dict of schema ``cls``'s
    keys, checked already) as false, in place; raise ConfigError for a null on any
    other key that cannot be null."""
    fields, hints = schema_fields(cls), _hints(cls)
    for key, value in data.items():
        path = f"{prefix}{key}"
        if fields[key] is not None and isinstance(value, dict):
            settle_nulls(value, fields[key], origin, warn, path + ".")
        elif value is None and not _nullable(hints[key]):
            if hints[key] is bool:
                data[key] = False
                warn(
                    f"{path} is given no value (in {origin}; an unset shell variable?): "
                    "read as false, as verl reads it"
                )
                continue
            raise ConfigError(
                f"config key '{path}' is given no value (in {origin}); it takes "
                f"{_name(hints[key])}. Is it set from a shell variable that is not set?"
            )


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _nullable(hint: Any) -> bool:
    if hint is Any or hint is type(None):
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return type(None) in typing.get_args(hint)
    return False


_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _name(hint: Any) -> str:
    return _NAMES.get(hint) or f"value of type {getattr(hint, '__name__', None) or hint}"
