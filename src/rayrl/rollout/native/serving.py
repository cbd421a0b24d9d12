"""The native engine's request API (`rayrl.rollout.requests`): requests added, steps
run one pass at a time, samples resumed, finished, aborted and read, over the engine's
`Scheduler` and `Stepper`, which live as long as the engine.

Requests decoded together share one draw: the first request into an empty engine sets
the sampling (temperature, top-k, top-p, greedy, stop ids and strings) every live
sample uses; a request that draws otherwise must wait until they finish (the turn loop
holds it). `Serving` is a part of `NativeRolloutEngine`, whose state it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from rayrl.rollout.native.images import PromptImages
from rayrl.rollout.native.stops import StopStrings
from rayrl.rollout.requests import SampleOutput
from rayrl.rollout.sampling import SamplingParams
from rayrl.rollout.turns import TurnImages

if TYPE_CHECKING:
    from rayrl.rollout.native.routes import RouteStore
    from rayrl.rollout.native.scheduler import Scheduler
    from rayrl.rollout.native.step_loop import Stepper

__all__ = ["Serving"]

WHERE = "NativeRolloutEngine"


class Serving:
    """The engine's request API (module docstring)."""

    if TYPE_CHECKING:  # what `NativeRolloutEngine` provides
        sched: Scheduler
        stepper: Stepper
        routes: RouteStore | None
        tokenizer: Any
        eos_ids: tuple[int, ...]

        def _check_ready(self, sampling: SamplingParams) -> None: ...
        def _check_lengths(self, prompts: list[np.ndarray], limits: np.ndarray, n: int) -> None: ...
        def _ensure_graphs(self) -> None: ...

    def add(
        self,
        prompt: np.ndarray,
        keys: np.ndarray,
        limits: np.ndarray,
        sampling: SamplingParams,
        *,
        park: bool = False,
        images: PromptImages | None = None,
    ) -> np.ndarray:
        """Queue one prompt and its samples (`rayrl.rollout.requests`); their ids.
        ``images``: a vision-language prompt's (`NativeRolloutEngine.prompt_images` makes
        them; the raw pixel inputs an episode carries are refused: `_no_images`)."""
        if images is not None and not isinstance(images, PromptImages):
            _no_images(images)
        self._check_ready(sampling)
        prompt = np.asarray(prompt, dtype=np.int64)
        limits = np.asarray(limits, dtype=np.int64).reshape(-1)
        self._check_lengths([prompt], limits, len(limits))
        drawing = sampling.drawing()
        if self.sched.live and drawing != self.stepper.sampling:
            raise ValueError(
                f"{WHERE}.add: the samples in flight draw with {self.stepper.sampling}; a "
                f"request drawing with {drawing} must wait until they finish"
            )
        if not self.sched.live:
            self._draw_with(drawing)
        self._ensure_graphs()
        return self.sched.add(prompt, limits, keys, park, images)

    def _draw_with(self, drawing: SamplingParams) -> None:
        """Set the sampling every live sample shares: the draw, the stop ids and strings."""
        self.stepper.sampling = drawing
        stop_ids = [] if drawing.ignore_eos else list(self.eos_ids)
        stop_ids += [i for i in drawing.stop_token_ids if i not in stop_ids]
        self.sched.set_stop_ids(np.asarray(stop_ids, dtype=np.int64))
        self.sched.stop_check = None
        if drawing.stop:
            self.sched.stop_check = StopStrings(self.tokenizer, drawing.stop).checker(self.sched)

    def resume(self, sample: int, tokens: np.ndarray, images: TurnImages | None = None) -> None:
        """Continue a parked sample with ``tokens`` appended (its next turn)."""
        _no_images(images)
        self.sched.resume(int(sample), tokens)

    def finish(self, sample: int, stopped: bool) -> None:
        """End a parked sample (``stopped``: finish reason stop, else length)."""
        self.sched.finish_parked(int(sample), stopped)

    def abort(self, samples) -> None:
        """End samples wherever they are; their ids still need `release`."""
        self.sched.abort(samples)

    def step(self) -> list[tuple[int, str]]:
        """One scheduler pass; the samples finished and turns ended since the last."""
        self.stepper.step()
        self.sched.recycle(None if self.stepper.pending is None else self.stepper.pending.samples)
        return self.sched.take_events()

    def output(self, sample: int) -> SampleOutput:
        """A sample's response so far (the whole of it once finished)."""
        sched, length = self.sched, int(self.sched.gen[sample])
        return SampleOutput(
            sched.tokens[sample, :length].copy(),
            sched.log_probs[sample, :length].copy(),
            sched.versions[sample, :length].copy(),
            bool(sched.stopped[sample]),
            None if self.routes is None else self.routes.take(sample),
        )

    def release(self, samples) -> None:
        """Give finished samples' ids back (reused once no launched step holds them)."""
        if self.routes is not None:  # records of samples whose output was never read
            self.routes.drop(samples)
        self.sched.release(samples)

    def drain(self) -> None:
        """Commit the launched step: nothing left in flight (weights may change then)."""
        self.stepper.drain()
        self.sched.recycle(None)

    @property
    def serves_requests(self) -> bool:
        return True

    @property
    def busy(self) -> bool:
        return self.stepper.busy

    @property
    def stalled(self) -> bool:
        return self.stepper.stalled

    @property
    def parked(self) -> int:
        return len(self.sched.parked)

    @property
    def live(self) -> int:
        return self.sched.live

    @property
    def draws_with(self) -> SamplingParams | None:
        return self.stepper.sampling if self.sched.live else None

    @property
    def version(self) -> int:
        """The policy version the tokens drawn now are tagged with."""
        return self.sched.version

    @version.setter
    def version(self, value: int) -> None:
        self.sched.version = int(value)


def _no_images(images: Any) -> None:
    """The native engine feeds a prompt's images at its prefill only: an episode's turns
    with images (a tool's or an environment's) run on the hf engine
    (`rayrl.config.vision_checks` refuses the setting before anything starts)."""
    if images:
        raise ValueError(
            f"{WHERE}: a multi-turn request with images, which the native engine does not "
            "feed yet; roll out vision-language episodes with actor_rollout_ref.rollout.name=hf"
        )
