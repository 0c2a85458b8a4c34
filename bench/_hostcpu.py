"""What a case costs the host in CPU, counted several ways (bench/throughput.py).

Every figure is CPU seconds over the intervals in which the run's analyst containers
existed (polled), divided by the analyst containers:

1. ``cgroups``: the controller's own CPU (``wait4``, the whole run) plus the analyst
   containers' cgroup CPU (polled while they live). Leaves out the Docker engine's work
   for every container (``dockerd``, ``containerd``, the per-container shim and the
   ``runc`` calls it makes) and the kernel's, which on this host are real CPU each case
   costs: this figure overstates the CPU bound.
2. ``with_engine``: (1) plus the engine's long-lived processes (``dockerd``,
   ``containerd``, shims; user + system from ``/proc/PID/stat``). A process that lives
   less than a poll (each ``runc`` call) is missed: a lower bound.
3. ``attributed``: every busy CPU second of the host (``/proc/stat``) minus this bench
   process (its poller and the slow upstream stand in for a remote model, which costs
   this host nothing) and minus the user processes that are neither the engine, the
   containers nor the controller (another session's work, the machine's own agent), each
   named in ``by_process``. Kernel threads (cgroup and namespace teardown, softirqs,
   memory reclaim) and whatever ran and ended between two polls (``runc``) stay in:
   the headline, every CPU second a case costs this host.
4. ``host``: every busy CPU second minus this bench process only: an upper bound.
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
PF_KTHREAD = 0x00200000
Key = tuple[int, int]
"""(pid, start time in ticks): a pid reused by a new process is a new key."""


@dataclass(frozen=True)
class Proc:
    comm: str
    kind: str
    """engine, kernel, container, controller, bench or other."""
    cpu_s: float


def _stat(text: str) -> tuple[str, int, int, int, float]:
    """(comm, ppid, flags, start, own user + system CPU s) from ``/proc/PID/stat``."""
    comm = text[text.index("(") + 1:text.rindex(")")]
    rest = text.rsplit(")", 1)[1].split()
    # rest[0] is field 3 (state): ppid=4, flags=9, utime=14, stime=15, starttime=22
    return (comm, int(rest[1]), int(rest[6]), int(rest[19]),
            (int(rest[11]) + int(rest[12])) / TICK)


class Processes:
    """Reads every process's CPU; classifies each once (its cgroup read once)."""

    def __init__(self, controller_pid: int | None = None, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self.controller_pid = controller_pid
        self.kinds: dict[Key, str] = {}

    def _kind(self, pid: int, comm: str, ppid: int, flags: int) -> str:
        if pid == os.getpid():
            return "bench"
        if flags & PF_KTHREAD or pid == 2 or ppid == 2:
            return "kernel"
        try:
            cg = (self.proc / str(pid) / "cgroup").read_text()
        except OSError:
            cg = ""
        if "/docker/" in cg or "docker-" in cg:
            return "container"  # before the ancestors: every container is under a shim
        if comm in ENGINE_COMMS:
            return "engine"
        if pid == self.controller_pid:
            return "controller"
        return self._ancestry(ppid)

    def _ancestry(self, ppid: int) -> str:
        """controller or engine when a process descends from one (the CLI's git calls,
        dockerd's re-executed helpers such as ``exe``), else other."""
        for _ in range(8):
            if ppid <= 1:
                return "other"
            if ppid == self.controller_pid:
                return "controller"
            try:
                comm, ppid, _, _, _ = _stat((self.proc / str(ppid) / "stat").read_text())
            except (OSError, ValueError, IndexError):
                return "other"
            if comm in ENGINE_COMMS:
                return "engine"
        return "other"

    def read(self) -> dict[Key, Proc]:
        out: dict[Key, Proc] = {}
        for d in self.proc.iterdir():
            if not d.name.isdigit():
                continue
            try:
                comm, ppid, flags, start, cpu = _stat((d / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            key = (int(d.name), start)
            kind = self.kinds.get(key)
            if kind is None:
                kind = self.kinds[key] = self._kind(key[0], comm, ppid, flags)
            out[key] = Proc(comm, kind, cpu)
        return out


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@dataclass
class HostCpu:
    """Fed one poll at a time (:meth:`poll`); totals over the analyst intervals."""

    controller_pid: int | None = None
    busy_s: float = 0.0
    """Host busy CPU seconds over intervals in which analyst containers existed."""
    self_s: float = 0.0
    """This process's CPU over those same intervals."""
    by_kind: dict[str, float] = field(default_factory=dict)
    by_name: dict[tuple[str, str], float] = field(default_factory=dict)
    _procs: Processes | None = None
    _last: dict[Key, float] = field(default_factory=dict)
    _prev: tuple[int, float, bool] | None = None

    def __post_init__(self) -> None:
        self._procs = Processes(self.controller_pid)
        # what already ran counts from here, not from its start
        self._last = {k: p.cpu_s for k, p in self._procs.read().items()}

    def poll(self, analyst_present: bool) -> None:
        assert self._procs is not None
        busy, _ = cpu_times(Path("/proc/stat").read_text())
        mine = _self_cpu()
        procs = self._procs.read()
        active = self._prev is not None and (analyst_present or self._prev[2])
        for key, p in procs.items():
            before = self._last.get(key, 0.0)  # born meanwhile: all of it is new
            self._last[key] = p.cpu_s
            if active and p.cpu_s > before:
                self.by_kind[p.kind] = self.by_kind.get(p.kind, 0.0) + p.cpu_s - before
                name = (p.kind, p.comm)
                self.by_name[name] = self.by_name.get(name, 0.0) + p.cpu_s - before
        for key in [k for k in self._last if k not in procs]:
            del self._last[key]
        if self._prev is not None and active:
            self.busy_s += (busy - self._prev[0]) / TICK
            self.self_s += mine - self._prev[1]
        self._prev = (busy, mine, analyst_present)

    def engine_s(self) -> float:
        return self.by_kind.get("engine", 0.0)

    def host_s(self) -> float:
        return max(0.0, self.busy_s - self.self_s)

    def attributed_s(self) -> float:
        return max(0.0, self.host_s() - self.by_kind.get("other", 0.0))

    def top(self, n: int = 12) -> dict[str, float]:
        """The processes that used the most CPU over the analyst intervals, by kind/name."""
        ranked = sorted(self.by_name.items(), key=lambda kv: -kv[1])[:n]
        return {f"{k}/{c}": round(v, 2) for (k, c), v in ranked}
