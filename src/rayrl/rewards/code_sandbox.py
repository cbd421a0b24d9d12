"""Code samples scored on a SandboxFusion server (``reward.sandbox_fusion.url``), the
others by the built-in scorers, as verl's default reward does.

With ``reward.sandbox_fusion.url`` set and no reward function of one's own (verl uses
the server only then), `with_code_sandbox` puts `CodeSandboxReward` in front of the
reward manager's scorer: the samples of the code data sources
(`rayrl.rewards.code_tests.CODE_SOURCES`) run their code against their test cases on
the server, by verl's rules (`rayrl.rewards.code_tests`: the fraction of the first 10
cases passed); every other sample goes to the manager's scorer as before. Each case
is one ``run_code`` request (Python, 10 s to run, ``reward.sandbox_fusion.
memory_limit_mb`` of memory); the requests of a scoring run in threads,
``reward.sandbox_fusion.max_concurrent`` at once at most (per reward worker).

A sample fails (score 0 with the reason, counted against ``reward.max_error_rate``)
when its ground truth holds no test cases, when the server cannot run one of its
cases (``SandboxError``), or when the server cannot be reached: then, after the
client's retries, every case still to run in that scoring fails at once instead of
retrying again. Without a URL the code data sources are refused with what to set
(`rayrl.rewards.code_tests.needs_sandbox`), where verl would run them locally.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rayrl.rewards.code_tests import (
    CODE_SOURCES,
    SCORED_CASES,
    TestCases,
    case_passed,
    case_program,
    extract_code,
    parse_test_cases,
)
from rayrl.rewards.managers import NumberAsAcc
from rayrl.rewards.result import RewardResult, failed
from rayrl.rewards.source import RewardSource
from rayrl.sandbox_fusion import SandboxFusion, SandboxFusionError

__all__ = ["CodeSandboxReward", "with_code_sandbox"]

CASE_TIMEOUT_S = 10.0  # compile and run time of each case (verl's)


@dataclass
class _Sample:
    """One code sample's work: its code, its cases (the first `SCORED_CASES`), and per
    case (each written by the one thread that runs it) its verdict, its error and when
    it ran."""

    code: str
    cases: TestCases
    passed: list[bool]
    errors: list[str | None]
    spans: list[tuple[float, float] | None]

    @classmethod
    def of(cls, code: str, cases: TestCases) -> _Sample:
        n = min(len(cases), SCORED_CASES)
        return cls(code, cases, [False] * n, [None] * n, [None] * n)

    def result(self) -> RewardResult:
        """The fraction of its cases passed, or the first case's error."""
        spans = [span for span in self.spans if span is not None]
        elapsed = max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0
        error = next((e for e in self.errors if e is not None), None)
        if error is not None:
            return failed(error, elapsed)
        return RewardResult(score=sum(self.passed) / len(self.passed), elapsed_s=elapsed)


class CodeSandboxReward:
    """Score code samples on ``client``'s server and the rest with ``rest`` (module
    docstring); `score`, `stats` and `close` as every reward source. ``case_timeout_s``
    bounds each case's compilation and its run (verl's 10 s)."""

    def __init__(
        self, client: SandboxFusion, rest: RewardSource, case_timeout_s: float = CASE_TIMEOUT_S
    ) -> None:
        self.client, self.rest, self.case_timeout_s = client, rest, case_timeout_s
        self.calls = self.errors = 0

    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        is_code = [item.get("data_source") in CODE_SOURCES for item in items]
        code = [item for item, c in zip(items, is_code, strict=True) if c]
        others = [item for item, c in zip(items, is_code, strict=True) if not c]
        scored = iter(self._score_code(code))
        rest = iter(self.rest.score(others) if others else [])
        results = [next(scored) if c else next(rest) for c in is_code]
        self.calls += len(code)
        self.errors += sum(not r.ok for r, c in zip(results, is_code, strict=True) if c)
        return results

    def _score_code(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        samples: list[_Sample | RewardResult] = [self._sample(item) for item in items]
        work = [(s, j) for s in samples if isinstance(s, _Sample) for j in range(len(s.passed))]
        if work:
            down = threading.Event()  # the server failed us: the remaining cases fail at once
            workers = min(len(work), self.client.max_concurrent)
            with ThreadPoolExecutor(workers, thread_name_prefix="sandbox-fusion") as pool:
                list(pool.map(lambda task: self._run_case(task[0], task[1], down), work))
        return [s if isinstance(s, RewardResult) else s.result() for s in samples]

    def _sample(self, item: dict[str, Any]) -> _Sample | RewardResult:
        """The sample's work, or its result when no case needs to run."""
        try:
            cases = parse_test_cases(item.get("ground_truth"))
        except ValueError as err:
            return failed(str(err))
        code = extract_code(str(item.get("solution_str") or ""))
        if code is None:  # no code block: verl's score 0, the answer's fault
            return RewardResult(score=0.0)
        return _Sample.of(code, cases)

    def _run_case(self, sample: _Sample, index: int, down: threading.Event) -> None:
        if down.is_set():
            sample.errors[index] = (
                f"SandboxFusion at {self.client.url} failed earlier in this scoring"
            )
            return
        program, stdin = case_program(sample.code, sample.cases, index)
        start = time.monotonic()
        try:
            timeout = self.case_timeout_s
            run = self.client.run_code(
                program, stdin=stdin, run_timeout=timeout, compile_timeout=timeout
            )
        except SandboxFusionError as err:
            down.set()
            sample.errors[index] = str(err)
            return
        finally:
            sample.spans[index] = (start, time.monotonic())
        if run.outcome == "sandbox_error":
            sample.errors[index] = f"SandboxFusion could not run test case {index}: {run.message}"
            return
        expected = sample.cases.outputs[index]
        sample.passed[index] = run.outcome == "success" and case_passed(run.stdout, expected)

    def stats(self) -> dict[str, Any]:
        stats = getattr(self.rest, "stats", None)
        inner = stats() if callable(stats) else {}
        return {
            **inner,
            "code_calls": self.calls,
            "code_errors": self.errors,
            "sandbox_requests": self.client.requests,
            "sandbox_retried": self.client.retried,
        }

    def close(self) -> None:
        close = getattr(self.rest, "close", None)
        if callable(close):
            close()


def with_code_sandbox(scorer: RewardSource, client: SandboxFusion) -> RewardSource:
    """``scorer`` (a reward manager's) with the code samples scored on ``client``'s
    server; under the DAPO manager their scores are reported as ``acc`` too."""
    if isinstance(scorer, NumberAsAcc):
        return NumberAsAcc(CodeSandboxReward(client, scorer.source))
    return CodeSandboxReward(client, scorer)
