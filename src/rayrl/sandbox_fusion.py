"""A client of SandboxFusion's ``run_code`` endpoint: code run on a remote sandbox server.

SandboxFusion (github.com/bytedance/SandboxFusion) runs a program in one of many
languages and answers how it went. verl scores code answers on it
(``reward.sandbox_fusion.url``) and its multi-turn code tool calls it
(``SandboxFusionTool``'s ``sandbox_fusion_url``); rayrl does both through this client
(`rayrl.rewards.code_sandbox`, `rayrl.envs.builtin.sandbox_fusion`). It uses only the
standard library, and neither Ray nor torch: the reward and the tool leaves share it.

The endpoint (the URL is the whole endpoint, ``http://host:8080/run_code`` as verl's
configs give it): one POST per run, JSON both ways::

    request:  {"code": str, "language": "python" | "cpp" | ..., "stdin": str | null,
               "compile_timeout": s, "run_timeout": s, "memory_limit_MB": int,
               "files": {}, "fetch_files": []}
    response: {"status": "Success" | "Failed" | "SandboxError", "message": str,
               "compile_result": result | null, "run_result": result | null}
    result:   {"status": "Finished" | "TimeLimitExceeded" | "Error",
               "return_code": int | null, "stdout": str, "stderr": str,
               "execution_time": s}

``Success``: every step finished with return code 0; ``Failed``: a step timed out or
returned non-zero (a compile error has a ``compile_result`` and no ``run_result``);
``SandboxError``: the sandbox itself could not run a step. `RunResult.outcome` names
the case as verl's reward does (success, compile_error, compile_timeout, timeout,
runtime_error, sandbox_error).

Requests at once are bounded by ``max_concurrent`` (per client, i.e. per process that
holds one). A refused or reset connection, a timeout, HTTP 429 or 5xx is retried
``retries`` times, after ``backoff_s``, then twice that, and so on; after the last
attempt, or at once on another HTTP error or a reply outside the protocol,
`SandboxFusionError` names the URL and what went wrong.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from rayrl.json_post import BadReply, PostFailed, excerpt, post_json

__all__ = ["CommandResult", "RunResult", "SandboxFusion", "SandboxFusionError"]

REPLY_SLACK_S = 10.0  # beyond compile and run time, for the server's own work (verl's)


class SandboxFusionError(RuntimeError):
    """The SandboxFusion server could not be reached or answered outside the protocol."""


@dataclass(frozen=True)
class CommandResult:
    """One step of a run (compiling, running): SandboxFusion's ``CommandRunResult``."""

    status: str  # Finished | TimeLimitExceeded | Error
    return_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    execution_time: float | None = None

    @classmethod
    def parse(cls, data: Any) -> CommandResult | None:
        if data is None:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("status"), str):
            raise ValueError(f"a step result needs a status; got {excerpt(data)}")
        code = data.get("return_code")
        return cls(
            status=data["status"],
            return_code=int(code) if code is not None else None,
            stdout=str(data.get("stdout") or ""),
            stderr=str(data.get("stderr") or ""),
            execution_time=data.get("execution_time"),
        )

    @property
    def failed(self) -> bool:
        """Timed out, errored, or finished with a non-zero return code."""
        return self.status != "Finished" or (self.return_code or 0) != 0


@dataclass(frozen=True)
class RunResult:
    """How a run went (module docstring)."""

    status: str  # Success | Failed | SandboxError
    message: str = ""
    compile: CommandResult | None = None
    run: CommandResult | None = None

    @property
    def outcome(self) -> str:
        """verl's name for how the run ended: success, compile_error, compile_timeout,
        timeout, runtime_error or sandbox_error."""
        if self.status == "SandboxError":
            return "sandbox_error"
        if self.compile is not None and self.compile.failed:
            timed_out = self.compile.status == "TimeLimitExceeded"
            return "compile_timeout" if timed_out else "compile_error"
        if self.run is None:
            return "sandbox_error" if self.status != "Success" else "success"
        if self.run.status == "TimeLimitExceeded":
            return "timeout"
        if self.run.failed or self.status != "Success":
            return "runtime_error"
        return "success"

    @property
    def stdout(self) -> str:
        """What the program printed (empty when it did not run)."""
        return self.run.stdout if self.run is not None else ""

    def summary(self) -> str:
        """The run as a model sees a tool's answer: its output, then what went wrong."""
        outcome, step = self.outcome, self.compile
        if outcome in ("compile_error", "compile_timeout") and step is not None:
            what = "timed out" if outcome == "compile_timeout" else "failed"
            return f"Compilation {what}:\n{step.stderr or step.stdout}".rstrip()
        run = self.run
        if outcome == "sandbox_error" or run is None:
            return f"Error: the sandbox could not run the code: {self.message or 'no reason given'}"
        parts = [text for text in (run.stdout, run.stderr) if text]
        if outcome == "timeout":
            parts.append("Error: killed at the time limit.")
        elif run.return_code:
            parts.append(f"Exit code {run.return_code}.")
        return "\n".join(parts) if parts else "(no output)"

    @classmethod
    def parse(cls, data: Any) -> RunResult:
        if not isinstance(data, dict) or not isinstance(data.get("status"), str):
            raise ValueError(f"a reply needs a status; got {excerpt(data)}")
        return cls(
            status=data["status"],
            message=str(data.get("message") or ""),
            compile=CommandResult.parse(data.get("compile_result")),
            run=CommandResult.parse(data.get("run_result")),
        )


class SandboxFusion:
    """Run code on the SandboxFusion server at ``url`` (module docstring).

    Args:
        url: the ``run_code`` endpoint, e.g. ``http://10.0.0.5:8080/run_code``.
        max_concurrent: requests of this client at once (others wait their turn).
        memory_limit_mb: each run's memory limit, sent as ``memory_limit_MB``.
        retries: extra attempts after the first on transient failures.
        backoff_s: wait before the first retry; doubles after each.
        config_key: the config key the URL came from, named in errors.

    Counters: ``requests`` (HTTP attempts), ``retried`` (attempts that were retries).
    """

    def __init__(
        self,
        url: str,
        *,
        max_concurrent: int = 64,
        memory_limit_mb: int = 1024,
        retries: int = 3,
        backoff_s: float = 1.0,
        config_key: str = "reward.sandbox_fusion.url",
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"{config_key}={url!r} must be a SandboxFusion run_code endpoint starting "
                "with http:// or https:// (e.g. http://localhost:8080/run_code)"
            )
        if max_concurrent < 1 or memory_limit_mb < 1 or retries < 0 or backoff_s < 0:
            raise ValueError(
                f"SandboxFusion needs max_concurrent >= 1, memory_limit_mb >= 1, retries "
                f">= 0 and backoff_s >= 0; got {max_concurrent}, {memory_limit_mb}, "
                f"{retries}, {backoff_s}"
            )
        self.url, self.config_key = url, config_key
        self.max_concurrent, self.memory_limit_mb = max_concurrent, memory_limit_mb
        self.retries, self.backoff_s = retries, backoff_s
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._count = threading.Lock()
        self.requests = self.retried = 0

    def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        stdin: str | None = None,
        run_timeout: float = 10.0,
        compile_timeout: float = 10.0,
    ) -> RunResult:
        """Run ``code`` once; `SandboxFusionError` when the server fails us."""
        payload: dict[str, Any] = {
            "code": code,
            "language": language,
            "stdin": stdin,
            "compile_timeout": compile_timeout,
            "run_timeout": run_timeout,
            "memory_limit_MB": self.memory_limit_mb,
            "files": {},
            "fetch_files": [],
        }
        reply = self._post(json.dumps(payload).encode(), compile_timeout + run_timeout)
        try:
            return RunResult.parse(reply)
        except ValueError as err:
            raise SandboxFusionError(
                f"SandboxFusion at {self.url} broke the run_code protocol: {err}"
            ) from None

    def _post(self, body: bytes, work_s: float) -> Any:
        try:
            return post_json(
                self.url,
                body,
                timeout_s=work_s + REPLY_SLACK_S,
                retries=self.retries,
                backoff_s=self.backoff_s,
                attempted=self._attempted,
                slot=self._slots,
            )
        except PostFailed as err:
            raise SandboxFusionError(
                f"SandboxFusion at {self.url} {err}. Check that the server is up and "
                f"reachable from this node ({self.config_key})."
            ) from None
        except BadReply as err:
            raise SandboxFusionError(f"SandboxFusion at {self.url} {err}") from None

    def _attempted(self, attempt: int) -> None:
        with self._count:
            self.requests += 1
            self.retried += attempt > 0
