"""The episodes of a multi-turn rollout: the `TurnDriver` both engines talk to.

`Episodes` holds one `EpisodeState` per sample: its environment, its conversation,
where its current turn starts, the spans of tokens appended to its response, its
turn counts. When an engine reports that a sample's turn ended, `Episodes.turn_ended`
queues it and returns at once (the engine's loop does no per-turn work: no
detokenising, no thread start). One *turn thread* does all the per-turn work, in
the order it comes: it decodes the turn's sampled tokens and hands ``env.step`` to a
worker thread (under the environment timeout); the worker only runs the step and
queues its outcome back to the turn thread, which turns it into the tokens to append
(`TurnFormat`), or into the end of the episode, queued for the engine's `take_ready`.
The tokenizer is used by that one thread only (no lock contended by hundreds of tool
threads), and the threads hand work over through lock-free queues: Python work on
other threads takes the GIL from the engine's loop, which on a GPU is what paces the
steps. A step that raises or times out ends its episode, counted; it never stops the
rollout or loses the sample.

An episode ends (finish reason ``stop``) when the environment says so (a message with
no tool call, for the tool environment), at ``max_assistant_turns`` assistant turns or
``max_user_turns`` observations (verl's limits); it ends with ``length`` when the
observation would leave no room for another sampled token in the response limit (the
context limit: prompt plus response). The engine ends it with ``length`` when the
response limit cuts a turn short.

Each episode keeps its own record of its response, piece by piece: the tokens of every
turn as the engine reported them, and every observation's tokens as appended
(`EpisodeState.record`). An observation that shows images (a tool's image, for a
vision-language model) appends them with its tokens: the episode keeps their pixel
inputs and the response columns of their placeholders (`EpisodeState.images`,
``image_columns``), for the training forwards. The trainer compares it with the tokens it trains on
(``rollout/token_mismatch``). While any environment step runs, the process's progress
phase is ``tools`` (`rayrl.progress`: the worker's heartbeat shows it).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayrl import progress
from rayrl.envs import Environment, StepResult, ToolRunner
from rayrl.envs.runner import CallOutcome
from rayrl.rollout.agent.format import TurnFormat
from rayrl.rollout.turns import Continuation

__all__ = ["EpisodeState", "Episodes"]

IDLE_S = 2.0  # the turn thread ends after this long with nothing to do (restarted on demand)
EVENT_KEYS = (
    "malformed",
    "unknown_tool",
    "invalid_arguments",
    "skipped",
    "env_errors",
    "env_timeouts",
    "truncated_observations",
)


@dataclass
class EpisodeState:
    """One sample's episode (see the module docstring)."""

    env: Environment | None
    conversation: list[dict[str, Any]]
    turn_start: int = 0
    recorded_until: int = 0
    appended: list[tuple[int, int]] = field(default_factory=list)  # (column, count)
    assistant_turns: int = 0
    user_turns: int = 0
    turn_scores: list[float] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVENT_KEYS, 0))
    errors: list[str] = field(default_factory=list)
    record: list[tuple[np.ndarray, bool]] = field(default_factory=list)  # (tokens, sampled)
    images: list[dict] = field(default_factory=list)  # the observations' pixel inputs
    image_columns: list[int] = field(default_factory=list)  # their placeholders' columns

    def recorded(self) -> tuple[np.ndarray, np.ndarray]:
        """The response as recorded piece by piece: its tokens, and 1 where sampled."""
        if not self.record:
            return np.zeros(0, np.int64), np.zeros(0, np.uint8)
        tokens = np.concatenate([np.asarray(t, np.int64) for t, _ in self.record])
        sampled = np.concatenate([np.full(len(t), int(s), np.uint8) for t, s in self.record])
        return tokens, sampled


class Episodes:
    """The `TurnDriver` of one rollout call (see the module docstring).

    Args:
        states: one per sample (output row).
        fmt: the chat format of appended tokens.
        eos_ids: ids that end a turn as EOS (their text is not repeated when closing it).
        width: the response length limit (columns).
        max_assistant_turns / max_user_turns: verl's limits (None: none).
        env_timeout_s: the longest an environment step (all its tool calls) may take.
    """

    def __init__(
        self,
        states: Sequence[EpisodeState],
        fmt: TurnFormat,
        *,
        eos_ids: Sequence[int],
        width: int,
        max_assistant_turns: int | None,
        max_user_turns: int | None,
        env_timeout_s: float,
    ) -> None:
        self.states = list(states)
        self.fmt, self.eos_ids, self.width = fmt, {int(i) for i in eos_ids}, width
        self.max_assistant_turns, self.max_user_turns = max_assistant_turns, max_user_turns
        self.env_timeout_s = env_timeout_s
        self.runner = ToolRunner(
            max_concurrency=max(1, len(self.states)), default_timeout_s=env_timeout_s
        )
        self._ready: queue.SimpleQueue[Continuation] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()  # the turn thread's work
        self._turn_thread_alive = False
        self._lock = threading.Lock()
        self._busy, self._busy_since, self.busy_s = 0, 0.0, 0.0
        # the `tools` progress phase while steps run
        self._phase: AbstractContextManager[None] | None = None
        self.turns_handled = 0

    # ------------------------------------------------------------ TurnDriver
    def turn_ended(self, sample: int, response: np.ndarray) -> None:
        """A sample's turn ended; ``response`` is its whole response so far (the driver
        keeps it: pass a copy). Returns at once; the turn is handled on the turn
        thread."""
        self._post((self._handle_turn, sample, response))

    # ------------------------------------------------------------ the turn thread
    def _post(self, work: tuple) -> None:
        """Queue ``(function, *args)`` for the turn thread; start it if it is not running."""
        self._inbox.put(work)
        with self._lock:
            if self._turn_thread_alive:
                return
            self._turn_thread_alive = True
        threading.Thread(target=self._turn_loop, name="rayrl-turns", daemon=True).start()

    def _turn_loop(self) -> None:
        """Run queued turn work in order; end after `IDLE_S` idle (`_post` restarts it:
        it queues before it looks, and the loop looks at the queue before it ends)."""
        while True:
            try:
                fn, *args = self._inbox.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._inbox.empty():
                        self._turn_thread_alive = False
                        return
                continue
            fn(*args)

    def _handle_turn(self, sample: int, response: np.ndarray) -> None:
        try:
            self._start_step(sample, response)
        except Exception as err:  # never leave the engine waiting for this sample
            self.states[sample].errors.append(f"turn driver: {type(err).__name__}: {err}")
            self.states[sample].events["env_errors"] += 1
            self._ready.put(Continuation(sample, None, True))

    def _start_step(self, sample: int, response: np.ndarray) -> None:
        state = self.states[sample]
        length = len(response)
        turn = response[state.turn_start : length]
        text = self.fmt.decode(turn)
        last = int(turn[-1]) if len(turn) else None
        state.assistant_turns += 1
        state.recorded_until = length
        state.record.append((np.array(turn, dtype=np.int64), True))
        limit = self.max_assistant_turns
        if state.env is None or (limit is not None and state.assistant_turns >= limit):
            state.conversation.append({"role": "assistant", "content": text})
            self._ready.put(Continuation(sample, None, True))
            return
        self._started()
        env, conversation = state.env, [*state.conversation, _said(text)]
        future = self.runner.submit(lambda: env.step(conversation, text), name="env-step")
        future.add_done_callback(
            lambda f: self._post((self._answer, sample, text, last, length, f.result()))
        )

    def take_ready(self, wait: bool) -> list[Continuation]:
        """The answers ready now; with ``wait``, block for at least one."""
        answers = []
        if wait:
            guard = self.env_timeout_s + 120.0  # a step always resolves by its timeout
            try:
                answers.append(self._ready.get(timeout=guard))
            except queue.Empty:
                raise RuntimeError(
                    f"multi-turn rollout: no environment step finished within {guard:.0f} s "
                    "although one was running; this is a bug in the turn driver."
                ) from None
        while True:
            try:
                answers.append(self._ready.get_nowait())
            except queue.Empty:
                return answers

    # ------------------------------------------------------------ a step's answer
    def _answer(self, sample: int, text: str, last: int | None, length: int, outcome) -> None:
        try:
            answer = self._continuation(sample, text, last, length, outcome)
        except Exception as err:  # never leave the engine waiting for this sample
            self.states[sample].errors.append(f"turn driver: {type(err).__name__}: {err}")
            self.states[sample].events["env_errors"] += 1
            answer = Continuation(sample, None, True)
        finally:
            self._finished()
        self._ready.put(answer)

    def _continuation(
        self, sample: int, text: str, last: int | None, length: int, outcome: CallOutcome
    ) -> Continuation:
        state = self.states[sample]
        result = self._step_result(state, outcome)
        state.conversation.append((result.assistant if result else None) or _said(text))
        if result is None:
            return Continuation(sample, None, True)
        if result.reward is not None:
            state.turn_scores.append(float(result.reward))
        messages = result.messages()
        limit = self.max_user_turns
        if result.done or not messages or (limit is not None and state.user_turns >= limit):
            return Continuation(sample, None, True)
        observation = self.fmt.observation(messages, last if last in self.eos_ids else None)
        if length + len(observation.tokens) >= self.width:
            return Continuation(sample, None, False)  # no room: the context limit
        state.user_turns += 1
        state.appended.append((length, len(observation.tokens)))
        state.record.append((np.array(observation.tokens, dtype=np.int64), False))
        state.turn_start = length + len(observation.tokens)
        state.conversation.extend(observation.messages)
        state.events["truncated_observations"] += observation.truncated
        if observation.images is not None:
            state.images.append(observation.images.inputs)
            state.image_columns.extend(int(length + o) for o in observation.images.offsets)
        return Continuation(sample, observation.tokens, images=observation.images)

    def _step_result(self, state: EpisodeState, outcome: CallOutcome) -> StepResult | None:
        if outcome.timed_out:
            state.events["env_timeouts"] += 1
            state.errors.append(f"environment step timed out after {self.env_timeout_s:g} s")
            return None
        if outcome.error is not None:
            state.events["env_errors"] += 1
            state.errors.append(
                f"environment step: {type(outcome.error).__name__}: {outcome.error}"
            )
            return None
        if not isinstance(outcome.value, StepResult):
            state.events["env_errors"] += 1
            state.errors.append(
                f"environment step returned {type(outcome.value).__name__}, not a StepResult"
            )
            return None
        return outcome.value

    # --------------------------------------------------------------- timing
    def _started(self) -> None:
        with self._lock:
            if self._busy == 0:
                self._busy_since = time.perf_counter()
                self._phase = progress.phase("tools")
                self._phase.__enter__()
            self._busy += 1

    def _finished(self) -> None:
        with self._lock:
            self._busy -= 1
            self.turns_handled += 1
            if self._busy == 0:
                self.busy_s += time.perf_counter() - self._busy_since
                assert self._phase is not None  # entered by `_started` as _busy left 0
                self._phase.__exit__(None, None, None)
                self._phase = None

    # --------------------------------------------------------------- the end
    def finish(self, sample: int, response: np.ndarray) -> np.ndarray:
        """Record a sample's last turn if the engine cut it; return its response mask
        (1 on sampled tokens, 0 on appended ones), as long as ``response``."""
        state = self.states[sample]
        length = len(response)
        if length > max(state.turn_start, state.recorded_until):
            state.assistant_turns += 1
            state.recorded_until = length
            tail = np.array(response[state.turn_start : length], dtype=np.int64)
            state.record.append((tail, True))
            state.conversation.append(_said(self.fmt.decode(tail)))
        mask = np.ones(length, dtype=np.int64)
        for start, count in state.appended:
            mask[start : start + count] = 0
        return mask


def _said(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}
