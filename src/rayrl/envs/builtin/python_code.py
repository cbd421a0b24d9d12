"""The ``code_interpreter`` tool (alias ``python``): Python code run in the sandbox.

Every call runs the given code as a fresh Python script in `rayrl.envs.sandbox`
(a separate process with resource limits, no network, an empty environment, its own
working directory); the observation is what it printed, and what went wrong if it
failed (the traceback, the time limit, the signal). The config sets the limits:
``timeout_s``, ``memory_mb``, ``max_output_chars``, ``max_processes``, ``network``.
verl's SandboxFusion tool maps here (`rayrl.envs.verl`): the code runs locally.
"""

from __future__ import annotations

from typing import Any

from rayrl.envs.registry import TOOLS
from rayrl.envs.sandbox import Sandbox, SandboxLimits
from rayrl.envs.tool import Tool

__all__ = ["PythonInterpreter"]


@TOOLS.register("code_interpreter", aliases=("python",))
class PythonInterpreter(Tool):
    """Runs Python code in the sandbox and returns its output."""

    name = "code_interpreter"
    description = "Run Python code and return what it prints. Use print() to show results."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python code to run."}},
        "required": ["code"],
    }

    def __init__(self, config=None, schema=None) -> None:
        super().__init__(config, schema)
        c = self.config
        sandbox_timeout = float(c.get("timeout_s", 10.0))
        limits = SandboxLimits(
            timeout_s=sandbox_timeout,
            memory_bytes=int(c.get("memory_mb", 1024)) << 20,
            max_output_bytes=int(c.get("max_output_chars", 8192)),
            max_processes=int(c.get("max_processes", 16)),
        )
        self.sandbox = Sandbox(limits, isolate_network=not c.get("network", False))
        # The runner's timeout only backs up the sandbox's own, which kills the code.
        self.timeout_s = sandbox_timeout + 10.0

    def execute(self, arguments: dict[str, Any], state: Any) -> str:
        return self.sandbox.run_python(arguments["code"]).summary()
