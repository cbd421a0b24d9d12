"""Multi-turn episodes in the native scheduler: samples parked between turns.

A sample added with ``park`` that stops with room left is *parked* instead of finished
(`Scheduler._settle`): it leaves the running set and gives back its sequence slot, but
keeps its KV blocks, and a turn event is queued for the caller. The caller later
`resume`s it with tokens to append (a tool's answer and the turn separators), which
become a prefill job that starts where the sample's cache ends, or ends it
(`finish_parked`). When KV blocks run short, parked samples, then resumed jobs still
waiting, give theirs up (`_reclaim`), the most recent first; such a sample is then
recomputed from its prompt and everything in its response (the prefix cache may hold
its blocks still). `Parking` is a part of `Scheduler`, whose state it uses.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from rayrl.rollout.native.jobs import Job
from rayrl.rollout.requests import TURN

__all__ = ["Parking"]


class Parking:
    """The scheduler's multi-turn part (module docstring)."""

    if TYPE_CHECKING:  # what `Scheduler` (and its `SampleTable`) provides
        from rayrl.rollout.native.images import PromptImages
        from rayrl.rollout.native.kv_cache import BlockAllocator

        alloc: BlockAllocator
        running: dict[int, None]
        parked: dict[int, None]
        waiting: deque[Job]
        events: list[tuple[int, str]]
        resumes: int
        reclaimed: int
        prompt_of: list[np.ndarray | None]
        images_of: list[PromptImages | None]
        blocks: list[list[int]]
        max_new: np.ndarray
        gen: np.ndarray
        kv_len: np.ndarray
        n_blocks: np.ndarray
        turn_start: np.ndarray
        stopped: np.ndarray
        paused: np.ndarray
        tokens: np.ndarray
        log_probs: np.ndarray

        def _end(self, sample: int) -> None: ...
        def _release_blocks(self, sample: int) -> None: ...
        def _finishing(self, sample: int) -> None: ...
        def _release_slot(self, sample: int) -> None: ...

    def _park(self, sample: int) -> None:
        """The sample's turn ended: out of the running set, slot freed, KV kept."""
        self.running.pop(sample, None)
        self._release_slot(sample)
        self.paused[sample] = True
        self.parked[sample] = None
        self.events.append((sample, TURN))

    def resume(self, sample: int, tokens: np.ndarray) -> None:
        """Append ``tokens`` to a parked sample's response; it rejoins after a prefill
        of what its cache lacks (those tokens, and its last sampled one if the cache
        does not hold it yet). The appended tokens' log-probs are 0.

        Raises:
            ValueError: the sample is not parked, or the tokens leave no room in its
                length limit for one more sampled token.
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        at, count = int(self.gen[sample]), len(tokens)
        if sample not in self.parked:
            raise ValueError(f"native rollout engine: sample {sample} is not waiting for a turn.")
        if count == 0 or at + count >= self.max_new[sample]:
            raise ValueError(
                f"native rollout engine: sample {sample} has {at} of {self.max_new[sample]} "
                f"response tokens; appending {count} must leave room for one more."
            )
        del self.parked[sample]
        self.tokens[sample, at : at + count] = tokens
        self.log_probs[sample, at : at + count] = 0.0
        self.gen[sample] = at + count
        self.turn_start[sample] = at + count
        prompt = self.prompt_of[sample]
        sequence = np.concatenate([prompt, self.tokens[sample, : at + count]])
        job = Job(
            sequence,
            [sample],
            done=int(self.kv_len[sample]),
            blocks=self.blocks[sample],
            images=self.images_of[sample],
        )
        self.blocks[sample] = []
        self.n_blocks[sample] = 0
        self.waiting.appendleft(job)  # it holds KV blocks: let it use them first
        self.resumes += 1

    def finish_parked(self, sample: int, stopped: bool) -> None:
        """End a parked sample's episode (``stopped``: finish reason stop, else length)."""
        if sample not in self.parked:
            raise ValueError(f"native rollout engine: sample {sample} is not waiting for a turn.")
        del self.parked[sample]
        self.stopped[sample] = stopped
        self._finishing(sample)
        self._release_blocks(sample)
        self._end(sample)

    def _reclaim(self, needed: int, keep: Job | None = None) -> bool:
        """Free KV blocks of parked samples, then of resumed jobs still waiting (the
        most recent first), until ``needed`` blocks are free; True if it got there.
        Each one that gives its blocks up is recomputed from the start when it runs."""
        for sample in reversed(list(self.parked)):
            if self.alloc.free_blocks >= needed:
                return True
            if self.blocks[sample]:
                self._release_blocks(sample)
                self.kv_len[sample] = 0
                self.reclaimed += 1
        for job in reversed(self.waiting):
            if self.alloc.free_blocks >= needed:
                return True
            if job.blocks and job is not keep:
                self.alloc.release(job.blocks)
                job.blocks, job.done = [], 0
                self.reclaimed += 1
        if keep is not None and keep.blocks and self.alloc.free_blocks < needed:
            self.alloc.release(keep.blocks)  # the job itself: recompute it whole
            keep.blocks, keep.done = [], 0
            self.reclaimed += 1
        return self.alloc.free_blocks >= needed
