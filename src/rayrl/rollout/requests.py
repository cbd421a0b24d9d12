"""The request-level contract of rollout engines: what the one turn loop asks of them.

Both engines serve *requests* from a scheduler that lives as long as the engine
(`rayrl.rollout.loop` drives them; `generate` is a thin loop over this API):

- ``add(prompt, keys, limits, sampling, park=...)`` queues one prompt with the samples
  that fork from it (they share its prefill), sample k drawing with sampler key
  ``keys[k]`` (`sampling.sample_keys`) and at most ``limits[k]`` response tokens;
  returns their sample ids (engine-chosen, reused after `release`). With ``park`` a
  sample that ends a turn (a stop token or string, with room left) is *parked*: it
  keeps its KV cache and waits for `resume` (tokens to append: a tool's answer) or
  `finish`. ``images``: the prompt's images as the engine takes them
  (`RolloutEngine.prompt_images`: the hf engine's pixel inputs, the row's
  ``multi_modal_inputs``; the native engine's `PromptImages`); ``resume(sample, tokens,
  images)`` may append an
  observation's (`rayrl.rollout.turns.TurnImages`). An engine without a vision tower
  refuses them.
- ``step()`` runs one pass of the scheduler (a prefill, a decode, a commit) and returns
  what happened since the last call: ``(sample, DONE)`` for a sample whose output is
  final, ``(sample, TURN)`` for a parked one. ``stalled`` is True when the pass found
  nothing to run (every live sample is parked): only the caller can help then.
- ``abort(samples)`` ends samples wherever they are (no event); ``output(sample)`` reads
  a finished sample's response (`SampleOutput`); ``release(samples)`` gives their ids
  back.
- ``update_weights(..., version=v)`` may run between steps while samples are in flight:
  the engine first commits what is launched, the samples keep their KV caches, and
  every token drawn from then on carries version ``v`` (`SampleOutput.versions`).

Requests decoded together must agree on `SamplingParams.drawing` (temperature, top-k,
top-p, stops); the loop holds back a request that does not until the engine is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch import Tensor

from rayrl.rollout.sampling import SamplingParams
from rayrl.rollout.turns import TurnImages

__all__ = ["DONE", "TURN", "RequestEngine", "SampleOutput"]

DONE = "done"  # a sample finished: its output is final
TURN = "turn"  # a parked sample's turn ended: resume it or finish it


@dataclass
class SampleOutput:
    """A finished sample's response: every token (sampled and appended), each sampled
    token's log-prob (0 on appended ones), the policy version each token was drawn
    with, and whether it ended on a stop (else its length limit cut it).

    ``routes``: where the engine records them (a mixture of experts), the experts each
    position of prompt and response was routed to, ``[prompt + response, layers, k]``
    (`rayrl.algos.routing`; possibly still on the device); None otherwise."""

    tokens: np.ndarray
    log_probs: np.ndarray
    versions: np.ndarray
    stopped: bool
    routes: Tensor | None = None


class RequestEngine(Protocol):
    """A rollout engine's request API (module docstring)."""

    eos_ids: tuple[int, ...]
    pad_id: int
    tokenizer: object

    def add(
        self,
        prompt: np.ndarray,
        keys: np.ndarray,
        limits: np.ndarray,
        sampling: SamplingParams,
        *,
        park: bool = False,
        images: Any = None,
    ) -> np.ndarray: ...

    def resume(self, sample: int, tokens: np.ndarray, images: TurnImages | None = None) -> None: ...

    def finish(self, sample: int, stopped: bool) -> None: ...

    def abort(self, samples) -> None: ...

    def step(self) -> list[tuple[int, str]]: ...

    def output(self, sample: int) -> SampleOutput: ...

    def release(self, samples) -> None: ...

    def drain(self) -> None: ...

    @property
    def busy(self) -> bool: ...

    @property
    def stalled(self) -> bool: ...

    @property
    def parked(self) -> int: ...

    @property
    def live(self) -> int: ...

    @property
    def draws_with(self) -> SamplingParams | None: ...
