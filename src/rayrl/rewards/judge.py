"""Scoring with an LLM judge over its OpenAI-compatible server.

Two ways, as the config chooses (`rayrl.config.judge`):

- **verl's generative reward model**: the user's `compute_score` is called with the
  extra arguments `reward_router_address` (the judge server's "host:port") and
  `reward_model_tokenizer` (the judge's tokenizer), each only if its signature takes it
  by name or takes ``**kwargs`` (`genrm_kwargs`); the function posts to
  ``http://{reward_router_address}/v1/chat/completions`` itself, so a verl GenRM reward
  file runs unchanged (an ``async def`` one too: `rayrl.rewards.pool` awaits it).
- **the built-in judge** (`LLMJudge`, no user code): each sample's question (the
  prompt's last user message), response and ground truth fill `reward.judge.template`,
  the judge answers, and a verdict parser (`rayrl.rewards.verdicts`) reads the score. A
  verdict it cannot read, or a request that fails, is a reward error: it scores 0, is
  counted against `reward.max_error_rate` and quoted when the run stops.

Every result of a judged scoring carries its judge figures as extras under `judge/`
(`judge/score`, `judge/parse_failures` for the built-in judge; the server's
`judge/tokens_per_s`, `judge/latency_s`, `judge/batch` for both), which `judge_metrics`
turns into the step's `judge/*` metrics.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rayrl.json_post import BadReply, PostFailed, post_json
from rayrl.rewards.result import RewardResult
from rayrl.rewards.verdicts import VerdictError, VerdictParser

__all__ = [
    "GENRM_KWARGS",
    "JUDGE_FIELDS",
    "LLMJudge",
    "genrm_kwargs",
    "judge_metrics",
    "question_of",
    "render_template",
]

GENRM_KWARGS = ("reward_router_address", "reward_model_tokenizer")
JUDGE_FIELDS = ("question", "response", "ground_truth")
PREFIX = "judge/"


def genrm_kwargs(fn: Callable[..., Any], address: str, tokenizer: Any) -> dict[str, Any]:
    """verl's extra arguments of a generative reward model's `compute_score`, those its
    signature takes (by name, or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    values = {"reward_router_address": address, "reward_model_tokenizer": tokenizer}
    return {k: v for k, v in values.items() if takes_all or k in params}


def question_of(prompt: Any) -> str:
    """The question a prompt asks: its last user message (chat messages), or the text."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(list(prompt or [])):
        if isinstance(message, dict) and message.get("role") == "user":
            return str(message.get("content", ""))
    return ""


def render_template(template: str, item: dict[str, Any]) -> str:
    """`template` with {question}, {response} and {ground_truth} filled from a reward
    item; other braces are left as they are (a template may show JSON)."""
    values = {
        "question": question_of(item.get("prompt")),
        "response": str(item.get("solution_str", "")),
        "ground_truth": str(item.get("ground_truth", "")),
    }
    out = template
    for name in JUDGE_FIELDS:
        out = out.replace("{" + name + "}", values[name])
    return out


class LLMJudge:
    """The built-in judge as a reward source (module docstring).

    Args:
        address: the judge server's "host:port".
        template: the judge prompt (`render_template`).
        parser: a verdict parser (`rayrl.rewards.verdicts.make_parser`).
        system: a system message, or None.
        max_tokens, temperature: each verdict's sampling.
        concurrency: requests in flight at once (the server batches them).
        timeout_s: one request's limit.
    """

    def __init__(
        self,
        address: str,
        template: str,
        parser: VerdictParser,
        *,
        system: str | None = None,
        max_tokens: int = 32,
        temperature: float = 0.0,
        concurrency: int = 64,
        timeout_s: float = 120.0,
    ) -> None:
        self.url = f"http://{address}/v1/chat/completions"
        self.template, self.parser, self.system = template, parser, system
        self.max_tokens, self.temperature = max_tokens, temperature
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="judge")
        self.calls = self.parse_failures = self.request_failures = 0

    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        results = list(self._pool.map(self._judge, items))
        self.calls += len(items)
        return results

    def _judge(self, item: dict[str, Any]) -> RewardResult:
        messages = [{"role": "user", "content": render_template(self.template, item)}]
        if self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        body = {
            "model": "judge",
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        started = time.perf_counter()
        try:
            reply = post_json(
                self.url,
                json.dumps(body).encode(),
                timeout_s=self.timeout_s,
                retries=1,
                backoff_s=0.5,
            )
            verdict = str(reply["choices"][0]["message"]["content"])
        except (PostFailed, BadReply, KeyError, IndexError, TypeError) as exc:
            self.request_failures += 1
            return RewardResult(
                0.0, {}, f"judge request to {self.url} failed: {exc}", time.perf_counter() - started
            )
        elapsed = time.perf_counter() - started
        try:
            score = self.parser(verdict)
        except VerdictError as exc:
            self.parse_failures += 1
            return RewardResult(0.0, {f"{PREFIX}parse_failures": 1.0}, str(exc), elapsed)
        return RewardResult(
            score, {f"{PREFIX}score": score, f"{PREFIX}parse_failures": 0.0}, None, elapsed
        )

    def stats(self) -> dict[str, int]:
        return {
            "calls": self.calls,
            "parse_failures": self.parse_failures,
            "request_failures": self.request_failures,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def judge_metrics(results: list[RewardResult]) -> dict[str, float]:
    """The step's `judge/*` metrics from its results' `judge/` extras: the judge's score
    distribution over the verdicts read (mean, min, max, std), the fraction of verdicts
    that could not be read, and the server's figures (means over the scorings)."""
    values: dict[str, list[float]] = {}
    for result in results:
        for key, value in result.extra.items():
            if key.startswith(PREFIX) and isinstance(value, int | float):
                values.setdefault(key, []).append(float(value))
    out: dict[str, float] = {}
    for key, vals in values.items():
        mean = sum(vals) / len(vals)
        if key != f"{PREFIX}score":
            out[key] = mean
            continue
        out |= {f"{key}/mean": mean, f"{key}/min": min(vals), f"{key}/max": max(vals)}
        out[f"{key}/std"] = (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5
    return out
