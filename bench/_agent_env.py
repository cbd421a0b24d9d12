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

import time
from typing import Any

from rayrl.envs import Environment, StepResult

ENVIRONMENT = "LatencyEnvironment"


class LatencyEnvironment(Environment):
    """Every turn is a tool call of `latency_s` seconds; `calls` of them an episode."""

    def reset(self, episode) -> None:
        super().reset(episode)
        self.calls = 0

    def step(self, conversation: list[dict[str, Any]], message: str) -> StepResult:
        if self.calls >= int(self.config.get("calls", 4)):
            return StepResult(done=True)
        self.calls += 1
        time.sleep(float(self.config.get("latency_s", 0.05)))
        text = str(self.config.get("observation", "tool result 42"))
        return StepResult([{"role": "tool", "name": "bench_tool", "content": text}])


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
