"""The code sandbox with real child processes: an infinite loop, a fork bomb, a 10 GB
allocation, a file past the size limit, a busy loop past its CPU seconds, files opened
without end, a call that sleeps past its wall clock, writes outside the working
directory, the trainer's secrets, a connection to 127.0.0.1, a process that escapes
its group: each fails inside the sandbox, the result says so, and the test process
(the trainer) is unharmed."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from rayrl.envs import Sandbox, SandboxLimits, build_tool, verl
from rayrl.envs.sandbox import _pids_of

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="uid, mount and PID isolation need root here")


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(timeout_s=3.0, max_processes=8, memory_bytes=512 << 20))


def run(sandbox: Sandbox, code: str):
    result = sandbox.run_python(textwrap.dedent(code))
    assert result.error is None, result.error
    return result


def trainer_is_healthy():
    done = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
    assert done.stdout.strip() == "42"


def test_runs_code_and_reports_isolation(sandbox):
    result = run(sandbox, "print('hello', sum(range(10)))")
    assert result.ok and result.stdout == "hello 45\n"
    if ROOT:
        assert result.isolation["user"].startswith("uid ")
        assert "network namespace" in result.isolation["network"]
        assert "PID namespace" in result.isolation["processes"]
        assert "private tmpfs" in result.isolation["filesystem"]


def test_infinite_loop_is_killed_at_the_timeout(sandbox):
    start = time.perf_counter()
    result = run(sandbox, "while True: pass")
    assert result.timed_out and not result.ok
    assert time.perf_counter() - start < 10
    assert "time limit" in result.summary()
    trainer_is_healthy()


def test_fork_bomb_stops_at_the_process_limit(sandbox):
    code = """
        import os, time
        made = 0
        for _ in range(10_000):
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                made += 1
            except OSError:
                break
        print("forked", made, flush=True)
        time.sleep(60)
    """
    result = run(sandbox, code)
    assert result.timed_out
    made = int(result.stdout.split()[1])
    assert made < sandbox.limits.max_processes  # RLIMIT_NPROC stopped it
    if ROOT:
        uid = int(result.isolation["user"].split()[1])
        assert _pids_of(uid) == []  # every process of the run is gone
    trainer_is_healthy()


def test_ten_gigabytes_cannot_be_allocated(sandbox):
    result = run(sandbox, "x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert result.exit_code == 1 and "MemoryError" in result.stderr
    assert "allocated" not in result.stdout
    trainer_is_healthy()


def test_a_file_past_the_file_size_limit_fails_inside_the_sandbox():
    """RLIMIT_FSIZE: a 2 MiB write under a 1 MiB limit fails in the code with EFBIG
    (not ENOSPC: the scratch tmpfs has room), and the file stops at the limit."""
    box = Sandbox(SandboxLimits(timeout_s=5.0, file_size_bytes=1 << 20))
    code = """
        import errno, os
        try:
            with open("big.bin", "wb") as f:
                f.write(b"x" * (2 << 20))
            print("wrote")
        except OSError as err:
            print("refused", errno.errorcode[err.errno])
        print("size", os.path.getsize("big.bin"))
        open("small.bin", "wb").write(b"x" * (512 << 10))
        print("small", os.path.getsize("small.bin"))
    """
    result = run(box, code)
    assert "wrote" not in result.stdout and "refused EFBIG" in result.stdout
    assert int(re.search(r"size (\d+)", result.stdout).group(1)) <= 1 << 20
    assert "small 524288" in result.stdout and result.ok
    trainer_is_healthy()


def test_cpu_time_past_the_limit_ends_the_code_before_its_wall_clock():
    """RLIMIT_CPU: a busy loop with 1 CPU second is ended by the CPU limit (a signal),
    not its 15 s timeout; sleeping first costs no CPU time."""
    box = Sandbox(SandboxLimits(timeout_s=15.0, cpu_s=1))
    start = time.perf_counter()
    result = run(box, "import time\ntime.sleep(1.5)\nprint('slept', flush=True)\nwhile True: pass")
    assert not result.timed_out and result.signal is not None and not result.ok
    assert result.stdout == "slept\n" and time.perf_counter() - start < 12
    assert "killed by signal" in result.summary()
    trainer_is_healthy()


def test_open_files_stop_at_the_limit():
    """RLIMIT_NOFILE: opening files without end fails with EMFILE below the limit."""
    box = Sandbox(SandboxLimits(timeout_s=5.0, max_open_files=32))
    code = """
        import errno
        held = []
        try:
            for i in range(10_000):
                held.append(open(f"f{i}", "w"))
        except OSError as err:
            print("refused", errno.errorcode[err.errno], len(held))
    """
    result = run(box, code)
    refused = re.search(r"refused EMFILE (\d+)", result.stdout)
    assert refused and 0 < int(refused.group(1)) < 32, result.stdout + result.stderr
    trainer_is_healthy()


def test_the_wall_clock_ends_code_that_waits_without_using_cpu():
    """A sleeping call (no CPU time to run out) is killed at its wall-clock timeout,
    with what it printed before kept."""
    box = Sandbox(SandboxLimits(timeout_s=1.5))
    start = time.perf_counter()
    result = run(box, "import time\nprint('waiting', flush=True)\ntime.sleep(60)\nprint('woke')")
    took = time.perf_counter() - start
    assert result.timed_out and not result.ok and result.stdout == "waiting\n"
    assert result.duration_s > 1.4 and took < 8
    assert "time limit" in result.summary()


FORKED_ALLOCATIONS = """
    import os, time
    for i in range(4):
        if os.fork() == 0:
            if i == 3:
                os.setsid()  # one of them leaves the process group
            data = b"x" * (200 << 20)  # written: resident, not just reserved
            print("child holds 200 MB", flush=True)
            time.sleep(30)
            os._exit(0)
    time.sleep(30)
"""


def test_the_memory_limit_bounds_all_the_processes_of_a_call_together(sandbox):
    """Four children of 200 MB each fit the 512 MB limit one by one (each process's
    address space) but not together: the call is killed in about a second, not at its
    3 s timeout, and none of its processes is left."""
    result = run(sandbox, FORKED_ALLOCATIONS)
    assert result.memory_exceeded and not result.timed_out and not result.ok
    assert result.peak_memory_bytes > sandbox.limits.memory_bytes
    assert result.duration_s < 2.5
    assert "MB together (memory limit)" in result.summary()
    if ROOT:
        uid = int(result.isolation["user"].split()[1])
        assert _pids_of(uid) == []
    one = run(sandbox, 'data = b"x" * (100 << 20)\nprint("held", len(data) >> 20)')
    assert one.ok and one.stdout == "held 100\n" and not one.memory_exceeded
    trainer_is_healthy()


@needs_root
def test_writes_outside_the_working_directory_fail(sandbox, tmp_path):
    victim_dir = tmp_path / "open"
    victim_dir.mkdir()
    victim_dir.chmod(0o777)  # even a world-writable host directory under /tmp
    repo_file = os.path.join(os.path.dirname(__file__), "SANDBOX_ESCAPE")
    code = f"""
        import os
        for path in [{str(victim_dir / "owned")!r}, {repo_file!r}, "/etc/passwd"]:
            try:
                with open(path, "a") as f:
                    f.write("pwned")
                print("wrote", path)
            except OSError as err:
                print("refused", path, type(err).__name__)
        open("inside.txt", "w").write("fine")
        print("inside", open("inside.txt").read())
    """
    result = run(sandbox, code)
    assert "inside fine" in result.stdout
    # read-only where the checkout is visible; hidden when it lies under /tmp (a clone in
    # /tmp: the sandbox's private tmpfs covers it)
    assert re.search(
        rf"refused {re.escape(repo_file)} (PermissionError|FileNotFoundError)", result.stdout
    )
    assert "refused /etc/passwd PermissionError" in result.stdout
    assert not (victim_dir / "owned").exists()  # hidden by the private tmpfs
    assert not os.path.exists(repo_file)
    with open("/etc/passwd") as passwd:
        assert "pwned" not in passwd.read()


def test_trainer_secrets_are_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret-do-not-leak")
    code = f"""
        import os
        print(sorted(os.environ))
        print(os.environ.get("AWS_SECRET_ACCESS_KEY"))
        try:
            print(open("/proc/{os.getpid()}/environ", "rb").read())
        except OSError as err:
            print("refused", type(err).__name__)
    """
    result = run(sandbox, code)
    assert "fake-secret-do-not-leak" not in result.stdout + result.stderr
    assert "AWS_SECRET_ACCESS_KEY" not in result.stdout
    assert "refused" in result.stdout


@needs_root
def test_no_network_not_even_loopback(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("connected")
            except OSError as err:
                print("refused", err)
        """
        result = run(sandbox, code)
    finally:
        server.close()
    assert "connected" not in result.stdout and "refused" in result.stdout


@needs_root
def test_a_process_that_leaves_the_group_dies_with_the_run(sandbox):
    code = """
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(120)
            os._exit(0)
        print("parent done", flush=True)
    """
    result = run(sandbox, code)
    assert result.ok
    uid = int(result.isolation["user"].split()[1])
    assert _pids_of(uid) == []


def test_output_is_truncated_and_the_code_tool_summarises():
    box = Sandbox(SandboxLimits(timeout_s=5.0, max_output_bytes=100))
    result = box.run_python("print('x' * 100_000)")
    assert result.ok and result.stdout_truncated and len(result.stdout) == 100
    tool = build_tool({"name": "code_interpreter", "config": {"timeout_s": 5}})
    assert tool.execute({"code": "print(2 ** 20)"}, None).strip() == "1048576"
    failed = tool.execute({"code": "raise ValueError('bad input')"}, None)
    assert "ValueError: bad input" in failed and "Exit code 1" in failed


def test_verls_sandbox_fusion_limits_become_the_local_sandboxs(caplog, monkeypatch):
    """verl's SandboxFusion tool without a sandbox_fusion_url runs in the local sandbox
    under its own limits: an endless loop stops at about its default_timeout of 3 s,
    600 MB fail under its memory_limit_mb of 256, and the service's keys that have no
    effect are named. (With a URL it runs on that server: `test_sandbox_fusion`.)"""
    monkeypatch.setattr(verl, "_warned", set())  # said once per process: say it here
    tool = build_tool(
        {
            "class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
            "config": {
                "num_workers": 10,
                "rate_limit": 4,
                "default_timeout": 3,
                "memory_limit_mb": 256,
                "type": "native",
            },
        }
    )
    assert "num_workers, rate_limit of its config have no effect" in caplog.text
    start = time.perf_counter()
    looped = tool.execute({"code": "while True: pass"}, None)
    assert 2.5 < time.perf_counter() - start < 6
    assert "killed after 3." in looped and "time limit" in looped
    big = tool.execute({"code": 'x = b"x" * (600 << 20)\nprint("allocated")'}, None)
    assert "MemoryError" in big and "allocated" not in big
