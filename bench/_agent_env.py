"""Agent workloads for benchmarks and fault tests on random-weight models.

A random model never writes a valid tool call, so these workloads take the model out
of the loop: `LatencyEnvironment` treats every assistant turn as one tool call that
takes `latency_s` (a sleep, as a remote tool's round trip would) and answers with a
fixed observation, for up to `calls` calls per episode, then ends it. It is loaded
by path (`agent.default_agent_loop=/path/bench/_agent_env.py:LatencyEnvironment`,
settings in `multi_turn.environment_config`) or passed as a class.

`end_turns_often(model_dir, share)` makes a random model end its turns often: the ids
of a `share` of its vocabulary become EOS ids in its `generation_config.json` (a random
model's next-token distribution is near uniform, so a turn lasts about 1/share
tokens). Both are deterministic: an episode replays exactly.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from rayrl.envs import Environment, StepResult

ENVIRONMENT = "LatencyEnvironment"


class LatencyEnvironment(Environment):
    """Every turn is a tool call of `latency_s` seconds; `calls` of them an episode.

    A long tail: ``latency_s`` may be a range ``[low, high]`` (each call's latency drawn
    from it, log-uniformly) and ``calls`` a range ``[fewest, most]`` (each episode's
    count drawn from it), both seeded by the episode's uid and the call's index, so an
    episode replays exactly."""

    def reset(self, episode) -> None:
        super().reset(episode)
        self.calls = 0
        self.uid = str(episode.sample_uid)
        self.most = int(round(_drawn(self.config.get("calls", 4), self.uid, "calls", False)))

    def step(self, conversation: list[dict[str, Any]], message: str) -> StepResult:
        if self.calls >= self.most:
            return StepResult(done=True)
        self.calls += 1
        latency = self.config.get("latency_s", 0.05)
        time.sleep(_drawn(latency, self.uid, f"latency{self.calls}", True))
        text = str(self.config.get("observation", "tool result 42"))
        return StepResult([{"role": "tool", "name": "bench_tool", "content": text}])


def _drawn(value: Any, uid: str, what: str, log: bool) -> float:
    """``value``, or for a ``[low, high]`` range a draw from it seeded by (uid, what):
    uniform, or log-uniform with ``log``."""
    if not isinstance(value, list | tuple):
        return float(value)
    low, high = float(value[0]), float(value[1])
    digest = hashlib.blake2b(f"{uid}/{what}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "little") / 2.0**64
    if log and low > 0:
        return low * (high / low) ** u
    return low + (high - low) * u


def end_turns_often(model_dir: str, share: float) -> list[int]:
    """Make every `1 / share`-th id of the model's vocabulary an EOS id; returns them."""
    from transformers import AutoConfig, GenerationConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    config = GenerationConfig.from_pretrained(model_dir)
    step = max(1, round(1 / share))
    ids = list(range(3, vocab, step))
    config.eos_token_id = ids
    config.save_pretrained(model_dir)
    return ids
