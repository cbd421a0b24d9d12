"""SandboxFusion against a real local stand-in server (`sandbox_fusion_server`): the
client's run_code protocol, retries and bounds."""

from __future__ import annotations

import shutil
import threading

import pytest

from rayrl.sandbox_fusion import SandboxFusion, SandboxFusionError
from sandbox_fusion_server import StandInSandbox, closed_port_url

ECHO_SUM = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
CPP_BROKEN = "int main() { return missing_symbol; }\n"


@pytest.fixture(scope="module")
def server():
    with StandInSandbox() as running:
        yield running


# ----------------------------------------------------------------------- the client


def test_run_code_sends_verls_request_and_reads_the_reply(server):
    client = SandboxFusion(server.url, memory_limit_mb=300)
    run = client.run_code(ECHO_SUM, stdin="2 3 4", run_timeout=5)
    assert (run.status, run.outcome, run.stdout) == ("Success", "success", "9\n")
    sent = server.requests[-1]
    assert sent["language"] == "python" and sent["stdin"] == "2 3 4"
    assert (sent["run_timeout"], sent["compile_timeout"], sent["memory_limit_MB"]) == (5, 10.0, 300)
    assert sent["files"] == {} and sent["fetch_files"] == []


@pytest.mark.skipif(shutil.which("g++") is None, reason="the stand-in compiles C++ with g++")
def test_a_compile_error_and_a_timeout_are_told_apart(server):
    client = SandboxFusion(server.url)
    broken = client.run_code(CPP_BROKEN, language="cpp")
    assert (broken.status, broken.outcome, broken.run) == ("Failed", "compile_error", None)
    assert (
        broken.summary().startswith("Compilation failed:") and "missing_symbol" in broken.summary()
    )
    fine = client.run_code('#include <cstdio>\nint main() { puts("ok"); }', language="cpp")
    assert fine.outcome == "success" and fine.stdout == "ok\n"
    looped = client.run_code("while True: pass", run_timeout=0.5)
    assert (looped.status, looped.outcome) == ("Failed", "timeout")
    assert "time limit" in looped.summary()
    raised = client.run_code("print('before')\nraise ValueError('bad')")
    assert raised.outcome == "runtime_error"
    assert "before" in raised.summary() and "ValueError: bad" in raised.summary()


def test_the_memory_limit_reaches_the_run(server):
    grab = "x = b'x' * (200 << 20)\nprint('allocated')"
    assert SandboxFusion(server.url, memory_limit_mb=64).run_code(grab).outcome == "runtime_error"
    assert SandboxFusion(server.url, memory_limit_mb=1024).run_code(grab).stdout == "allocated\n"


def test_transient_failures_are_retried_and_an_outage_names_the_url():
    with StandInSandbox(fail_first=2) as busy:
        client = SandboxFusion(busy.url, backoff_s=0.01)
        assert client.run_code("print(1)").stdout == "1\n"
        assert (client.requests, client.retried) == (3, 2)
    url = closed_port_url()
    client = SandboxFusion(url, retries=2, backoff_s=0.01)
    with pytest.raises(SandboxFusionError, match="failed after 3 attempt") as err:
        client.run_code("print(1)")
    assert url in str(err.value) and "reward.sandbox_fusion.url" in str(err.value)


def test_a_refused_request_is_not_retried(server):
    client = SandboxFusion(server.url, backoff_s=0.01)
    with pytest.raises(SandboxFusionError, match="HTTP 422") as err:
        client.run_code("x", language="cobol")
    assert "unsupported language 'cobol'" in str(err.value) and client.requests == 1


def test_max_concurrent_bounds_the_requests_at_once():
    with StandInSandbox(delay_s=0.3) as slow:
        client = SandboxFusion(slow.url, max_concurrent=2)
        threads = [threading.Thread(target=client.run_code, args=("pass",)) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert slow.peak == 2 and len(slow.requests) == 6
