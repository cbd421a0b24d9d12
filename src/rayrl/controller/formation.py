"""Bringing a GroupCore to full strength: the one path for init, retries and losses.

`bring_up(group, lost)` serves the first init (nothing lost), an init retry (the ranks
whose init failed), a replacement (dead or hung ranks) and the loss of a node (all of
its ranks), in four steps:

1. settle: the lost ranks are killed (a hung one too), then the surviving ranks still
   inside a call get `group.abort_grace_s` to end it (a collective whose peer is gone
   fails fast on gloo); those still busy after that, or silent, are killed and lost
   too, so no call outlives a failure by more than the grace (their state is restored
   with the others', from the step-start snapshot);
2. respawn: each lost rank gets a new actor, in its own bundle while that is usable,
   else in a spare bundle of the pool (`placement`);
3. join: with a backend, every rank joins the torch.distributed group of the next
   generation through KV discovery; collectives then run under `group.pg_timeout_s`;
4. build: new workers run `init_worker` (`joining` when survivors kept their state:
   they run the survivors' collectives and may leave their state to the restore);
   survivors whose engines were built on an older generation run their `rebuild`
   hook (device mesh, FSDP wrapping, communicators, on the state they hold).

What every rank read from storage while it was built or rebuilt comes back in each
`Replacement` (`bytes_read`, `ranks_reloading`).

A step that fails makes its ranks the lost ones of the next attempt, `retries` times.
State is not restored here: `rayrl.controller.recovery` does that.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

from rayrl.controller.errors import DEAD_ERRORS, WorkerInitError, short_error
from rayrl.controller.group_core import GroupCore
from rayrl.controller.health import Replacement, TopologyChangedWarning
from rayrl.controller.placement import bundle_usable, pick_bundle, topology_message
from rayrl.controller.waiting import wait_all

if TYPE_CHECKING:
    from rayrl.controller.errors import WorkerDescription

logger = logging.getLogger("rayrl.controller")


def bring_up(
    group: GroupCore, lost: set[int], timeout_s: float, retries: int, stage: str
) -> list[Replacement]:
    """Settle, respawn `lost`, join, build (see the module docstring); returns what
    was replaced. Raises WorkerInitError after `retries` failed attempts."""
    lost = set(lost)
    old = {r: group.describe(r) for r in lost}
    spare: dict[int, bool] = {}
    read: dict[int, int] = {}
    with group.replacing(lost) as replacing:
        attempt = 0
        while True:
            failures: dict[int, Any] = {}
            if lost:
                for rank in lost:  # first: a survivor's collective with it then fails fast
                    group._kill(rank)
                lost |= settle(group, lost)
                replacing(lost)
                old.update({r: group.describe(r) for r in lost if r not in old})
                failures = respawn(group, sorted(lost), timeout_s, spare)
            if not failures and group.forms_process_group:
                failures = join(group)
            if not failures:
                failures = build(group, timeout_s, read)
            if not failures:
                break
            if attempt >= retries:
                group._raise(WorkerInitError, stage, failures, timeout_s, attempts=attempt + 1)
            attempt += 1
            for rank, err in sorted(failures.items()):
                logger.warning(
                    "%s of %s rank %d failed (attempt %d of %d), bringing it up again: %s",
                    stage,
                    group.name,
                    rank,
                    attempt,
                    retries + 1,
                    short_error(err),
                )
            dead = {r for r, e in failures.items() if isinstance(e, DEAD_ERRORS)}
            lost = dead or set(failures)
    group.dead.difference_update(old)
    if not group.forms_process_group:  # with one, joining told every rank its context
        _tell_survivors(group, old)
    return _report(group, old, spare, read)


def _tell_survivors(group: GroupCore, old: dict[int, WorkerDescription]) -> None:
    """When a rank moved node, the others' local ranks changed: send their contexts."""
    if all(group.describe(r).node_id == old[r].node_id for r in old):
        return
    pending = {
        r: group.actors[r]._rayrl_set_context.remote(group._context(r))
        for r in range(group.world_size)
        if r not in old
    }
    wait_all(pending, group.dist_timeout_s)


def settle(group: GroupCore, lost: set[int]) -> set[int]:
    """Survivors still busy (or silent) `abort_grace_s` after the loss; they are lost too."""
    survivors = [r for r in range(group.world_size) if r not in lost]
    missing = {r for r in survivors if group.actors[r] is None}
    survivors = [r for r in survivors if r not in missing]
    deadline = time.monotonic() + group.abort_grace_s
    while survivors:
        pending = {r: group.actors[r].heartbeat.remote() for r in survivors}
        beats, failures = wait_all(pending, max(1.0, min(10.0, deadline - time.monotonic())))
        stuck = {r for r in survivors if r in failures or beats[r]["busy"]}
        if not stuck or time.monotonic() >= deadline:
            for r in sorted(stuck):
                what = short_error(failures[r]) if r in failures else f"still in {beats[r]['busy']}"
                logger.warning(
                    "%s rank %d: %s %.0f s after ranks %s were lost: killed, to be restored "
                    "with them",
                    group.name,
                    r,
                    what,
                    group.abort_grace_s,
                    sorted(lost),
                )
            return missing | stuck
        survivors = sorted(stuck)
        time.sleep(0.1)
    return missing


def respawn(
    group: GroupCore, ranks: list[int], timeout_s: float, spare: dict[int, bool]
) -> dict[int, BaseException]:
    """Kill and start `ranks` again (own bundle, else a spare) and set them up; returns
    the failures. A rank whose bundle became unusable while it started moves once."""
    for rank in ranks:
        spare[rank] = pick_bundle(group, rank) or spare.get(rank, False)
        group._kill(rank)
        group.built[rank] = None
    failures = group._collect_setup({r: group._spawn(r) for r in ranks}, timeout_s)
    late = [r for r in failures if not bundle_usable(group.bundles[r])]
    if late:
        for rank in late:
            spare[rank] = pick_bundle(group, rank) or spare[rank]
            group._kill(rank)
        failures = {r: e for r, e in failures.items() if r not in late}
        failures.update(group._collect_setup({r: group._spawn(r) for r in late}, timeout_s))
    return failures


def join(group: GroupCore) -> dict[int, BaseException]:
    """Every rank joins the next generation's process group; returns the failures."""
    if group.formed:
        group.generation += 1
    group.formed = True
    timeout = group.dist_timeout_s
    pending = {
        r: group.actors[r]._rayrl_join.remote(
            group._context(r), group.backend, timeout, group.pg_timeout_s
        )
        for r in range(group.world_size)
    }
    results, failures = wait_all(pending, timeout + 10.0)
    for rank, info in results.items():
        group.infos[rank] = info
    if not failures:
        group._drop_discovery_keys(keep=f"{group.scope}/gen{group.generation}/")
    return failures


def build(
    group: GroupCore, timeout_s: float, read: dict[int, int] | None = None
) -> dict[int, BaseException]:
    """init_worker on ranks never built (joining the survivors when some rank was built
    and kept its state); rebuild on ranks built on an older generation. Adds what each
    rank read from storage to `read`; returns the failures."""
    current = group.generation if group.forms_process_group else 0
    joining = any(b is not None for b in group.built)
    pending = {}
    for rank in range(group.world_size):
        actor, built = group.actors[rank], group.built[rank]
        if built is None:
            pending[rank] = actor._rayrl_init.remote(group._init_kwargs or {}, joining)
        elif built != current:
            pending[rank] = actor._rayrl_rebuild.remote()
    results, failures = wait_all(pending, timeout_s)
    for rank, info in results.items():
        group.infos[rank] = info
        group.built[rank] = current
        if read is not None:
            read[rank] = read.get(rank, 0) + int(info.get("bytes_read", 0))
    return failures


def _report(
    group: GroupCore,
    old: dict[int, WorkerDescription],
    spare: dict[int, bool],
    read: dict[int, int],
) -> list[Replacement]:
    out = []
    if old:
        reloading = sorted(r for r, n in read.items() if n > 0)
        logger.info(
            "%s: %d of %d ranks read weights from storage while it was brought back (%s)",
            group.name,
            len(reloading),
            group.world_size,
            ", ".join(f"rank {r}: {read[r]} bytes" for r in reloading) or "none",
        )
    for r in sorted(old):
        new = group.describe(r)
        if new.node_id != old[r].node_id:
            message = topology_message(group, r, old[r].node_id, new.node_id)
            logger.warning(message)
            warnings.warn(message, TopologyChangedWarning, stacklevel=4)
        logger.warning(
            "%s: replaced rank %d (pid %s -> %s, node %s -> %s), generation %d",
            group.name,
            r,
            old[r].pid,
            new.pid,
            old[r].node_id,
            new.node_id,
            group.generation,
        )
        out.append(
            Replacement(
                r,
                old[r].node_id,
                new.node_id,
                old[r].pid,
                new.pid,
                group.generation,
                spare.get(r, False),
                dict(read),
            )
        )
    return out
