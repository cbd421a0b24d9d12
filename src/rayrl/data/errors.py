"""The errors of the data layer: a dataset the run cannot train on."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset the run cannot train on; the message gives the numbers."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data file named in the config does not exist."""
