"""Who owns a container: the controller process, identified across pid reuse.

A pid alone can be reused after the controller dies, so ownership is the pid
plus the process start time (clock ticks since boot, from ``/proc/PID/stat``),
the boot id and the host name. ``cyclebox gc`` removes a labelled container only
when that exact process is gone.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Owner:
    """The controller process that created a container."""

    pid: int
    start: int
    """Start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    boot_id: str
    host: str


def parse_stat_start(stat_line: str) -> int:
    """Start time from a ``/proc/PID/stat`` line.

    The command name (field 2) is in parentheses and may itself contain spaces
    or ')' so fields are counted from the *last* ')'.
    """
    rest = stat_line[stat_line.rindex(")") + 2:].split()
    # rest[0] is field 3 (state); start time is field 22.
    return int(rest[22 - 3])


def boot_id(proc: Path = PROC) -> str:
    try:
        return (proc / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def process_start(pid: int, proc: Path = PROC) -> int | None:
    """Start ticks of a live process, or None when no such process exists."""
    try:
        return parse_stat_start((proc / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def current_owner(proc: Path = PROC) -> Owner:
    import os

    pid = os.getpid()
    start = process_start(pid, proc)
    return Owner(pid=pid, start=start if start is not None else 0, boot_id=boot_id(proc),
                 host=socket.gethostname())


def owner_alive(owner: Owner, *, here: Owner, proc: Path = PROC) -> bool | None:
    """True if the owner still runs, False if it is gone, None if this host cannot tell.

    A container owned by another host (shared engine) is never judged from here.
    """
    if owner.host != here.host:
        return None
    if owner.boot_id != here.boot_id:
        return False  # the machine rebooted since: the owner is certainly gone
    return process_start(owner.pid, proc) == owner.start
