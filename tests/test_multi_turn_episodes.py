"""The multi-turn driver's turn thread: every ended turn gets exactly one answer, also
when environment steps outlast the thread's idle time (it ends, and the next piece of
work starts it again)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from rayrl.envs import Environment, Episode, StepResult
from rayrl.models.tiny import build_tiny_model
from rayrl.rollout.agent import episodes as multi_turn_episodes
from rayrl.rollout.agent.episodes import Episodes, EpisodeState
from rayrl.rollout.agent.format import TurnFormat


class SlowTool(Environment):
    """Every turn is one call of ``latency_s``; the episode ends after ``calls`` calls."""

    def reset(self, episode) -> None:
        super().reset(episode)
        self.calls = 0

    def step(self, conversation, message: str) -> StepResult:
        if self.calls >= self.config["calls"]:
            return StepResult(done=True)
        self.calls += 1
        time.sleep(self.config["latency_s"])
        return StepResult([{"role": "tool", "content": f"call {self.calls}"}])


@pytest.fixture(scope="module")
def fmt(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("episodes") / "tiny", vocab_size=320)
    return TurnFormat(AutoTokenizer.from_pretrained(path))


def episodes_of(fmt: TurnFormat, count: int, latency_s: float, calls: int) -> Episodes:
    states = []
    for i in range(count):
        env = SlowTool(config={"latency_s": latency_s, "calls": calls})
        env.reset(Episode(f"u{i}", [{"role": "user", "content": "hi"}], {}, {}, None))
        states.append(EpisodeState(env, [{"role": "user", "content": "hi"}]))
    return Episodes(
        states,
        fmt,
        eos_ids=[],
        width=4096,
        max_assistant_turns=None,
        max_user_turns=None,
        env_timeout_s=30.0,
    )


def test_turn_thread_restarts_after_idle(fmt, monkeypatch):
    monkeypatch.setattr(multi_turn_episodes, "IDLE_S", 0.05)
    episodes = episodes_of(fmt, count=1, latency_s=0.3, calls=2)
    response = np.arange(10, 20, dtype=np.int64)
    for turn in range(3):
        episodes.turn_ended(0, response.copy())
        answers = episodes.take_ready(wait=True)
        assert [a.sample for a in answers] == [0]
        if turn < 2:  # a tool's observation, then the next turn's sampled tokens
            assert answers[0].tokens
            response = np.concatenate([response, answers[0].tokens, [30, 31]])
        else:
            assert answers[0].tokens is None and answers[0].stopped
        deadline = time.perf_counter() + 5.0
        while episodes._turn_thread_alive and time.perf_counter() < deadline:
            time.sleep(0.02)
        assert not episodes._turn_thread_alive  # idle: it ended, the next turn restarts it
    assert episodes.states[0].user_turns == 2
    assert episodes.turns_handled == 3


def test_every_turn_gets_one_answer(fmt):
    count = 48
    episodes = episodes_of(fmt, count=count, latency_s=0.01, calls=1)
    for sample in range(count):
        episodes.turn_ended(sample, np.arange(5, 9 + sample % 3, dtype=np.int64))
    answers = []
    while len(answers) < count:
        answers += episodes.take_ready(wait=True)
    assert sorted(a.sample for a in answers) == list(range(count))
    assert all(a.tokens for a in answers)
    assert episodes.take_ready(wait=False) == []
