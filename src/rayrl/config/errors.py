"""What loading a config can raise or warn: the error a user acts on, the warning for a
verl key that rayrl accepts without acting on it."""

from __future__ import annotations

import warnings


class ConfigError(ValueError):
    """A config that cannot run: the message says which key and what to do."""


class ConfigWarning(UserWarning):
    """A config key accepted for verl compatibility that has no effect in rayrl."""


def warn(message: str) -> None:
    """Issue `message` as a ConfigWarning attributed to the caller's caller."""
    warnings.warn(message, ConfigWarning, stacklevel=3)
