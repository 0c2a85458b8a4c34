"""What a case costs the host in CPU, counted three ways (bench/throughput.py).

1. ``cgroups``: the controller's own CPU (``wait4``) plus the role containers' cgroup
   CPU. Leaves out the Docker engine's work for every container: ``dockerd``,
   ``containerd``, the per-container ``containerd-shim`` and the ``runc`` it runs (create,
   start, kill, delete), which on this host is real CPU each case costs.
2. ``with_engine``: (1) plus the CPU of the engine's processes over the same time, read
   from ``/proc/PID/stat`` (user + system): ``dockerd`` and ``containerd`` from their
   value at the start, every shim and ``runc`` that appeared meanwhile from zero. Not a
   shim's reaped children (its container's processes, already in (1), and its ``runc``
   calls, which end between polls and are mostly missed), nor a process's last tenth
   of a second before it exits: a lower bound.
3. ``host``: every busy CPU second on the host (``/proc/stat``) while the run's analyst
   containers existed, minus this bench process's own CPU (its poller and the slow
   upstream stand in for a remote model, which costs this host nothing). Includes the
   controller, the gateway, the engine, the containers and whatever else ran on the host
   meanwhile (the figures carry the load average for that): an upper bound on a quiet host.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field
from pathlib import Path

from runner.cycle.concurrency import cpu_times

TICK = os.sysconf("SC_CLK_TCK")
ENGINE_COMMS = ("dockerd", "containerd", "containerd-shim", "containerd-shim-runc-v2", "runc",
                "docker-init", "docker-proxy")
"""Process names (``/proc/PID/comm``, at most 15 characters) counted as the engine's."""


def _proc_cpu(stat: str) -> tuple[int, float]:
    """(start time in ticks, own user + system CPU seconds) from ``/proc/PID/stat``."""
    rest = stat.rsplit(")", 1)[1].split()
    # rest[0] is field 3 (state): utime=14, stime=15, starttime=22
    ticks = int(rest[11]) + int(rest[12])
    return int(rest[19]), ticks / TICK


def engine_processes(proc: Path = Path("/proc")) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, start) -> (comm, CPU seconds) of every engine process alive now."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm = (d / "comm").read_text().strip()
            if comm not in ENGINE_COMMS:
                continue
            start, cpu = _proc_cpu((d / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        out[(int(d.name), start)] = (comm, cpu)
    return out


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@dataclass
class HostCpu:
    """Fed one poll at a time (:meth:`poll`); the totals are over the polls made."""

    first: dict[tuple[int, int], float] = field(default_factory=dict)
    last: dict[tuple[int, int], float] = field(default_factory=dict)
    comm: dict[tuple[int, int], str] = field(default_factory=dict)
    busy_s: float = 0.0
    """Host busy CPU seconds over intervals in which analyst containers existed."""
    self_s: float = 0.0
    """This process's CPU over those same intervals (subtracted from ``busy_s``)."""
    active_s: float = 0.0
    _prev: tuple[int, float, bool] | None = None

    def __post_init__(self) -> None:
        # the engine processes already running count from here, not from their start
        for key, (comm, cpu) in engine_processes().items():
            self.first[key], self.last[key], self.comm[key] = cpu, cpu, comm

    def poll(self, analyst_present: bool, now: float) -> None:
        for key, (comm, cpu) in engine_processes().items():
            self.first.setdefault(key, 0.0)  # born during the run: all of it counts
            self.last[key] = cpu
            self.comm[key] = comm
        busy, _ = cpu_times(Path("/proc/stat").read_text())
        mine = _self_cpu()
        if self._prev is not None:
            p_busy, p_self, p_present = self._prev
            if analyst_present or p_present:
                self.busy_s += (busy - p_busy) / TICK
                self.self_s += mine - p_self
        self._prev = (busy, mine, analyst_present)

    def engine_s(self) -> dict[str, float]:
        """CPU seconds per engine process name over the polls."""
        out: dict[str, float] = {}
        for key, cpu in self.last.items():
            name = self.comm[key]
            out[name] = out.get(name, 0.0) + max(0.0, cpu - self.first.get(key, 0.0))
        return {k: round(v, 2) for k, v in sorted(out.items())}

    def host_s(self) -> float:
        return max(0.0, self.busy_s - self.self_s)
