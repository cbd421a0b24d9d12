"""`RolloutService`: a rollout engine, the one turn loop, the episodes and a weight
receiver, as one object that both rollout workers hold.

The hybrid actor (`rayrl.workers.actor`) and an asynchronous rollout replica
(`rayrl.workers.rollout`) generate through the same service:

- ``generate(prompts, sampling)`` returns the rollout Batch contract
  (`rayrl.rollout.contract`), single turns or, with multi-turn settings,
  episodes of model turns and tool answers (`rayrl.rollout.agent.rollout`), and
  the policy version of every response token. Every call is a *job* of the service's
  one `TurnLoop` (`rayrl.rollout.loop`): calls from several threads at once
  (a replica's concurrent calls) share the engine's batch. (An HF model that cannot
  serve requests, `hf.requests.can_serve_requests`, generates single turns by the
  engine's batch path, with no weights swapped mid-call.)
- ``offer(version, weights)`` stages a newer policy; it is swapped in between two
  engine steps (the engine commits what is launched first, sequences in flight keep
  their KV caches, the tokens drawn after it carry the new version), or at the next
  call when none runs. A call's `CallPolicy` says what a newer policy does to it:
  with ``partial`` its samples go on under the new weights (partial rollouts: each
  token keeps the version that drew it); without, the call keeps the version it
  started with, the swap waits for it (calls that arrive meanwhile wait too, and
  start under the new version), and a call whose samples would then lag the offered
  policy by more than ``max_lag`` versions is aborted (`Aborted`: the caller queues
  its prompts again).
- ``update_weights(weights)`` loads weights now (the hybrid actor's in-place sync,
  between calls), ``sleep`` / ``wake`` free and take back the engine's memory.

On a tensor-parallel native engine every rank of the replica holds a service and
makes the same calls; TP rank 0 runs the episodes and the other ranks follow its
answers (`rayrl.rollout.native.tp_turns`).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np
import torch

from rayrl import progress
from rayrl.batch import Batch
from rayrl.rollout.base import WeightSource
from rayrl.rollout.contract import (
    Responses,
    assemble_output,
    sample_rows,
)
from rayrl.rollout.loop import Job, TurnLoop, responses_of
from rayrl.rollout.requests import RequestEngine
from rayrl.rollout.sampling import SamplingParams
from rayrl.rollout.turns import TurnDriver

if TYPE_CHECKING:
    from rayrl.rollout.agent.rollout import MultiTurnRollout

__all__ = ["Aborted", "CallPolicy", "Generated", "RolloutService"]

AGREE_EVERY = 8  # passes between a tensor-parallel replica's agreements on a staged version


class _Skip(enum.Enum):
    SKIP = enum.auto()


SKIP: Final = _Skip.SKIP  # `_agreed_offer` on a pass without an agreement: nothing changes


class Aborted(Exception):  # noqa: N818 - what happened to the call, not a fault
    """A call stopped because its samples could no longer be trained (`CallPolicy`)."""


@dataclass(frozen=True)
class CallPolicy:
    """What a newer policy, offered while a call runs, does to it (module docstring).

    Args:
        partial: swap it in between steps; the call's samples go on under it.
        max_lag: without ``partial``, abort the call when the offered version is more
            than this many versions ahead of the one it started with (None: never).
    """

    partial: bool = False
    max_lag: int | None = None


@dataclass
class _Call:
    """One `generate` call: its policy and the version its first step ran with."""

    policy: CallPolicy
    first: int | None = None


@dataclass
class Generated:
    """A call's output: the Batch, the policy version of each response token
    (``[rows, R]`` int64), and the versions it started and ended with."""

    batch: Batch
    versions: torch.Tensor
    first_version: int
    last_version: int


class ServedEngine(RequestEngine, Protocol):
    """The engine a service holds (`HFRolloutEngine`, `NativeRolloutEngine`): the request
    API, and of `RolloutEngine` what the service calls (a batch `generate` where the
    engine serves no requests, weights with their version, sleep and wake), with a
    call's preparation and measurement and how it takes the prompts' images."""

    device: Any
    version: int

    @property
    def serves_requests(self) -> bool: ...

    @property
    def is_asleep(self) -> bool: ...

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch: ...

    def prepare_call(
        self,
        prompts: list[np.ndarray],
        keys: np.ndarray,
        limits: np.ndarray,
        sampling: SamplingParams,
        turns: TurnDriver | None,
    ) -> TurnDriver | None: ...

    def measured(self, with_turns: bool) -> AbstractContextManager[dict[str, float]]: ...

    def update_weights(
        self, weights: WeightSource, *, sharded: bool = False, version: int | None = None
    ) -> int: ...

    def prompt_images(
        self, prompts: Batch, token_lists: list[list[int]], sampling: SamplingParams
    ) -> list[Any] | None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class RolloutService:
    """Engine + turn loop + episodes + weight receiver (module docstring).

    Args:
        engine: an engine of the request contract (`HFRolloutEngine`,
            `NativeRolloutEngine`).
        episodes: the multi-turn rollout over ``engine`` (None: single turns only).
        receiver: weights are offered to it between calls and mid-call (`offer`: an
            asynchronous replica); a tensor-parallel receiver's ranks agree on the
            version they swap in.
    """

    def __init__(
        self,
        engine: ServedEngine,
        episodes: MultiTurnRollout | None = None,
        receiver: bool = False,
    ) -> None:
        self.engine = engine
        self.episodes = episodes
        self.receiver = receiver  # offered weights mid-call (an asynchronous replica)
        self._passes = 0
        self.loop = TurnLoop(engine, between_steps=self._between_steps)
        self._offer_lock = threading.Lock()
        self._offers: dict[int, Iterable] = {}  # staged versions, not yet swapped in
        self._calls: dict[int, _Call] = {}  # job id -> its call
        self.swap_s = 0.0  # seconds spent swapping offered versions in, in all

    def holds(self, engine: object) -> bool:
        """Whether ``engine`` is the one this service serves (a rebuilt worker's is not)."""
        return self.engine is engine

    # ------------------------------------------------------------------ calls
    def generate(
        self, prompts: Batch, sampling: SamplingParams, policy: CallPolicy | None = None
    ) -> Generated:
        """``sampling.n`` samples (or episodes) per prompt (module docstring).

        Raises:
            Aborted: a newer policy made the call's samples too stale (`CallPolicy`).
        """
        call = _Call(policy or CallPolicy())
        done: dict[str, Responses] = {}

        def decode(token_lists, sampling_, keys, driver, images=None) -> Responses:
            done["out"] = self._decode(token_lists, sampling_, keys, driver, call, images)
            return done["out"]

        if self.episodes is not None:
            batch = self.episodes.generate(prompts, sampling, decode)
        elif not self.engine.serves_requests:  # its batch path: no weights mid-call
            batch = self.engine.generate(prompts, sampling)
        else:
            batch = self._single_turns(prompts, sampling, decode)
        first = self.version if call.first is None else call.first
        width = batch["responses"].shape[1]
        versions = _versions(done.get("out"), len(batch), width, first)
        return Generated(batch, versions, first, self.version)

    def serve(
        self, token_lists: list[list[int]], sampling: SamplingParams, keys: np.ndarray
    ) -> Responses:
        """One request's samples: token-id prompts, ``sampling.n`` samples each, one
        sampler key per sample, as a job of the shared loop, so that requests served
        from several threads at once (an OpenAI-compatible server's,
        `rayrl.rollout.chat_server`) share the engine's steps."""
        if not self.engine.serves_requests:
            raise RuntimeError(
                f"{type(self.engine).__name__} cannot serve requests for this model (an HF "
                "model needs cache=dynamic and a decoder without sliding windows)"
            )
        return self._decode(token_lists, sampling, np.asarray(keys), None, _Call(CallPolicy()))

    def _single_turns(self, prompts: Batch, sampling: SamplingParams, decode) -> Batch:
        samples = sample_rows(prompts, sampling.n, sampling.seed, "RolloutService.generate")
        token_lists = samples.token_lists()
        images = self.engine.prompt_images(prompts, token_lists, sampling)  # None: text
        out = decode(token_lists, sampling, samples.keys.numpy(), None, images)
        width, pad = sampling.max_new_tokens, self.engine.pad_id
        return assemble_output(samples.rows, samples.uids, out, width, pad)

    def _decode(
        self,
        token_lists: list[list[int]],
        sampling: SamplingParams,
        keys: np.ndarray,
        driver: TurnDriver | None,
        call: _Call,
        images: list | None = None,
    ) -> Responses:
        """One job on the shared loop: the samples' responses (every turn); ``images``:
        per prompt, its images as the engine takes them (`RolloutEngine.prompt_images`)."""
        engine = self.engine
        arrays = [np.asarray(p, dtype=np.int64) for p in token_lists]
        limits = np.full(len(arrays) * sampling.n, sampling.max_new_tokens, dtype=np.int64)
        driver = engine.prepare_call(arrays, np.asarray(keys), limits, sampling, driver)
        job = Job(arrays, keys, limits, sampling, driver, images)
        with engine.measured(with_turns=driver is not None) as timing:
            before = dict(self.loop.stats)
            self._calls[id(job)] = call
            try:
                self.loop.run(job)
            finally:
                self._calls.pop(id(job), None)
            timing.update({k: v - before.get(k, 0.0) for k, v in self.loop.stats.items()})
        if job.aborted:
            raise Aborted(
                f"the call's samples would lag the offered policy by more than "
                f"{call.policy.max_lag} version(s)"
            )
        return responses_of(job.results())

    # ---------------------------------------------------------------- weights
    @property
    def version(self) -> int:
        """The policy version the engine's weights are."""
        return self.engine.version

    def offer(self, version: int, weights: Iterable) -> None:
        """Stage policy ``version`` (``(name, tensor)`` pairs, read when swapped in).
        Versions arrive in order; a swap takes the newest staged one (on a
        tensor-parallel replica, the newest every rank has) and drops the older."""
        with self._offer_lock:
            self._offers[int(version)] = weights

    @property
    def offered(self) -> int | None:
        """The newest staged version not yet swapped in (None: none)."""
        with self._offer_lock:
            return max(self._offers, default=None)

    def swap(self, version: int | None = None) -> bool:
        """Swap staged ``version`` (default: the newest) in now, between engine steps;
        the older staged ones are dropped. True if one was staged."""
        with self._offer_lock:
            version = max(self._offers, default=None) if version is None else version
            weights = self._offers.pop(version, None) if version is not None else None
            for older in [v for v in self._offers if v < (version or 0)]:
                del self._offers[older]
        if weights is None:
            return False
        if version != self.version:
            start = time.perf_counter()
            with progress.phase("weight_sync"):
                self.engine.update_weights(weights, version=version)
            self.swap_s += time.perf_counter() - start
        return True

    def _agreed_offer(self) -> int | _Skip | None:
        """The staged version to act on: the newest one, or on a tensor-parallel
        replica the newest every rank has staged, so that all ranks swap together: one
        small all-reduce at the same pass on every rank (their loops run in lockstep),
        every `AGREE_EVERY` passes and when a call starts (a receiver only: the hybrid
        worker's service is never offered weights, and pays nothing)."""
        offered = self.offered
        tp = getattr(self.engine, "tp", None)
        if tp is None or not self.receiver:
            return offered
        self._passes += 1
        starting = any(self._calls[id(job)].first is None for job in self.loop.jobs)
        if self._passes % AGREE_EVERY and not starting:
            return SKIP
        import torch.distributed as dist

        # versions reach every rank in order, and swaps happen on all ranks together, so
        # the oldest of the ranks' newest staged versions is staged on every rank
        mine = torch.tensor([-1 if offered is None else offered], device=self.engine.device)
        common = int(tp.all_reduce(mine, dist.ReduceOp.MIN).item())
        return common if common >= 0 else None

    def update_weights(self, weights: WeightSource, **kwargs: Any) -> int:
        """Load weights now, between calls (the hybrid actor's sync)."""
        return self.engine.update_weights(weights, **kwargs)

    def _between_steps(self) -> None:
        """The pumping thread, between two engine steps: abort the calls a staged
        version makes too stale, swap it in unless a started call pins the version it
        began with, and record the version each call starts with."""
        offered = self._agreed_offer()
        if offered is SKIP:  # a tensor-parallel replica's pass without an agreement
            pass
        elif offered is not None:
            pinned = False
            for job in self.loop.jobs:
                call = self._calls[id(job)]
                if call.first is None or call.policy.partial:
                    continue  # not started (it starts under the new version), or partial
                if call.policy.max_lag is not None and offered - call.first > call.policy.max_lag:
                    self.loop.abort(job)
                else:
                    pinned = True
            if not pinned:
                self.swap(offered)
            # a version waits for the calls that pin the old one: new calls wait for it
            self.loop.holding = pinned
        else:
            self.loop.holding = False
        for job in self.loop.jobs:
            call = self._calls[id(job)]
            if call.first is None:
                call.first = self.version

    # ----------------------------------------------------------------- memory
    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    @property
    def is_asleep(self) -> bool:
        return self.engine.is_asleep


def _versions(out: Responses | None, rows: int, width: int, first: int) -> torch.Tensor:
    """``[rows, width]`` the version of each response token (padding: the row's first)."""
    versions = torch.full((rows, width), first, dtype=torch.int64)
    if out is None or out.versions is None or not rows:
        return versions
    steps = min(out.versions.shape[1], width)
    versions[:, :steps] = out.versions[:, :steps]
    past = torch.arange(width)[None, :] >= out.lengths.clamp(max=width)[:, None]
    return torch.where(past, versions[:, :1], versions)
