"""How many analyst cases run at once, and how many are prepared ahead of them.

A fixed ``concurrency: N`` is N. ``concurrency: auto`` starts from the cores and the memory
the host has free, then follows the host: a slow model leaves the CPU idle and the memory
free, so it raises the count; a busy CPU holds it, a saturated CPU or shrinking memory
lowers it. :func:`decide` is the whole policy, a pure function of one sample (its CPU
share averaged with the earlier ones by :func:`smooth`); the sampler only reads
``/proc/stat`` and ``/proc/meminfo``. The values chosen go into the receipt's
``timing`` (never into the plan, which says ``auto``): outcomes do not depend on them.

The look-ahead (:func:`lookahead`) is bounded by memory as the kernel will enforce it:
every prepared container may grow to its role's memory limit once its case runs, so
running plus prepared containers times the limit stays within the memory available.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

AUTO_CEILING = 64
"""The most cases ``auto`` ever runs at once (the config's own maximum)."""
MEMORY_SHARE = 0.8
"""Share of the host's available memory that running and prepared containers may claim
at their limits; the rest is left to the controller, the gateway and everyone else."""
CPU_LOW = 0.5
"""Below this busy share the CPU is mostly idle: the count doubles."""
CPU_HIGH = 0.9
"""Below this it grows by a quarter; between this and :data:`CPU_SATURATED` it holds.
Measured with a 2 s model on 2 cores (bench/throughput.py): a stage whose cases are CPU
bound never shows more than ~0.95 busy (iowait and the engine's waits count as idle);
at 0.8 ``auto`` settled at 6-8 cases, short of the 16 that ran fastest."""
CPU_SATURATED = 0.97
"""Above this busy share (smoothed) the count drops by a quarter: the CPU is pegged, and
more cases at once only cost memory and CPU per case (every agent's start slowed)."""


@dataclass(frozen=True)
class Sample:
    """What the host looked like over the last interval."""

    cpu_busy: float
    """Share of all cores busy (0..1), every process on the host counted."""
    mem_available: int
    """``MemAvailable`` in bytes."""


@dataclass(frozen=True)
class Bounds:
    """What a decision may not cross."""

    per_case_bytes: int
    """The analyst role's memory limit (what one more running case may claim)."""
    ceiling: int = AUTO_CEILING
    """The most at once (never more than the cases of the stage, either)."""
    floor: int = 1


def memory_cap(mem_available: int, per_case_bytes: int, running: int = 0) -> int:
    """How many containers may hold their memory limit at once: those already running
    (their use is outside ``mem_available``) plus what the available share fits."""
    return running + int(mem_available * MEMORY_SHARE) // max(1, per_case_bytes)


def initial(cores: int, mem_available: int, bounds: Bounds) -> int:
    """Where ``auto`` starts: one case per core, within memory and the bounds."""
    cap = memory_cap(mem_available, bounds.per_case_bytes)
    return max(bounds.floor, min(bounds.ceiling, cores, cap))


SMOOTHING = 0.5
"""Weight of the past in the CPU share ``auto`` decides on (:func:`smooth`): one second
of a CPU-bound stage swings between 0.8 and 1.0 as agents start and wait, and deciding
on each raw sample lowered and raised the count nearly every second."""


def smooth(past: Sample | None, sample: Sample) -> Sample:
    """``sample`` with its CPU share averaged exponentially with the past ones; memory is
    never averaged (a shrinking ``MemAvailable`` must lower the count at once)."""
    if past is None:
        return sample
    busy = SMOOTHING * past.cpu_busy + (1 - SMOOTHING) * sample.cpu_busy
    return Sample(cpu_busy=busy, mem_available=sample.mem_available)


def decide(current: int, sample: Sample, bounds: Bounds) -> int:
    """The next concurrency after ``sample`` was taken while ``current`` ran; pure."""
    if sample.cpu_busy > CPU_SATURATED:
        want = current - max(1, current // 4)
    elif sample.cpu_busy < CPU_LOW:
        want = current * 2
    elif sample.cpu_busy < CPU_HIGH:
        want = current + max(1, current // 4)
    else:
        want = current
    # Memory first among the bounds: more cases than the memory holds is never right,
    # however idle the CPU is (a shrinking MemAvailable lowers the count at once).
    cap = memory_cap(sample.mem_available, bounds.per_case_bytes, running=current)
    return max(bounds.floor, min(want, cap, bounds.ceiling))


def lookahead(concurrency: int, mem_available: int, per_case_bytes: int,
              running: int = 0) -> int:
    """Containers prepared ahead of the running ones: up to one per running case, and only
    while running plus prepared ones, every one counted at the role's limit (a running
    case may still grow to it), fit the available share."""
    room = memory_cap(mem_available, per_case_bytes) - max(running, concurrency)
    return max(0, min(concurrency, room))


# -- the host ---------------------------------------------------------------------
def cpu_times(stat: str) -> tuple[int, int]:
    """(busy, total) jiffies of all cores from the text of ``/proc/stat``."""
    for line in stat.splitlines():
        if line.startswith("cpu "):
            fields = [int(f) for f in line.split()[1:]]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
            # guest time is already counted in user (fields 8, 9): leave them out
            total = sum(fields[:8])
            return total - idle, total
    raise ValueError("/proc/stat has no aggregate cpu line")


def mem_available(meminfo: str) -> int:
    """``MemAvailable`` in bytes from the text of ``/proc/meminfo``."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("/proc/meminfo has no MemAvailable line")


class HostProbe:
    """Samples the host; each :meth:`sample` covers the time since the previous one."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        try:
            self._last: tuple[int, int] | None = cpu_times((proc / "stat").read_text())
        except (OSError, ValueError):
            self._last = None  # no /proc here: every sample raises, nothing is decided

    def memory(self) -> int:
        return mem_available((self.proc / "meminfo").read_text())

    def sample(self) -> Sample:
        busy, total = cpu_times((self.proc / "stat").read_text())
        last, self._last = self._last, (busy, total)
        if last is None:
            raise ValueError("no earlier /proc/stat sample to compare with")
        d_busy, d_total = busy - last[0], total - last[1]
        share = d_busy / d_total if d_total > 0 else 1.0
        return Sample(cpu_busy=min(1.0, max(0.0, share)), mem_available=self.memory())


def cores() -> int:
    """Cores this process may use (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0))


AUTO_INTERVAL_S = 1.0
"""How often ``auto`` samples the host and decides."""


class Control:
    """One stage's concurrency and look-ahead: fixed, or ``auto`` following the host."""

    def __init__(self, setting: int | str, jobs: int, *, per_case_bytes: int,
                 probe: HostProbe | None = None, interval_s: float = AUTO_INTERVAL_S) -> None:
        self.auto = setting == "auto"
        self.probe = probe or HostProbe()
        self.per_case_bytes = per_case_bytes
        self.interval_s = interval_s
        self.bounds = Bounds(per_case_bytes=per_case_bytes,
                             ceiling=max(1, min(AUTO_CEILING, jobs)))
        if self.auto:
            try:
                free = self.probe.memory()
            except (OSError, ValueError):  # memory unknown: one case per core
                free = int(cores() * per_case_bytes / MEMORY_SHARE) + 1
            self.limit = initial(cores(), free, self.bounds)
        else:
            self.limit = int(setting)
        self.workers = self.bounds.ceiling if self.auto else max(1, min(self.limit, jobs))
        """Threads the stage needs: the most cases that may ever run at once."""
        self.chosen: list[int] = [self.limit]
        self.deepest = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def depth(self, running: int) -> int:
        """How many containers may wait prepared now."""
        try:
            free = self.probe.memory()
        except (OSError, ValueError):
            return 0  # memory unknown: nothing ahead (the cases still run)
        d = lookahead(self.limit, free, self.per_case_bytes, running=running)
        self.deepest = max(self.deepest, d)
        return d

    def start(self, set_limit: Callable[[int], None]) -> None:
        if not self.auto:
            return
        self._thread = threading.Thread(target=self._loop, args=(set_limit,),
                                        name="auto-concurrency", daemon=True)
        self._thread.start()

    def _loop(self, set_limit: Callable[[int], None]) -> None:
        seen: Sample | None = None
        while not self._stop.wait(self.interval_s):
            try:
                seen = smooth(seen, self.probe.sample())
            except (OSError, ValueError):
                continue  # a failed read changes nothing
            nxt = decide(self.limit, seen, self.bounds)
            if nxt != self.limit:
                self.limit = nxt
                self.chosen.append(nxt)
                set_limit(nxt)

    def stop(self) -> None:
        self._stop.set()
        # is_alive: a signal may have landed between making the thread and starting it
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(self.interval_s * 2)

    def timings(self, stage: str) -> dict[str, float]:
        """The receipt's timing keys: the concurrency (first, lowest, highest, last and
        how often it changed, for ``auto``) and the deepest look-ahead."""
        out = {f"{stage}.concurrency": float(self.chosen[0]),
               f"{stage}.lookahead_max": float(self.deepest)}
        if self.auto:
            out.update({f"{stage}.concurrency.auto_min": float(min(self.chosen)),
                        f"{stage}.concurrency.auto_max": float(max(self.chosen)),
                        f"{stage}.concurrency.auto_last": float(self.chosen[-1]),
                        f"{stage}.concurrency.auto_changes": float(len(self.chosen) - 1)})
        return out
