"""A rank whose collective failed lets go of its process group, so its peers fail too.

When one rank of a gloo process group dies inside a collective, its ring neighbours
get "connection closed" at once, but the ranks that wait on those neighbours' data do
not: the neighbours are alive, their sockets open, so the others stay blocked until
the group's timeout (30 minutes by default), and the recovery has to replace them as
well, though they lost nothing. Gloo cannot abort a collective in progress from
another thread (`abort()`, `shutdown()` and `destroy_process_group()` there leave it
blocked). What does unblock them is their neighbours' sockets closing, which happens
when the neighbours' gloo context is destroyed: the process group destroyed and the
last references to it dropped, including the locals of the frames the error passed
through (the collective's work object holds the context).

`release_after_collective_failure(err)` does that in the rank that raised: for an
error of the gloo backend it clears the error's frames' locals, runs the release
callbacks this process registered (`on_collective_failure`: an engine drops the
references its FSDP2 modules and device meshes keep to the groups, which c10d's
destroy does not reach), drops the default-argument references that
``torch.distributed.nn.functional`` took to the default group when it was imported,
destroys every process group and collects garbage, so the failure reaches every rank
of every group this rank was in (the default group and a device mesh's sub-groups
alike) in about a second. The rank stays alive with its state (shards, optimizer);
the recovery re-forms the group (`init_process_group` of the next generation) and
rebuilds on it. NCCL has its own abort and is left alone here.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("rayrl.controller")

# What gloo's transport says when a peer is gone (its pair.cc errors)
GLOO_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Read error")


# Release callbacks registered in this process (weakly: an engine that is gone drops out)
_CALLBACKS: list[weakref.ref[Callable[[], None]]] = []
_LOCK = threading.Lock()


def on_collective_failure(callback: Callable[[], None]) -> None:
    """Register ``callback`` (a bound method, held weakly) to run in this process when a
    gloo collective lost a peer, before the process groups are destroyed: it drops the
    references its owner keeps to process groups (and their pending work), so that
    their gloo contexts close. Registering the same method again does nothing."""
    ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else weakref.ref(callback)
    with _LOCK:
        _CALLBACKS[:] = [r for r in _CALLBACKS if r() is not None]
        if not any(r() == callback for r in _CALLBACKS):
            _CALLBACKS.append(ref)


def _run_callbacks(where: str) -> None:
    with _LOCK:
        callbacks = [c for c in (r() for r in _CALLBACKS) if c is not None]
    for callback in callbacks:
        try:
            callback()
        except Exception:  # one owner's failure must not keep the others' groups alive
            logger.exception("%s: a release callback failed (%r)", where, callback)


def _drop_import_time_defaults(dist: Any) -> None:
    """``torch.distributed.nn.functional``'s collectives default to ``group.WORLD`` as it
    was when the module was imported: the process group object of that time. Their
    defaults become None (the default group at call time: the same meaning)."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None:
        return
    for fn in vars(functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(
                None if isinstance(d, dist.ProcessGroup) else d for d in defaults
            )


def is_gloo_peer_lost(err: BaseException) -> bool:
    """Whether `err` is gloo's report of a peer gone in the middle of a collective."""
    text = str(err)
    return (
        isinstance(err, RuntimeError)
        and "gloo" in text
        and any(marker in text for marker in GLOO_PEER_LOST)
    )


def release_after_collective_failure(err: BaseException, where: str) -> bool:
    """Let go of this process's process groups after `err`, a gloo collective's failure
    because a peer is gone (see the module docstring); True when it did."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    if dist.get_backend() != "gloo" or not is_gloo_peer_lost(err):
        return False
    traceback.clear_frames(err.__traceback__)
    _run_callbacks(where)
    _drop_import_time_defaults(dist)
    dist.destroy_process_group()
    gc.collect()
    logger.warning(
        "%s: a collective failed because a peer is gone (%s); this rank left its "
        "process group so that the others stop waiting too; the recovery forms a new one",
        where,
        str(err).splitlines()[0][:200],
    )
    return True
