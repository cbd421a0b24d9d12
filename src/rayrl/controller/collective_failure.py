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
error of the gloo backend it clears the error's frames' locals, destroys the default
process group and collects garbage, so the failure reaches every rank of the group
in about a second. The rank stays alive with its state; the recovery re-forms the
group (`init_process_group` of the next generation) and rebuilds on it. NCCL has
its own abort and is left alone here.
"""

from __future__ import annotations

import gc
import logging
import sys
import traceback

logger = logging.getLogger("rayrl.controller")

# What gloo's transport says when a peer is gone (its pair.cc errors)
GLOO_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Read error")


def is_gloo_peer_lost(err: BaseException) -> bool:
    """Whether `err` is gloo's report of a peer gone in the middle of a collective."""
    text = str(err)
    return (
        isinstance(err, RuntimeError)
        and "gloo" in text
        and any(marker in text for marker in GLOO_PEER_LOST)
    )


def release_after_collective_failure(err: BaseException, where: str) -> bool:
    """Destroy this process's default process group after `err`, a gloo collective's
    failure because a peer is gone (see the module docstring); True when it did."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    if dist.get_backend() != "gloo" or not is_gloo_peer_lost(err):
        return False
    traceback.clear_frames(err.__traceback__)
    dist.destroy_process_group()
    gc.collect()
    logger.warning(
        "%s: a collective failed because a peer is gone (%s); this rank left its "
        "process group so that the others stop waiting too; the recovery forms a new one",
        where,
        str(err).splitlines()[0][:200],
    )
    return True
