"""The native scheduler's prefill work: a job (tokens to put in the KV cache, then the
samples that start from its end; a vision-language prompt's images beside them) and a
chunk of it (the part one prefill step runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rayrl.rollout.native.images import PromptImages

__all__ = ["Chunk", "Job"]


@dataclass
class Job:
    """A prefill: ``tokens`` to put in the cache, then ``samples`` start from its end."""

    tokens: np.ndarray
    samples: list[int]
    done: int = 0
    blocks: list[int] = field(default_factory=list)
    fork_blocks: list[int] = field(default_factory=list)  # one per extra sample, if needed
    images: PromptImages | None = None  # the prompt's images (a vision-language model's)

    @property
    def salt(self) -> int:
        """The prefix cache's key beside the tokens (`PromptImages.salt`; 0: no images)."""
        return 0 if self.images is None else self.images.salt


@dataclass
class Chunk:
    """``count`` tokens of ``job`` from ``start``, in one prefill step, at table ``row``."""

    job: Job
    start: int
    count: int
    row: int

    @property
    def completes(self) -> bool:
        return self.start + self.count == len(self.job.tokens)
