"""The steps of the native engine: prefill and decode steps over its `Scheduler`, run by
its `ModelRunner`, one pass at a time (`Stepper.step`).

A decode step is launched before the last one's tokens are committed where the
scheduler allows it (`Scheduler.can_overlap`): the device runs one step while the host
does the bookkeeping of the last, and the new step takes its input tokens from the
last one's draw on the device (`ModelRunner.decode`'s ``feed``). A prefill step runs
when one is due: with nothing in flight, synchronously (its first tokens committed
before the next step); in multi-turn episodes, whose resumed turns prefill often and
little, queued behind the decode step in flight, which the host commits while the
device runs the prefill, the prefill's first tokens left on the device for the next
decode step (beside the others' tokens from the host). Between passes the engine's
caller may add, resume, finish or abort samples, or (after `drain`) change weights.

The steps' time goes into ``stats`` (`loop_stats`).
"""

from __future__ import annotations

import time

import numpy as np

from rayrl import progress
from rayrl.rollout.native.runner import Launch, ModelRunner
from rayrl.rollout.native.scheduler import Chunk, Scheduler
from rayrl.rollout.sampling import SamplingParams

__all__ = ["Stepper"]


class Stepper:
    """The engine's step passes (see the module docstring); ``pending`` is the launched
    step whose tokens are not committed yet."""

    def __init__(self, runner: ModelRunner, sched: Scheduler, overlap: bool, stats: dict) -> None:
        self.runner, self.sched, self.overlap, self.stats = runner, sched, overlap, stats
        self.sampling: SamplingParams | None = None  # of the samples live now
        self.pending: Launch | None = None
        self.stalled = False  # the last pass found nothing to run: only the caller can help

    @property
    def keys(self) -> np.ndarray:
        return self.sched.keys

    @property
    def drawing(self) -> SamplingParams:
        """``sampling``, which the engine sets before it adds the first live sample."""
        if self.sampling is None:
            raise RuntimeError("Stepper: no sampling set; the engine sets it as it adds samples")
        return self.sampling

    @property
    def busy(self) -> bool:
        """True while a sample is live or a launched step is not committed."""
        return not self.sched.done or self.pending is not None

    def step(self) -> None:
        """One pass: commit, prefill or decode, as the scheduler allows."""
        sched, pending = self.sched, self.pending
        self.stalled = False
        if pending is not None and not (self.overlap and sched.can_overlap()):
            chunks = sched.plan_prefill() if self._prefill_behind_ok() else []
            if chunks:  # queued behind the step in flight, which is committed meanwhile
                self.pending = self._prefill(chunks, behind=pending)
            else:
                self._commit(pending)
                self.pending = None
            return
        if pending is None and (chunks := sched.plan_prefill()):
            self._prefill(chunks)
            return
        launch = self._decode(pending)
        self.stalled = launch is None and pending is None
        if pending is not None:  # the device runs `launch` meanwhile
            self._commit(pending)
        self.pending = launch

    def drain(self) -> None:
        """Commit the launched step, if any: nothing is left in flight."""
        if self.pending is not None:
            self._commit(self.pending)
            self.pending = None

    def _decode(self, pending: Launch | None) -> Launch | None:
        """Launch a decode step of every running sample (None: none runs), its input
        tokens taken from ``pending``'s draw on the device where it drew them."""
        since = time.perf_counter()
        samples = self.sched.plan_decode()
        launch = None
        if len(samples):
            feed = (
                None
                if pending is None
                else (pending.drawn[0], self.sched.rows_in(pending.samples, samples))
            )
            launch = self.runner.decode(self.sched, samples, self.keys, self.drawing, feed)
            launch.at = self.sched.launch_decode(samples)
            self.stats["decode_steps"] += 1
            self.stats["overlapped_steps"] += feed is not None
        self.stats["launch_s"] += time.perf_counter() - since
        return launch

    def _prefill_behind_ok(self) -> bool:
        """Whether a prefill step due now may be queued behind the step in flight: in
        multi-turn episodes, with overlapped decoding on."""
        sched = self.sched
        return self.overlap and sched.parking > 0 and sched.prefill_due()

    def _prefill(self, chunks: list[Chunk], behind: Launch | None = None) -> Launch | None:
        """Run a prefill step of ``chunks`` (`Scheduler.plan_prefill`).

        Without ``behind``, its first tokens are committed before it returns (None).
        ``behind``: the step in flight; the prefill is queued after it on the device,
        the host commits that step while the device runs the prefill, and the prefill's
        draw is returned uncommitted (a `Launch`, or None when no chunk completes a
        job): the next decode step takes its tokens from the device. So a resumed
        turn's prefill neither drains the overlapped decoding nor waits for its own
        tokens. The step in flight is committed before the prefill's samples join the
        running set: its late token of a sample resumed now is still dropped."""
        runner, sched, stats = self.runner, self.sched, self.stats
        since = time.perf_counter()
        forward, wait = runner.forward_s, runner.sampler.wait_s
        launch = runner.prefill(sched, chunks, self.keys, self.drawing)
        stats["prefill_forward_s"] += runner.forward_s - forward
        stats["prefill_steps"] += 1
        stats["prefill_tokens"] += sum(c.count for c in chunks)
        progress.tick(prefill_chunks=len(chunks))
        if behind is not None:
            stats["prefill_s"] += time.perf_counter() - since
            self._commit(behind)
            since = time.perf_counter()
            _, at = sched.launch_prefill(chunks)
            if launch is not None:
                launch.at = at
                stats["overlapped_prefills"] += 1
            stats["prefill_s"] += time.perf_counter() - since
            return launch
        if launch is None:
            sched.commit_prefill(chunks, np.zeros(0, np.int64), np.zeros(0, np.float32))
        else:
            sched.commit_prefill(chunks, *runner.tokens_of(launch))
        stats["prefill_wait_s"] += runner.sampler.wait_s - wait
        stats["prefill_s"] += time.perf_counter() - since
        return None

    def _commit(self, launch: Launch) -> None:
        since = time.perf_counter()
        tokens, log_probs = self.runner.tokens_of(launch)
        kept = self.sched.commit_decode(launch.samples, launch.at, tokens, log_probs)
        self.stats["dropped_tokens"] += len(launch.samples) - kept
        progress.tick(tokens=kept)
        self.stats["commit_s"] += time.perf_counter() - since
