"""Report, from inside a role container, the isolation facts the controller relies on.

Prints one JSON object. ``cyclebox doctor``, the demo's role smoke runs and the
integration tests read it; each fact is observed (a write attempted, a socket
opened), not inferred from configuration.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import platform
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path


def _status_field(name: str) -> str | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _can_write(directory: str) -> bool:
    path = os.path.join(directory, f".cyclebox-probe-{os.getpid()}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path)
    return True


def _interfaces() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        return [name for _, name in socket.if_nameindex()]


def _tcp(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=2):
            return "connected"
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


def _sockets() -> list[str]:
    """Every unix socket in the container's filesystem (found by type, not by name)."""
    found = []
    for root, dirs, files in os.walk("/", followlinks=False):
        if root == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys")]
        for name in (*dirs, *files):
            path = os.path.join(root, name)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.append(path)
            except OSError:
                continue
    return sorted(found)


def _first_int(*paths: str) -> int | None:
    """First readable integer among cgroup v1/v2 files ("max" counts as unlimited: None)."""
    for p in paths:
        try:
            text = Path(p).read_text().split()[0]
        except (OSError, IndexError):
            continue
        return None if text == "max" else int(text)
    return None


# Syscall numbers by machine: io_uring_setup is 425 everywhere (unified table).
_SYSCALLS = {
    "x86_64": {"io_uring_setup": 425, "unshare": 272, "keyctl": 250, "clone3": 435},
    "aarch64": {"io_uring_setup": 425, "unshare": 97, "keyctl": 219, "clone3": 435},
}
CLONE_NEWUSER = 0x10000000


def _syscall(name: str, *args: int) -> str:
    """"allowed" when the raw syscall succeeded, else the errno name (EPERM, ENOSYS ...)."""
    nr = _SYSCALLS.get(platform.machine(), {}).get(name)
    if nr is None:
        return "unknown_arch"
    libc = ctypes.CDLL(None, use_errno=True)
    ret = libc.syscall(nr, *(ctypes.c_long(a) for a in args))
    if ret < 0:
        return errno.errorcode.get(ctypes.get_errno(), "EUNKNOWN")
    return "allowed"


def _io_uring_setup() -> str:
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    nr = _SYSCALLS.get(platform.machine(), {}).get("io_uring_setup")
    if nr is None:
        return "unknown_arch"
    libc = ctypes.CDLL(None, use_errno=True)
    ret = libc.syscall(nr, ctypes.c_long(1), params)
    if ret < 0:
        return errno.errorcode.get(ctypes.get_errno(), "EUNKNOWN")
    os.close(ret)
    return "allowed"


def _in_child(attempt: Callable[[], str]) -> str:
    """Run a syscall that would change this process (unshare, clone3) in a throwaway child;
    what ``attempt`` says there."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(r)
        os.close(w)
        return f"fork_failed:{errno.errorcode.get(exc.errno or 0, '?')}"
    if pid == 0:  # child: report and leave without running any cleanup handlers
        os.close(r)
        os.write(w, attempt().encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        out = fh.read(64).decode(errors="replace")
    os.waitpid(pid, 0)
    return out


def _clone3_newuser() -> str:
    """clone3(CLONE_NEWUSER), in the throwaway child: ENOSYS is what the profile says under
    runc and what gVisor's sentry says under runsc (where the profile lets clone3 through,
    runner.isolation.seccomp.for_runtime); "allowed" means a new user namespace was made."""
    nr = _SYSCALLS.get(platform.machine(), {}).get("clone3")
    if nr is None:
        return "unknown_arch"
    args = ctypes.create_string_buffer(64)  # struct clone_args, CLONE_ARGS_SIZE_VER0
    ctypes.memmove(args, CLONE_NEWUSER.to_bytes(8, "little"), 8)  # .flags
    ctypes.memmove(ctypes.byref(args, 32), (17).to_bytes(8, "little"), 8)  # SIGCHLD
    libc = ctypes.CDLL(None, use_errno=True)
    ret = libc.syscall(nr, args, ctypes.c_long(64))
    if ret == 0:  # the new process, in its own user namespace
        os._exit(0)
    return "allowed" if ret > 0 else errno.errorcode.get(ctypes.get_errno(), "EUNKNOWN")


def syscalls() -> dict[str, str]:
    """What the seccomp profile lets through: each entry "allowed" or the errno seen."""
    return {
        "io_uring_setup": _io_uring_setup(),
        "unshare_newuser": _in_child(lambda: _syscall("unshare", CLONE_NEWUSER)),
        "keyctl": _syscall("keyctl", 0, 0, 0, 0, 0),
        "clone3_newuser": _in_child(_clone3_newuser),
    }


def facts(role: str, tcp_targets: list[str]) -> dict[str, object]:
    return {
        "role": role,
        "python": sys.version.split()[0],
        "uid": os.getuid(),
        "gid": os.getgid(),
        "cap_eff": _status_field("CapEff"),
        "no_new_privs": _status_field("NoNewPrivs"),
        "seccomp": _status_field("Seccomp"),
        "interfaces": _interfaces(),
        "rootfs_writable": _can_write("/"),
        "tmp_writable": _can_write("/tmp"),  # noqa: S108
        "memory_limit": _first_int("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                   "/sys/fs/cgroup/memory.max"),
        "pids_limit": _first_int("/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/pids.max"),
        "unix_sockets": _sockets(),
        "env_keys": sorted(os.environ),
        "syscalls": syscalls(),
        "tcp": {t: _tcp(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in tcp_targets},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sandbox.probe")
    ap.add_argument("--role", default="unknown")
    ap.add_argument("--tcp", action="append", default=[], help="HOST:PORT to try to reach")
    args = ap.parse_args(argv)
    print(json.dumps(facts(args.role, args.tcp), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
