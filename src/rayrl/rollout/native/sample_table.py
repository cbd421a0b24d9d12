"""The native scheduler's samples: their state in numpy arrays, their ids.

A sample is a row of every array here, by its id. The arrays grow (doubling) when
more samples are live than they hold, and widen when a request allows a longer
response; a decode step's bookkeeping is then a few vectorised operations over them,
whatever the batch size. Ids are reused: a finished sample's id is `release`d once its
output is read, and becomes free again at `recycle`, once no launched step can still
hold it (an overlapped step drew a token for it a step late, which its commit drops
by the id: a new sample must not be there yet).
"""

from __future__ import annotations

import numpy as np

from rayrl.rollout.native.images import PromptImages

__all__ = ["SampleTable"]

# One value per sample: its limits and key, where it stands, its flags.
PER_SAMPLE = {
    "max_new": np.int64,
    "keys": np.int64,
    "gen": np.int64,  # tokens generated (and appended) so far
    "kv_len": np.int64,  # tokens whose K/V is in the cache
    "slot": np.int64,  # block-table row while alive (-1: none)
    "n_blocks": np.int64,  # len(self.blocks[s])
    "turn_start": np.int64,  # first column of the current turn
    "stopped": bool,
    "finished": bool,
    "paused": bool,  # parked, or resumed and not yet prefilled
    "parks": bool,
    "aborted": bool,
    "_where": np.int64,  # scratch of `Scheduler.rows_in`
    "chain": np.int64,  # the prefix cache's hash of its last full block
    "rope_delta": np.int64,  # M-RoPE: a text token's position is its index plus this
    "salt": np.int64,  # the prefix cache's key of its prompt's images (0: none)
}
# One value per response column: the token, its log-prob, the version that drew it.
PER_TOKEN = {"tokens": np.int64, "log_probs": np.float32, "versions": np.int64}


class SampleTable:
    """Per-sample arrays for ``capacity`` samples of ``width`` response tokens, grown
    as needed, and their ids (module docstring)."""

    # The arrays of PER_SAMPLE and PER_TOKEN, set by `_grow` (declared for type checkers).
    max_new: np.ndarray
    keys: np.ndarray
    gen: np.ndarray
    kv_len: np.ndarray
    slot: np.ndarray
    n_blocks: np.ndarray
    turn_start: np.ndarray
    stopped: np.ndarray
    finished: np.ndarray
    paused: np.ndarray
    parks: np.ndarray
    aborted: np.ndarray
    _where: np.ndarray
    chain: np.ndarray
    rope_delta: np.ndarray
    salt: np.ndarray
    tokens: np.ndarray
    log_probs: np.ndarray
    versions: np.ndarray

    def __init__(self, capacity: int, width: int) -> None:
        self.capacity, self.width = 0, 0
        self.prompt_of: list[np.ndarray | None] = []
        self.images_of: list[PromptImages | None] = []  # its prompt's images (or None)
        self.blocks: list[list[int]] = []
        self.free_ids: list[int] = []
        self.retired: list[int] = []  # released ids not yet safe to reuse (`recycle`)
        self._grow(max(1, capacity), max(1, width))

    def take_ids(self, count: int, width: int) -> np.ndarray:
        """``count`` free ids, the arrays grown to hold them and ``width`` columns."""
        while len(self.free_ids) < count:
            self._grow(2 * self.capacity, self.width)
        if width > self.width:
            self._grow(self.capacity, width)
        return np.array([self.free_ids.pop() for _ in range(count)], dtype=np.int64)

    def release(self, samples) -> None:
        """Ids of finished samples whose output was read: reusable once no launched step
        can still hold them (`recycle`)."""
        for s in [int(s) for s in samples]:
            if not self.finished[s]:
                raise ValueError(f"native rollout engine: sample {s} is not finished")
            self.prompt_of[s] = self.images_of[s] = None
            self.retired.append(s)

    def recycle(self, in_flight: np.ndarray | None) -> None:
        """Make retired ids reusable, but those a launched step still holds."""
        if not self.retired:
            return
        keep = set() if in_flight is None else set(np.asarray(in_flight).tolist())
        ready = [s for s in self.retired if s not in keep]
        self.retired = [s for s in self.retired if s in keep]
        self.free_ids.extend(ready)

    def _grow(self, capacity: int, width: int) -> None:
        """Arrays for ``capacity`` samples of ``width`` response tokens, the values kept."""
        old_cap, old_width = self.capacity, self.width
        for name, dtype in PER_SAMPLE.items():
            grown = np.zeros(capacity, dtype=dtype)
            if old_cap:
                grown[:old_cap] = getattr(self, name)
            setattr(self, name, grown)
        self.slot[old_cap:] = -1
        for name, dtype in PER_TOKEN.items():
            grown = np.zeros((capacity, width), dtype=dtype)
            if old_cap:
                grown[:old_cap, :old_width] = getattr(self, name)
            setattr(self, name, grown)
        if capacity > old_cap:
            self.prompt_of.extend([None] * (capacity - old_cap))
            self.images_of.extend([None] * (capacity - old_cap))
            self.blocks.extend([] for _ in range(capacity - old_cap))
            self.free_ids = list(range(capacity - 1, old_cap - 1, -1)) + self.free_ids
        self.capacity, self.width = capacity, width
