"""A local stand-in for a SandboxFusion server, for tests: a real HTTP server on
127.0.0.1 (in a thread of the test process) whose ``POST /run_code`` runs the code in a
subprocess and answers in SandboxFusion's JSON (`rayrl.sandbox_fusion` has the
protocol).

``python`` runs with this interpreter, under ``memory_limit_MB`` of address space (set
in the child before the code runs); ``cpp`` is compiled with ``g++`` first (a failed
compilation answers with its ``compile_result`` and no ``run_result``). Each step
stops at its timeout (``TimeLimitExceeded``). Another language is refused with HTTP 422, as the real server's request
validation does. It records every request, and the most requests it served at once;
``fail_first`` answers that many requests with HTTP 503 first, ``delay_s`` holds each
reply that long. Nothing here isolates the code: it is for tests' own snippets only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class StandInSandbox:
    """``with StandInSandbox() as server: SandboxFusion(server.url)``."""

    def __init__(self, fail_first: int = 0, delay_s: float = 0.0) -> None:
        self.fail_first, self.delay_s = fail_first, delay_s
        self.requests: list[dict[str, Any]] = []
        self.in_flight = self.peak = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/run_code"

    def __enter__(self) -> StandInSandbox:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def answer(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The HTTP status and JSON body for one request."""
        with self._lock:
            self.requests.append(request)
            refuse = len(self.requests) <= self.fail_first
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if refuse:
                return 503, {"detail": "busy"}
            language = request.get("language")
            if language not in ("python", "cpp"):
                return 422, {"detail": f"unsupported language {language!r}"}
            return 200, run_code(request)
        finally:
            with self._lock:
                self.in_flight -= 1


# Sets the address-space limit, then runs main.py as the program.
_PYTHON_LAUNCH = (
    "import resource, runpy, sys; limit = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_AS, (limit, limit)); "
    "runpy.run_path('main.py', run_name='__main__')"
)


def run_code(request: dict[str, Any]) -> dict[str, Any]:
    """Compile (cpp) and run the request's code; SandboxFusion's reply."""
    memory = int(request.get("memory_limit_MB") or 1024) << 20
    with tempfile.TemporaryDirectory(prefix="standin-sandbox-") as tmp:
        work = Path(tmp)
        compiled = None
        if request["language"] == "cpp":
            (work / "main.cpp").write_text(request["code"])
            compiler = shutil.which("g++") or "g++"
            argv = [compiler, "-O0", "-o", "main", "main.cpp"]
            compiled = _step(argv, work, None, float(request["compile_timeout"]))
            if compiled["status"] != "Finished" or compiled["return_code"] != 0:
                return _reply(compiled, None)
            argv = [str(work / "main")]
        else:
            (work / "main.py").write_text(request["code"])
            argv = [sys.executable, "-I", "-c", _PYTHON_LAUNCH, str(memory)]
        ran = _step(argv, work, request.get("stdin"), float(request["run_timeout"]))
        return _reply(compiled, ran)


def _step(argv, cwd: Path, stdin, timeout_s: float) -> dict[str, Any]:
    start = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=cwd, input=stdin or "", capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as err:
        return {
            "status": "TimeLimitExceeded",
            "return_code": None,
            "stdout": _text(err.stdout),
            "stderr": _text(err.stderr),
            "execution_time": time.monotonic() - start,
        }
    return {
        "status": "Finished",
        "return_code": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr,
        "execution_time": time.monotonic() - start,
    }


def _reply(compiled: dict | None, ran: dict | None) -> dict[str, Any]:
    steps = [s for s in (compiled, ran) if s is not None]
    if any(s["status"] == "TimeLimitExceeded" or s["return_code"] != 0 for s in steps):
        status = "Failed"
    else:
        status = "Success"
    return {
        "status": status,
        "message": "",
        "compile_result": compiled,
        "run_result": ran,
        "executor_pod_name": None,
        "files": {},
    }


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _handler(sandbox: StandInSandbox) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/run_code":
                return self._send(404, {"detail": "Not Found"})
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(*sandbox.answer(json.loads(body)))

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    return Handler


def closed_port_url() -> str:
    """A run_code URL on 127.0.0.1 where nothing listens (the connection is refused)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/run_code"
