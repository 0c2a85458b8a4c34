"""Report, from inside a role container, the isolation facts the controller relies on.

Prints one JSON object. ``cyclebox doctor``, the demo's role smoke runs and the
integration tests read it; each fact is observed (a write attempted, a socket
opened), not inferred from configuration.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import stat
import sys
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
