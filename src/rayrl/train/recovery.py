"""How `TrainEngine` comes back to a step boundary, and onto a re-formed process group.

`StepRecovery` is `TrainEngine`'s base for recovery (`rayrl.controller.recovery` drives
it through the workers' hooks):

* `snapshot()` / `restore()`: this rank's state at a step boundary, in host memory
  (`rayrl.train.snapshot`), and putting it back;
* `rebuild()`: the engine built again on the process group as it is after a
  replacement, from the shards this rank holds (`rayrl.train.rebuild`): nothing is
  read from storage;
* a replacement's engine (``join``) leaves its trainable weights to the restore; if
  they are needed before one, `_weights_needed` reads this rank's own shards then;
* `_release_groups()`: run in this process when one of its gloo collectives lost a
  peer (`rayrl.controller.collective_failure`): the model's FSDP2 states and the
  device meshes let go of the old process groups (`rayrl.train.group_release`), so
  that the ranks still waiting on this one fail at once instead of being replaced
  as hung; the shards stay for `rebuild`.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rayrl.controller.pending import Pending, settled
from rayrl.train import snapshot
from rayrl.train.group_release import release_groups
from rayrl.train.rebuild import Kept, keep

if TYPE_CHECKING:
    from rayrl.train.mesh import TrainMesh
    from rayrl.train.residency import Residency
    from rayrl.train.ulysses import SPGroup

__all__ = ["StepRecovery"]

log = logging.getLogger("rayrl.train")


class StepRecovery:
    """The recovery methods of `rayrl.train.engine.TrainEngine` (module docstring)."""

    _copy_stream: torch.cuda.Stream | None = None  # a snapshot's copies, on a GPU
    _snapshot_copies: torch.cuda.Event | None = None  # their end, until waited for

    # The engine's state, set by `TrainEngine.__init__` and `ModelBuilding`; `rebuild`
    # lets go of model, optimizer, schedule and residency (None) and builds them again.
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any  # torch's LR scheduler; None when not trainable
    residency: Residency | None
    trainable: bool
    device: torch.device
    mesh: TrainMesh | None
    sp: SPGroup | None
    model_path: str
    bytes_read: int
    skipped_steps: int
    optimizer_steps: int
    train_steps: int
    _args: dict[str, Any]  # the engine's arguments, which `rebuild` builds it from again
    _kept: Kept | None
    _pending: Callable[[], int] | None  # a new rank's deferred read of its own shards

    def snapshot(self, reuse: bool = False, wait: bool = True) -> dict[str, Any] | Pending:
        """This rank's state (its shard when sharded) in host memory: trainable weights,
        optimizer, LR schedule and counters (`rayrl.train.snapshot`, ``reuse`` there).

        ``wait=False`` (with ``reuse``), on a GPU whose engine keeps everything on the
        device: the copies run on a stream of their own behind the work queued so far,
        and this returns at once a `Pending` of the state, complete once they are done;
        the next optimizer step, restore or load waits for them on the device. Elsewhere
        it waits, as ``wait=True``."""
        self._weights_needed()
        optimizer = self.optimizer if self.trainable else None
        behind = not wait and reuse and self.device.type == "cuda"
        residency = self._residency()
        if not (behind and residency.on_device):
            with residency.resident():
                return snapshot.capture(
                    self.model, optimizer, self.scheduler, self._counters(), reuse
                )
        stream = self._snapshot_stream()
        state = snapshot.capture(
            self.model, optimizer, self.scheduler, self._counters(), reuse, stream
        )
        done = torch.cuda.Event()
        done.record(stream)
        self._snapshot_copies = done
        return Pending(state, done.synchronize)

    def _snapshot_stream(self) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    def _snapshot_copies_done(self) -> None:
        """Hold the device's next work (an optimizer step, a restore, a load: anything
        that changes the state) behind the snapshot's copies still in flight."""
        if self._snapshot_copies is not None:
            torch.cuda.current_stream(self.device).wait_event(self._snapshot_copies)
            self._snapshot_copies = None

    def snapshot_nbytes(self) -> int:
        """Bytes a `snapshot()` of this rank holds (`rayrl.train.snapshot.nbytes`)."""
        return snapshot.nbytes(self.model, self.optimizer if self.trainable else None)

    def restore(self, state: dict[str, Any] | Pending) -> None:
        """Put back a `snapshot()` of this rank (taken in this process or another)."""
        values: dict[str, Any] = settled(state)
        self._snapshot_copies_done()
        names = {name for name, _ in self.model.named_parameters()}
        if not names <= set(values["params"]):  # frozen weights: this rank's own first
            self._weights_needed()
        optimizer = self.optimizer if self.trainable else None
        with self._residency().resident():
            self._set_counters(snapshot.restore(self.model, optimizer, self.scheduler, values))
        self._pending = None

    def rebuild(self) -> None:
        """Device mesh, FSDP wrapping and optimizer built again on the process group as
        it is now (re-formed after a replacement), filled from the shards this rank
        holds: weights, Adam moments, LR schedule and counters stay as they were and
        nothing is read from storage (`rayrl.train.rebuild`; where the layout changed,
        every rank reloads, as at a start). A rank whose weights never came (a
        replacement awaiting its restore) stays so. Every rank rebuilds together."""
        if self._pending is None and self._kept is None:  # kept until a rebuild succeeds
            optimizer = self.optimizer if self.trainable else None
            self._kept = keep(self.model, optimizer, self.scheduler, self._counters())
        self.model = self.optimizer = self.scheduler = self.residency = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        type(self).__init__(self, **{**self._args, "join": True})
        self._kept = None

    def _residency(self) -> Residency:
        if self.residency is None:
            raise RuntimeError(
                f"{self.model_path}: the engine's last rebuild() did not finish; rebuild() again"
            )
        return self.residency

    def _release_groups(self) -> None:
        """Drop this engine's references to the process groups (module docstring): the
        engine serves `rebuild` only until then."""
        meshes = [self.mesh.fsdp] if self.mesh is not None else []
        if self.mesh is not None:
            self.mesh.sp_group = None
        if self.sp is not None:  # frozen: the attention modules share this object
            object.__setattr__(self.sp, "group", None)
        cleared = release_groups(getattr(self, "model", None), meshes)
        log.info(
            "%s: released the process groups its model held (%d references)",
            self.model_path,
            cleared,
        )

    def _weights_needed(self) -> None:
        """A new rank's weights (``join``), needed before any restore put them back: its
        own shards, read from the model directory now (no collective)."""
        if self._pending is None:
            return
        read, self._pending = self._pending, None
        nbytes = read()
        self.bytes_read += nbytes
        log.info(
            "%s: weights needed before a restore; read this rank's shards (%d bytes)",
            self.model_path,
            nbytes,
        )

    _COUNTERS = ("skipped_steps", "optimizer_steps", "train_steps")

    def _counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self._COUNTERS}

    def _set_counters(self, values: dict[str, Any]) -> None:
        for name in self._COUNTERS:
            setattr(self, name, int(values[name]))
