"""The ``sandbox_fusion`` tool: code run on a SandboxFusion server (`rayrl.sandbox_fusion`).

verl's ``verl.tools.sandbox_fusion_tools.SandboxFusionTool`` maps here when its config
names a server (``sandbox_fusion_url``; without one it maps to the local
``code_interpreter``: `rayrl.envs.verl`). Its config keys are verl's:

- ``sandbox_fusion_url``: the server's ``run_code`` endpoint (required);
- ``default_timeout`` (30 s): each run's time limit, unless the call gives ``timeout``;
- ``default_language`` (``python``): unless the call gives ``language``;
- ``memory_limit_mb`` (1024): each run's memory limit;
- ``rate_limit`` (10): runs at once on the server from this worker's tool (verl's
  limit is the whole cluster's, through a named Ray actor; ``num_workers`` and
  ``enable_global_rate_limit`` size that actor and mean nothing here).

The model sees what the run printed (stdout, then stderr) and what went wrong: the
compiler's message, the time limit, a non-zero exit code, a sandbox error (verl shows
``no stdout here`` for all of these). A server that cannot be reached, after the
client's retries, fails the call: the model sees the error and the call counts as one.
"""

from __future__ import annotations

from typing import Any

from rayrl.envs.registry import TOOLS
from rayrl.envs.tool import Tool
from rayrl.sandbox_fusion import REPLY_SLACK_S, SandboxFusion

__all__ = ["SandboxFusionTool"]

COMPILE_TIMEOUT_S = 10.0


@TOOLS.register("sandbox_fusion")
class SandboxFusionTool(Tool):
    """Runs the model's code on a SandboxFusion server and returns its output."""

    name = "code_interpreter"
    description = "Run code and return what it prints. Use print() to show results."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The code to run."}},
        "required": ["code"],
    }

    def __init__(self, config=None, schema=None) -> None:
        super().__init__(config, schema)
        c = self.config
        url = c.get("sandbox_fusion_url")
        if not url:
            raise ValueError(
                "tool sandbox_fusion needs config.sandbox_fusion_url, the SandboxFusion "
                "server's run_code endpoint (e.g. http://localhost:8080/run_code)"
            )
        self.run_timeout_s = float(c.get("default_timeout", 30))
        self.language = str(c.get("default_language", "python"))
        self.client = SandboxFusion(
            str(url),
            max_concurrent=int(c.get("rate_limit", 10)),
            memory_limit_mb=int(c.get("memory_limit_mb", 1024)),
            config_key=f"tool {self.name}'s sandbox_fusion_url",
        )
        if "timeout_s" not in c:  # the runner's limit only backs up the server's own
            attempts = self.client.retries + 1
            self.timeout_s = attempts * (self.run_timeout_s + COMPILE_TIMEOUT_S + REPLY_SLACK_S)

    def execute(self, arguments: dict[str, Any], state: Any) -> str:
        run = self.client.run_code(
            str(arguments["code"]),
            language=str(arguments.get("language") or self.language),
            run_timeout=float(arguments.get("timeout") or self.run_timeout_s),
            compile_timeout=COMPILE_TIMEOUT_S,
        )
        return run.summary()
