"""Two "machines" on this host for tests: Linux network namespaces joined by a veth pair.

Each machine is a network namespace with a private address (10.231.<subnet>.1 and .2 on
a /24 that exists only between the two), its own hostname that resolves to 127.0.1.1 (a
private /etc/hosts bind-mounted in its own mount namespace, as Debian writes it), its
own process-id namespace (so `ray stop` there sees only that machine's Ray) and its
own HOME, TMPDIR and Ray temp directory. Commands run inside a machine through
`nsenter` into a holder process that keeps the namespaces alive.

Needs root, `ip netns`, `unshare` and `nsenter`; `available()` says whether they work
here. No traffic leaves the veth pair: the namespaces have no route anywhere else.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

BIN = str(Path(sys.executable).parent)
HOLDER = "rayrl-test-machine"  # the argument that marks a machine's holder process
# pid 1 of a machine's pid namespace: reaps the processes orphaned there (Ray's daemons)
REAPER = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.5)\n"
)


def available() -> str:
    """Why two machines cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    name = f"rrprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ""


@dataclass
class Machine:
    """One namespace "machine": its name, address, hostname and directories."""

    netns: str
    ip: str
    hostname: str
    root: Path
    holder: subprocess.Popen | None = None
    pid1: int = 0  # the holder's process (pid 1 of the machine's pid namespace)
    env: dict = field(default_factory=dict)

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def ray_temp(self) -> Path:
        return self.root / "ray"

    def command(self, args: list[str], env: dict | None = None) -> list[str]:
        """`args` as a command line that runs inside this machine, with its HOME,
        TMPDIR and `env` (on top of the test's environment)."""
        own = {
            "HOME": str(self.home),
            "TMPDIR": str(self.root / "tmp"),
            "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            **self.env,
            **(env or {}),
        }
        enter = ["nsenter", "-t", str(self.pid1), "--net", "--uts", "--mount", "--pid", "--"]
        # not the test process's interface names: this machine has interfaces of its own
        unset = [flag for var in IFNAME_VARS for flag in ("-u", var)]
        return [*enter, "env", *unset, *(f"{k}={v}" for k, v in own.items()), *args]

    def run(self, args: list[str], env: dict | None = None, timeout: float = 300.0):
        """Run `args` inside this machine to the end; the CompletedProcess (text)."""
        return subprocess.run(
            self.command(args, env), capture_output=True, text=True, timeout=timeout
        )

    def start(self) -> None:
        """Make the machine's directories and hosts file and start its holder."""
        for sub in ("home", "tmp", "ray"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        hosts = self.root / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 {self.hostname}\n")
        inside = (
            f"hostname {self.hostname} && mount --bind {hosts} /etc/hosts && "
            f"exec {sys.executable} -c '{REAPER}' {HOLDER}"
        )
        self.holder = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "--pid"]
            + ["--fork", "--mount-proc", "--propagation", "private", "sh", "-c", inside],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid1 = self._wait_for_holder()

    def _wait_for_holder(self, timeout: float = 30.0) -> int:
        """The pid (outside) of the holder's reaper, once the machine is set up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.holder.poll() is not None:
                raise RuntimeError(f"machine {self.hostname}: {self.holder.stderr.read()}")
            for child in psutil.Process(self.holder.pid).children(recursive=True):
                try:
                    if HOLDER in child.cmdline():
                        return child.pid
                except psutil.NoSuchProcess:
                    continue
            time.sleep(0.1)
        raise RuntimeError(f"machine {self.hostname}: its holder did not start in {timeout} s")

    def stop(self) -> None:
        """Stop this machine's Ray (only its own processes: its pid namespace), then
        end the holder, which ends every process left in the namespace."""
        if self.pid1:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.run(["ray", "stop", "--force"], timeout=60)
        if self.holder is not None and self.holder.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid1, 9)
            try:
                self.holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.holder.kill()


@dataclass
class TwoMachines:
    """A head machine and a worker machine joined by a veth pair."""

    head: Machine
    worker: Machine
    veth: str

    def up(self) -> None:
        ip = ["ip"]
        head, worker = self.head, self.worker
        subprocess.run([*ip, "netns", "add", head.netns], check=True)
        subprocess.run([*ip, "netns", "add", worker.netns], check=True)
        a, b = f"{self.veth}a", f"{self.veth}b"
        subprocess.run([*ip, "link", "add", a, "type", "veth", "peer", "name", b], check=True)
        for dev, machine in ((a, head), (b, worker)):
            subprocess.run([*ip, "link", "set", dev, "netns", machine.netns], check=True)
            ns = [*ip, "-n", machine.netns]
            subprocess.run([*ns, "addr", "add", f"{machine.ip}/24", "dev", dev], check=True)
            subprocess.run([*ns, "link", "set", dev, "up"], check=True)
            subprocess.run([*ns, "link", "set", "lo", "up"], check=True)
        head.start()
        worker.start()

    def down(self) -> None:
        """Stop both machines and delete the namespaces (the veth pair goes with them)."""
        for machine in (self.worker, self.head):
            try:
                machine.stop()
            finally:
                subprocess.run(["ip", "netns", "del", machine.netns], capture_output=True)


def two_machines(root: Path) -> TwoMachines:
    """Two machines under `root`, named and addressed after this process's pid."""
    tag = os.getpid() % 100000
    subnet = 20 + os.getpid() % 200
    head = Machine(f"rrh{tag}", f"10.231.{subnet}.1", f"rrhead{tag}", root / "head")
    worker = Machine(f"rrw{tag}", f"10.231.{subnet}.2", f"rrwork{tag}", root / "worker")
    return TwoMachines(head, worker, veth=f"rrv{tag}")
