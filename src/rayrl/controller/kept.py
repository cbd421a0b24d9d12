"""Rows kept by workers: a call's wide columns stay in the object store of the worker
that computed them, and the driver holds only references to them.

A call made with `GroupMethod.keeping()` returns its Batch (or the Batch inside a
dataclass result, such as a stage's result with its timing) with the columns of more
than one value per row (token ids, masks, log-probs) put in the worker's object store
(`keep_wide_columns`); the Batch that reaches the driver holds them as remote columns
whose source is a `KeptRows` (`rayrl.batch_remote`). The driver reorders, splits and
joins such Batches without fetching anything: a `KeptRows` records the rows picked,
as pieces (an object reference, the rows of it; the references in a `Directory`
that travels once per step). A call that gets such a Batch as an
argument fetches the rows it was given straight from the workers that hold them
(`resolve_arguments`, run before every registered method), so the bytes go worker to
worker; only a column read on the driver is fetched there (counted by
`rayrl.controller.traffic`).

Rows kept by a worker live as long as the driver holds a reference to them, and go
with the worker: a worker replaced after a failure takes its rows with it, and the
call that made them must run again (`rayrl.trainer.stage_calls`).
"""

from __future__ import annotations

import dataclasses
from itertools import chain
from typing import Any, cast

import numpy as np
import ray
from ray import ObjectRef

from rayrl.controller import traffic
from rayrl.controller.dispatch import is_batch

# The keyword a kept call passes to the worker (taken off before the method runs)
KEEP_KWARG = "__rayrl_keep_rows__"


def _compact(rows: np.ndarray) -> range | np.ndarray:
    """A contiguous ascending run as a `range` (three numbers pickled), else int32."""
    if len(rows) and bool((np.diff(rows) == 1).all()):
        return range(int(rows[0]), int(rows[0]) + len(rows))
    return rows.astype(np.int32)


class Directory:
    """The object references a step's pieces point into, shared by every `KeptRows`
    made from the same results. Sent from the driver, it travels as one reference of
    its own (put once, at its first send): a call's ranks each get that one reference,
    not one per worker that holds rows, so the references the driver sends per call
    grow with the ranks called, not with their square."""

    __slots__ = ("_refs", "_ref")

    def __init__(self, refs: tuple[Any, ...] | None = None, ref: ObjectRef | None = None) -> None:
        self._refs, self._ref = refs, ref

    @property
    def refs(self) -> tuple[Any, ...]:
        if self._refs is None:
            self._refs = ray.get(self._ref)
        return self._refs

    def __reduce__(self) -> tuple[Any, ...]:
        if self._refs is not None and len(self._refs) > 1 and _on_driver():
            if self._ref is None:
                traffic.count_sent("directory", [self._refs])
                self._ref = ray.put(self._refs)
            return Directory, (None, self._ref)
        return Directory, (self._refs, self._ref)


class KeptRows:
    """Rows of some columns kept in workers' object stores: pieces of (index of a
    reference in `directory`, whose object is a Batch of those columns; the rows of
    it taken), in row order."""

    __slots__ = ("directory", "pieces")

    def __init__(self, directory: Directory, pieces: tuple[tuple[int, Any], ...]) -> None:
        self.directory, self.pieces = directory, pieces

    def __len__(self) -> int:
        return sum(len(rows) for _, rows in self.pieces)

    def __repr__(self) -> str:
        return f"KeptRows({len(self)} rows in {len(self.pieces)} pieces)"

    def __reduce__(self) -> tuple[Any, ...]:
        return KeptRows, (self.directory, self.pieces)

    def take(self, rows: Any) -> KeptRows:
        """The rows at positions `rows` (a 1-D integer tensor or array), in that order;
        a run of rows from one piece stays one piece."""
        wanted = rows.numpy() if hasattr(rows, "numpy") else np.asarray(rows)
        if not len(wanted):
            return KeptRows(self.directory, ())
        sizes = np.array([len(r) for _, r in self.pieces])
        ends = np.cumsum(sizes)
        which = np.searchsorted(ends, wanted, side="right")
        starts = ends - sizes
        cuts = np.flatnonzero(np.diff(which)) + 1
        pieces = []
        for run in np.split(np.arange(len(wanted)), cuts):
            piece = int(which[run[0]])
            index, own = self.pieces[piece]
            local = wanted[run] - starts[piece]
            picked = np.asarray(own)[local] if not isinstance(own, range) else own.start + local
            pieces.append((index, _compact(np.asarray(picked, dtype=np.int64))))
        return KeptRows(self.directory, tuple(pieces))

    @staticmethod
    def concat(sources: list[KeptRows]) -> KeptRows:
        """The rows of `sources` one after another, over one directory of them all."""
        directories = list({id(s.directory): s.directory for s in sources}.values())
        if len(directories) == 1:
            return KeptRows(directories[0], tuple(chain.from_iterable(s.pieces for s in sources)))
        refs = list(dict.fromkeys(chain.from_iterable(d.refs for d in directories)))
        position = {ref: i for i, ref in enumerate(refs)}
        pieces = tuple(
            (position[s.directory.refs[index]], rows) for s in sources for index, rows in s.pieces
        )
        return KeptRows(Directory(tuple(refs)), pieces)

    def _indices(self) -> list[int]:
        """The directory indices these rows are read from, each once, in order."""
        return list(dict.fromkeys(index for index, _ in self.pieces))

    def refs(self) -> list[ObjectRef]:
        """The references these rows are read from."""
        every = self.directory.refs
        return [every[i] for i in self._indices()]

    def fetch(self, keys: list[str]) -> dict[str, Any]:
        """Columns `keys` of these rows, fetched from the object store (counted as the
        driver's when it runs on the driver)."""
        from rayrl.batch import Batch

        stored = dict(zip(self._indices(), ray.get(self.refs()), strict=True))
        if _on_driver():
            traffic.count_received("fetch:" + ",".join(keys), list(stored.values()))
        parts = [_rows_of(stored[index].select(*keys), rows) for index, rows in self.pieces]
        if not parts:
            return {}
        merged = Batch.concat(parts)
        return {key: merged[key] for key in keys}


def _rows_of(batch: Any, rows: Any) -> Any:
    if isinstance(rows, range) and rows.step == 1:
        return batch[rows.start : rows.stop]
    return batch.index(np.asarray(rows, dtype=np.int64))


def _on_driver() -> bool:
    return cast(bool, ray.get_runtime_context().worker.mode == ray.SCRIPT_MODE)


def keep_batch(batch: Any, driver: tuple[str, ...] | None = None) -> Any:
    """`batch` with some columns put in this process's object store, held as remote
    columns of one `KeptRows` source: those not named in `driver` (the columns the
    driver reads), or without it those of more than one value per row."""
    if driver is None:
        wide = [key for key, t in batch.tensors.items() if t.dim() >= 2]
    else:
        wide = [key for key in (*batch.tensors, *batch.non_tensors) if key not in driver]
    if not wide:
        return batch
    ref = ray.put(batch.select(*wide))
    source = KeptRows(Directory((ref,)), ((0, range(len(batch))),))
    light = batch.select(*[k for k in (*batch.tensors, *batch.non_tensors) if k not in wide])
    light.remote.update(dict.fromkeys(wide, source))
    return light


def keep_wide_columns(result: Any, keep: Any = True) -> Any:
    """A kept call's result: a Batch kept (`keep_batch`; `keep` True, or the names of
    the columns the driver reads), or a dataclass whose Batch fields are kept; anything
    else as it is."""
    driver = None if keep is True else tuple(keep)
    if is_batch(result):
        return keep_batch(result, driver)
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        changes = {
            f.name: keep_batch(getattr(result, f.name), driver)
            for f in dataclasses.fields(result)
            if is_batch(getattr(result, f.name))
        }
        return dataclasses.replace(result, **changes) if changes else result
    return result


def resolve_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Fetch, in place, the remote columns of the Batch arguments of a call: the rows
    the worker was given, from the workers that keep them (every object pulled side by
    side first, then read locally)."""
    batches = [v for v in chain(args, kwargs.values()) if is_batch(v) and v.remote]
    sources = {id(s): s for b in batches for s in b.remote.values() if isinstance(s, KeptRows)}
    refs = list(dict.fromkeys(ref for s in sources.values() for ref in s.refs()))
    if refs:
        ray.wait(refs, num_returns=len(refs), fetch_local=True)
    for batch in batches:
        batch.materialize()
