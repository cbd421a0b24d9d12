"""The one turn loop: jobs of samples on a request engine, single turns or episodes.

`TurnLoop` drives any engine of the request contract (`rayrl.rollout.requests`:
the native engine, the HF engine, a tensor-parallel native replica) for any number of
*jobs*. A job is one call's samples: prompts (a vision-language model's with their
images), each with its samples' sampler keys and length limits, sampled with one `SamplingParams`, and optionally a `TurnDriver` that
runs their episodes (`rayrl.rollout.turns`: the driver is told when a sample's
turn ends and answers with tokens to append, or the end of the episode). A pass of the
loop (`pump`):

1. jobs submitted since the last pass join the engine (a job whose sampling the
   engine's live samples do not share waits until the engine is empty; none joins
   while ``holding`` is set);
2. the drivers' answers ready now are applied (resume the sample with the appended
   tokens, or finish it); when the engine stalled (every live sample waits for its
   driver) the loop blocks until an answer comes;
3. ``between_steps`` runs (a weight receiver swaps a new policy in there: the engine
   commits what is launched first, and the samples in flight keep their KV caches);
4. one engine step (with nothing to run, it only hands over the events of finishes
   the answers caused); its events go to their jobs: a finished sample's output is
   read and its id released, a parked sample's turn goes to its driver.

``run(job)`` pumps until that job is done; any thread may call it (one pumps at a time,
and its passes serve every job), so concurrent calls of an asynchronous replica share
the engine's batch. Samples are numbered by row within their job (prompt i's sample k
is ``i * n + k`` when every prompt has n samples); drivers see those numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rayrl.rollout.contract import Responses
from rayrl.rollout.requests import DONE, TURN, RequestEngine, SampleOutput
from rayrl.rollout.sampling import SamplingParams
from rayrl.rollout.turns import TurnDriver

__all__ = ["Job", "TurnLoop", "responses_of", "run_batch"]

POLL_S = 0.002  # between looks at several drivers' answers while the engine is stalled


@dataclass(eq=False)  # a job is itself: lists of jobs find it by identity
class Job:
    """One call's samples (module docstring).

    Attributes:
        prompts: one token array per prompt.
        keys: one sampler key per sample row (prompt i's samples at rows ``i * n ...``).
        limits: one response length limit per sample row.
        sampling: how every sample of the job draws (``n`` samples per prompt).
        driver: the episodes' driver, or None (single turns).
        images: per prompt, a vision-language prompt's images as its engine takes them
            (`RolloutEngine.prompt_images`: the hf engine's pixel inputs, the native
            engine's `PromptImages`; None: text), handed to ``engine.add`` with the
            prompt; None: all text.
        outputs: per row, filled as samples finish.
        aborted: the job was aborted (`TurnLoop.abort`): its outputs are incomplete.
    """

    prompts: Sequence[np.ndarray]
    keys: np.ndarray
    limits: np.ndarray
    sampling: SamplingParams
    driver: TurnDriver | None = None
    images: Sequence[Any] | None = None  # per prompt: the engine's images, or None
    outputs: list[SampleOutput | None] = field(default_factory=list)
    aborted: bool = False
    remaining: int = 0
    ids: np.ndarray | None = None  # the engine's sample id of each row, once added
    error: BaseException | None = None  # why the engine refused the job
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        rows = len(self.prompts) * self.sampling.n
        self.keys = np.asarray(self.keys, dtype=np.int64).reshape(rows)
        self.limits = np.asarray(self.limits, dtype=np.int64).reshape(rows)
        self.outputs = [None] * rows
        self.remaining = rows
        if rows == 0:
            self.done.set()

    def results(self) -> list[SampleOutput]:
        """Every row's output: the job is done, and was not aborted."""
        outputs = [o for o in self.outputs if o is not None]
        if len(outputs) != len(self.outputs):
            missing = len(self.outputs) - len(outputs)
            raise RuntimeError(f"the job has {missing} rows without an output (aborted?)")
        return outputs


class TurnLoop:
    """Jobs on one request engine (module docstring).

    Args:
        engine: the engine; only the pumping thread touches it.
        between_steps: called before each engine step (weights swapped there).
        stats: seconds the loop spent on drivers (``turn_wait_s`` blocked on them with
            nothing to run, ``turns_s`` applying answers otherwise), added into it.
    """

    def __init__(
        self,
        engine: RequestEngine,
        between_steps: Callable[[], None] | None = None,
        stats: dict[str, float] | None = None,
    ) -> None:
        self.engine = engine
        self.between_steps = between_steps
        self.stats = stats if stats is not None else {}
        self._lock = threading.Lock()  # the job lists
        self._pump = threading.Lock()  # one pumping thread at a time
        self._new: list[Job] = []
        self._held: list[Job] = []  # waiting for the engine to empty (other sampling)
        self._jobs: list[Job] = []
        self._owner: dict[int, tuple[Job, int]] = {}  # engine sample id -> (job, row)
        # True: submitted jobs wait before they join the engine (a weight receiver holds
        # them until the version it waits to swap in is in: `between_steps` sets it)
        self.holding = False
        # engine steps taken, and the live samples they stepped, summed: stepped / steps
        # is the mean batch (a server's concurrent requests sharing steps)
        self.steps = self.stepped = 0

    # ------------------------------------------------------------------ calls
    def run(self, job: Job) -> Job:
        """Submit ``job`` and pump until it is done (or aborted); returns it."""
        self.submit(job)
        while not job.done.is_set():
            if self._pump.acquire(timeout=0.05):
                try:
                    while not job.done.is_set():
                        self.pump()
                finally:
                    self._pump.release()
        if job.error is not None:
            raise job.error
        return job

    def submit(self, job: Job) -> None:
        """Queue ``job``; it joins the engine at the next pass."""
        if job.done.is_set():
            return
        with self._lock:
            self._new.append(job)

    def abort(self, job: Job) -> None:
        """End ``job`` now (from the pumping thread): its samples leave the engine, its
        outputs stay as they are, and its waiter returns."""
        with self._lock:
            for queue in (self._new, self._held):
                if job in queue:
                    queue.remove(job)
        if job.ids is not None:
            live = [int(s) for s, out in zip(job.ids, job.outputs, strict=True) if out is None]
            self.engine.abort(live)
            self.engine.release(live)
            for s in live:
                self._owner.pop(s, None)
        if job in self._jobs:
            self._jobs.remove(job)
        job.aborted = True
        job.done.set()

    @property
    def jobs(self) -> list[Job]:
        """The jobs in the engine now."""
        return list(self._jobs)

    # ------------------------------------------------------------------ a pass
    def pump(self) -> None:
        """One pass (module docstring); call with the pump held (`run` does)."""
        self._admit()
        self._answers()
        if self.between_steps is not None:
            self.between_steps()
        if not self._jobs:
            time.sleep(POLL_S)  # nothing to run (a job is held, or a waiter returns)
            return
        self.steps += 1
        self.stepped += self.engine.live
        for sample, kind in self.engine.step():
            job, row = self._owner[sample]
            if kind == TURN:
                assert job.driver is not None  # only a driven job's samples park (`_add`)
                response = self.engine.output(sample).tokens
                job.driver.turn_ended(row, response)
            elif kind == DONE:
                self._done(job, row, sample)

    def _admit(self) -> None:
        """Jobs submitted since the last pass join the engine, each once the engine's
        live samples draw as it does (an empty engine takes any)."""
        with self._lock:
            self._held.extend(self._new)
            self._new = []
            held = [] if self.holding else list(self._held)
        for job in held:
            active = self.engine.draws_with if self.engine.live else None
            if active is not None and active != job.sampling.drawing():
                continue
            with self._lock:
                self._held.remove(job)
            self._add(job)

    def _add(self, job: Job) -> None:
        """The job's prompts into the engine; an engine that refuses one (a prompt too
        long, say) fails the job, not the loop: its waiter raises the error."""
        n, park = job.sampling.n, job.driver is not None
        ids: list[int] = []
        try:
            for i, prompt in enumerate(job.prompts):
                rows = slice(i * n, (i + 1) * n)
                images = job.images[i] if job.images is not None else None
                extra = {"images": images} if images is not None else {}
                added = self.engine.add(
                    prompt, job.keys[rows], job.limits[rows], job.sampling, park=park, **extra
                )
                ids.extend(int(s) for s in added)
        except Exception as err:  # noqa: BLE001 - raised in the job's own thread
            self.engine.abort(ids)
            self.engine.release(ids)
            job.error = err
            job.done.set()
            return
        job.ids = np.asarray(ids, dtype=np.int64)
        for row, sample in enumerate(ids):
            self._owner[sample] = (job, row)
        self._jobs.append(job)

    def _answers(self) -> None:
        """Apply the drivers' answers ready now; block for one when the engine stalled."""
        engine = self.engine
        if not engine.parked:
            return
        drivers = [(j, j.driver) for j in self._jobs if j.driver is not None]
        blocked = engine.stalled
        since = time.perf_counter()
        got = 0
        while True:
            single = len(drivers) == 1
            for job, driver in drivers:
                answers = driver.take_ready(wait=blocked and single)
                got += len(answers)
                assert job.ids is not None  # set by `_add` as the job joined
                for answer in answers:
                    sample = int(job.ids[answer.sample])
                    if answer.tokens is None:
                        engine.finish(sample, answer.stopped)
                        continue
                    tokens = np.asarray(answer.tokens, dtype=np.int64)
                    engine.resume(sample, tokens, images=answer.images)
            if got or not blocked or single:
                break
            time.sleep(POLL_S)
        key = "turn_wait_s" if blocked else "turns_s"
        self.stats[key] = self.stats.get(key, 0.0) + time.perf_counter() - since

    def _done(self, job: Job, row: int, sample: int) -> None:
        job.outputs[row] = self.engine.output(sample)
        self.engine.release([sample])
        del self._owner[sample]
        job.remaining -= 1
        if job.remaining == 0:
            self._jobs.remove(job)
            job.done.set()


def run_batch(
    engine: RequestEngine,
    prompts: Sequence[np.ndarray],
    sampling: SamplingParams,
    keys: np.ndarray,
    limits: np.ndarray,
    driver: TurnDriver | None = None,
    stats: dict[str, float] | None = None,
    images: Sequence[Any] | None = None,
) -> Responses:
    """A batch of prompts through `TurnLoop` on its own: ``sampling.n`` samples each
    (rows adjacent), the `Responses` of every row; ``images``: `Job.images`."""
    job = Job(prompts, keys, limits, sampling, driver, images)
    TurnLoop(engine, stats=stats).run(job)
    return responses_of(job.results())


def responses_of(outputs: Sequence[SampleOutput]) -> Responses:
    """Rows of sample outputs as one `Responses` (tokens right-padded with 0), their
    routing records brought to the host (when every row has one)."""
    rows = len(outputs)
    routes = None
    parts = [o.routes for o in outputs if o.routes is not None]
    if parts and len(parts) == rows:
        host = torch.cat(parts).cpu()  # one copy from the device, one wait
        routes = list(host.split([len(p) for p in parts]))
    width = max((len(o.tokens) for o in outputs), default=0)
    tokens = np.zeros((rows, width), dtype=np.int64)
    log_probs = np.zeros((rows, width), dtype=np.float32)
    versions = np.zeros((rows, width), dtype=np.int64)
    for i, out in enumerate(outputs):
        length = len(out.tokens)
        tokens[i, :length] = out.tokens
        log_probs[i, :length] = out.log_probs
        versions[i, :length] = out.versions
        versions[i, length:] = out.versions[0] if length else 0
    return Responses(
        tokens=torch.from_numpy(tokens),
        lengths=torch.tensor([len(o.tokens) for o in outputs], dtype=torch.long),
        log_probs=torch.from_numpy(log_probs),
        stopped=torch.tensor([bool(o.stopped) for o in outputs], dtype=torch.bool),
        versions=torch.from_numpy(versions),
        routes=routes,
    )
