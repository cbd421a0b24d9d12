"""The error a tool or environment named in a config raises when it cannot be loaded."""

from rayrl.usercode import UserCodeError


class LoadError(UserCodeError):
    """A class, function or tool named in a config could not be loaded."""
