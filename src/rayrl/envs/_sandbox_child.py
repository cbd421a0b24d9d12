"""The sandbox's launcher: runs in the child process, isolates it, then runs the code.

`rayrl.envs.sandbox` starts ``python -I -S _sandbox_child.py REPORT_FD`` in a new
session with an empty environment and writes one JSON request on its stdin. This
script (standard library only, any Python 3.8+, since the sandbox may run a system
interpreter) then:

1. when not root, enters a new user namespace (where the kernel allows), mapping
   itself to root there, so that the namespaces below become possible;
2. leaves the trainer's namespaces where it can: network (no interface up, not even
   loopback), mount, PID, IPC;
3. forks: the child (PID 1 of the new PID namespace: when it dies, the kernel kills
   every process the code started) mounts private tmpfs over the world-writable
   directories (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``; the host's files
   there are hidden), a fresh ``/proc``, writes the files into its working directory,
   sets the resource limits, drops to the sandbox's own uid when root, forbids new
   privileges, asks to be killed if the launcher dies, and execs the command;
4. the launcher waits for it and reports how it ended. It is a child subreaper: a
   process of the code whose parent ended is re-parented to it (not to the machine's
   init), so the sandbox's parent finds every process of the call below the launcher
   (`rayrl.envs.sandbox_memory`).

Everything that was and was not isolated is written, as JSON lines, to REPORT_FD.
"""

import ctypes
import ctypes.util
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags, what):
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({what})")


def _mount(source, target, fstype, flags, data):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    result = _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(result, f"mount {target}")


def _write(fd, record):
    os.write(fd, (json.dumps(record) + "\n").encode())


def _enter_user_namespace():
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER, "user")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")


def _namespaces(req, iso):
    """Unshare each namespace on its own, so that one the kernel refuses skips only itself."""
    wanted = [("mount", CLONE_NEWNS), ("processes", CLONE_NEWPID), ("ipc", CLONE_NEWIPC)]
    if req["isolate_network"]:
        wanted.insert(0, ("network", CLONE_NEWNET))
    else:
        iso["network"] = "shared with the trainer (network allowed by the config)"
    done = set()
    for name, flag in wanted:
        try:
            _unshare(flag, name)
        except OSError as err:
            iso[name] = f"not isolated: {err}"
            continue
        done.add(name)
    if "network" in done:
        iso["network"] = "new network namespace (no interfaces up)"
    if "processes" in done:
        iso["processes"] = "new PID namespace (all processes killed with it)"
    return done


def _private_mounts(req, done, iso):
    """Private tmpfs over the scratch directories; returns the working directory."""
    if "mount" not in done:
        iso["filesystem"] = "host filesystem (no mount namespace); working directory {}".format(
            req["host_workdir"]
        )
        return req["host_workdir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    size = "size={},mode=1777".format(req["scratch_bytes"])
    hidden = []
    for path in SCRATCH_DIRS:
        if os.path.isdir(path) and not os.path.islink(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, size)
            hidden.append(path)
    if "processes" in done:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        except OSError as err:
            iso["processes"] += f"; host /proc still visible ({err})"
    if "/tmp" not in hidden:
        iso["filesystem"] = "host filesystem; working directory {}".format(req["host_workdir"])
        return req["host_workdir"]
    workdir = "/tmp/sandbox"
    os.mkdir(workdir, 0o700)
    iso["filesystem"] = (
        "private tmpfs over {} (host files there hidden); working directory {}".format(
            ", ".join(hidden),
            workdir,
        )
    )
    return workdir


def _limits(req):
    limits = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, req["cpu_s"]),
        (resource.RLIMIT_AS, req["memory_bytes"]),
        (resource.RLIMIT_FSIZE, req["file_size_bytes"]),
        (resource.RLIMIT_NOFILE, req["max_open_files"]),
        (resource.RLIMIT_NPROC, req["nproc"]),
    ]
    for which, value in limits:
        hard = value + 1 if which == resource.RLIMIT_CPU else value
        resource.setrlimit(which, (value, hard))


def _become(req, workdir, iso):
    uid = req["uid"]
    if uid is None:
        iso["user"] = iso.get("user") or "the trainer's own uid (not root: no other uid to drop to)"
        return
    for root, dirs, files in os.walk(workdir):
        for name in [root] + [os.path.join(root, n) for n in dirs + files]:
            os.chown(name, uid, uid)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"could not drop to uid {uid}")
    try:
        os.setuid(0)
    except PermissionError:
        iso["user"] = f"uid {uid} (unprivileged, its own: no other process shares it)"
        return
    raise OSError(f"uid {uid} could become root again")


def _child(req, done, iso, report_fd):
    workdir = _private_mounts(req, done, iso)
    for name, text in req["files"].items():
        with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
            f.write(text)
    _become(req, workdir, iso)
    _limits(req)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")
    os.chdir(workdir)
    os.umask(0o077)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    _write(report_fd, {"isolation": iso})
    os.close(report_fd)
    argv = req["argv"]
    os.execve(argv[0], argv, req["env"])


def main():
    report_fd = int(sys.argv[1])
    req = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    iso = {}
    if os.geteuid() != 0 and req["user_namespace"]:
        try:
            _enter_user_namespace()
            iso["user"] = "the trainer's uid, as root of a new user namespace"
        except OSError as err:
            iso["user_namespace"] = f"not available: {err}"
    done = _namespaces(req, iso)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the code stay below us
    pid = os.fork()
    if pid == 0:
        try:
            _child(req, done, iso, report_fd)
        except BaseException as err:  # report why the sandbox could not start
            _write(report_fd, {"setup_error": f"{type(err).__name__}: {err}", "isolation": iso})
        os._exit(126)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        _write(report_fd, {"signal": os.WTERMSIG(status)})
    else:
        _write(report_fd, {"exit": os.WEXITSTATUS(status)})
    os._exit(0)


if __name__ == "__main__":
    main()
