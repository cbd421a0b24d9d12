"""Bytes this process read from storage to build its models, for recovery reports.

Whatever reads model weights from files counts what it read here (`count(nbytes)`): the
training engine's checkpoint reader, a whole-model ``from_pretrained``, the rollout
engines' loads. A worker reports what its `init_worker` and `rebuild` added
(`rayrl.controller.worker`), so a replacement says which ranks read weights from
storage (`rayrl.controller.health.Replacement.bytes_read`). The total is a module
global written by the thread that builds a model; a reader on another thread sees it
one read late at worst. A leaf module: it imports nothing of rayrl, so any layer may
count.
"""

from __future__ import annotations

_total = 0


def count(nbytes: int) -> None:
    """``nbytes`` more were read from storage (model weight files)."""
    global _total
    _total += int(nbytes)


def total() -> int:
    """Bytes read from storage by this process so far."""
    return _total
