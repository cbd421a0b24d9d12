"""Remote columns of a Batch: columns whose rows stay where a worker stored them.

A step's wide columns (token ids, masks, log-probs: one value per token) are most of
its bytes. When a worker keeps them (`rayrl.controller.kept`), the Batch the driver
holds has them as *remote* columns: each names a `RowSource`, an object that knows
where its rows are and can pick rows or fetch them. Several columns usually share one
source (all the columns one call produced), and row operations act once per source,
so they stay shared.

The driver reorders, splits, pads and joins such a Batch as usual: each source only
records the rows picked. Sent to a worker, the sources travel as references and the
worker fetches the rows it is given from the workers that hold them; read on the
driver (`batch["responses"]`), a column is fetched there and becomes an ordinary one.
So code that reads a column still gets it, wherever it is, and code that only moves
rows never fetches anything.

This module is a leaf: it knows the protocol a source follows, not where rows live.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class RowSource(Protocol):
    """Rows of some columns stored elsewhere (see the module docstring)."""

    def __len__(self) -> int: ...

    def take(self, rows: torch.Tensor) -> RowSource:
        """The rows at positions `rows` (a 1-D int64 CPU tensor), in that order."""
        ...

    @staticmethod
    def concat(sources: list[RowSource]) -> RowSource:
        """The rows of `sources` one after another."""
        ...

    def fetch(self, keys: list[str]) -> dict[str, Any]:
        """Columns `keys` of these rows, fetched: key -> tensor or numpy array."""
        ...


Remote = dict[str, RowSource]


def per_source(remote: Remote, op: Callable[[RowSource], RowSource]) -> Remote:
    """`remote` with `op` applied once to each distinct source (columns that shared a
    source share its result)."""
    done: dict[int, RowSource] = {}
    out: Remote = {}
    for key, source in remote.items():
        if id(source) not in done:
            done[id(source)] = op(source)
        out[key] = done[id(source)]
    return out


def take_rows(remote: Remote, rows: torch.Tensor) -> Remote:
    """Every source's rows at positions `rows`."""
    return per_source(remote, lambda source: source.take(rows)) if remote else {}


def concat_remote(remotes: list[Remote]) -> Remote:
    """The remote columns of batches stacked row-wise (all have the same keys); columns
    that shared a source in every batch share the stacked one."""
    if not remotes or not remotes[0]:
        return {}
    out: Remote = {}
    done: dict[tuple[int, ...], RowSource] = {}
    for key in remotes[0]:
        parts = [remote[key] for remote in remotes]
        ident = tuple(id(p) for p in parts)
        if ident not in done:
            done[ident] = type(parts[0]).concat(parts)
        out[key] = done[ident]
    return out


def fetch_columns(remote: Remote, keys: list[str]) -> dict[str, Any]:
    """Columns `keys` of `remote` fetched, one fetch per source."""
    by_source: dict[int, list[str]] = {}
    sources: dict[int, RowSource] = {}
    for key in keys:
        source = remote[key]
        by_source.setdefault(id(source), []).append(key)
        sources[id(source)] = source
    fetched: dict[str, Any] = {}
    for ident, wanted in by_source.items():
        fetched.update(sources[ident].fetch(wanted))
    return fetched


def fetch_shared_remote(a: Any, b: Any) -> None:
    """Before a union of Batches `a` and `b`: a column both have and one holds remotely
    (from another source than the other's) is fetched on both sides, so that their
    values can be compared."""
    for key in set(a.keys()) & set(b.keys()):
        mine, theirs = a.remote.get(key), b.remote.get(key)
        if (mine is not None or theirs is not None) and mine is not theirs:
            a.materialize([key])
            b.materialize([key])
