"""The stage scheduler's parts as plain objects (runner/cycle/schedule.py), the look-ahead's
and ``concurrency: auto``'s decisions as pure functions (runner/cycle/concurrency.py), and
the seam's default DeferredRun and the launcher's prepare (its binding held until the
prepared run is used or discarded)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from runner.cycle import concurrency as cc
from runner.cycle.schedule import Gate, Lookahead
from runner.errors import SandboxError
from runner.isolation.launcher import prepare
from runner.isolation.policy import RolePolicy
from runner.isolation.sandbox import DeferredRun, Mount
from tests.fixtures.fake_sandbox import FakeSandbox, Result

GIB = 1024**3


class Stop(Exception):
    pass


def lookahead(n: int, depth: int, log: list[str], fail: int | None = None) -> Lookahead[int]:
    def prep(i: int) -> int:
        log.append(f"prepare {i}")
        if i == fail:
            raise ValueError(f"prepare {i} failed")
        return i

    return Lookahead(n, prepare=prep, discard=lambda v: log.append(f"discard {v}"),
                     depth=lambda: depth, closed=lambda: Stop("closed"))


def wait_until(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# -- Lookahead -----------------------------------------------------------------------------

def test_each_job_takes_its_own_value_once_and_the_depth_is_never_exceeded() -> None:
    log: list[str] = []
    ahead = lookahead(6, depth=2, log=log).start()
    wait_until(lambda: len(log) == 2)
    time.sleep(0.1)
    assert log == ["prepare 0", "prepare 1"]  # two ahead, no more
    assert [ahead.take(i) for i in range(6)] == list(range(6))
    ahead.close()
    assert sorted(log) == sorted(f"prepare {i}" for i in range(6))  # never twice, none left
    with pytest.raises(AssertionError, match="taken twice"):
        ahead.take(3)


def test_a_job_ahead_of_the_preparer_prepares_its_own() -> None:
    log: list[str] = []
    ahead = lookahead(3, depth=0, log=log).start()  # the preparer never gets a slot
    assert ahead.take(0) == 0 and ahead.take(1) == 1
    assert ahead.waits == {0: 0.0, 1: 0.0}
    ahead.close()
    assert log == ["prepare 0", "prepare 1"]


def test_the_preparer_never_gets_ahead_of_a_job_preparing_its_own() -> None:
    """Job 0 prepares its own value (the preparer was not started yet); the preparer
    starts job 1's only once job 0's prepare returned. On a cluster the reverse order
    could give job 1's container the node slot job 0's waits for, and job 1 waits for
    job 0: a stall until the run's deadline."""
    log: list[str] = []
    release = threading.Event()

    def prep(i: int) -> int:
        log.append(f"start {i}")
        if i == 0:
            release.wait(5)
        log.append(f"end {i}")
        return i

    ahead = Lookahead(3, prepare=prep, discard=lambda v: None, depth=lambda: 2,
                      closed=lambda: Stop("closed"))
    got: list[int] = []
    job = threading.Thread(target=lambda: got.append(ahead.take(0)))
    job.start()
    wait_until(lambda: log == ["start 0"])
    ahead.start()
    time.sleep(0.3)
    assert log == ["start 0"], log  # the preparer waits for job 0's own prepare
    release.set()
    job.join(5)
    wait_until(lambda: "end 2" in log)
    assert log == ["start 0", "end 0", "start 1", "end 1", "start 2", "end 2"]
    assert got == [0] and [ahead.take(1), ahead.take(2)] == [1, 2]
    ahead.close()


def test_close_discards_what_no_job_took_and_refuses_later_takes() -> None:
    log: list[str] = []
    ahead = lookahead(5, depth=3, log=log).start()
    wait_until(lambda: len(log) == 3)
    assert ahead.take(0) == 0
    ahead.close()
    assert sorted(x for x in log if x.startswith("discard")) == ["discard 1", "discard 2"]
    for i in (1, 3):
        with pytest.raises(Stop):
            ahead.take(i)
    assert "prepare 3" not in log


def test_a_prepare_that_fails_raises_in_its_own_job_only() -> None:
    log: list[str] = []
    ahead = lookahead(3, depth=3, log=log, fail=1).start()
    assert ahead.take(0) == 0
    with pytest.raises(ValueError, match="prepare 1 failed"):
        ahead.take(1)
    assert ahead.take(2) == 2
    ahead.close()


def test_a_prepare_in_flight_at_close_is_discarded_by_the_preparer() -> None:
    entered, release = threading.Event(), threading.Event()
    discarded: list[int] = []

    def prep(i: int) -> int:
        entered.set()
        release.wait(5)
        return i

    ahead = Lookahead(2, prepare=prep, discard=discarded.append, depth=lambda: 1,
                      closed=lambda: Stop("closed")).start()
    assert entered.wait(5)
    threading.Timer(0.1, release.set).start()
    ahead.close(join_s=5)
    assert discarded == [0]


def test_a_job_waiting_on_a_stuck_prepare_is_released_by_close() -> None:
    """A prepare stuck in the engine holds no job past close(): the job waiting for that
    slot gets the closed error at once, and the preparer discards the late value."""
    entered, release = threading.Event(), threading.Event()
    discarded: list[int] = []

    def prep(i: int) -> int:
        entered.set()
        release.wait(10)
        return i

    ahead = Lookahead(2, prepare=prep, discard=discarded.append, depth=lambda: 1,
                      closed=lambda: Stop("closed")).start()
    assert entered.wait(5)
    got: list[BaseException] = []

    def job() -> None:
        try:
            ahead.take(0)
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=job)
    t.start()
    time.sleep(0.1)  # the job waits on the slot being prepared
    ahead.close(join_s=0)
    t.join(2)
    assert not t.is_alive() and [type(e) for e in got] == [Stop]
    release.set()
    wait_until(lambda: discarded == [0])


# -- Gate ----------------------------------------------------------------------------------

def test_the_gate_admits_in_order_and_follows_its_limit() -> None:
    gate = Gate(2)
    order: list[int] = []
    lock = threading.Lock()
    peak = [0]

    def job(i: int) -> None:
        gate.enter(i)
        with lock:
            order.append(i)
            peak[0] = max(peak[0], gate.inside)
        time.sleep(0.02)
        gate.leave()

    threads = [threading.Thread(target=job, args=(i,)) for i in reversed(range(8))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == list(range(8))
    assert peak[0] <= 2


def test_an_open_gate_lets_every_waiting_job_through() -> None:
    gate = Gate(1)
    gate.enter(0)
    passed = threading.Event()
    def second() -> None:
        gate.enter(1)
        passed.set()

    t = threading.Thread(target=second)
    t.start()
    assert not passed.wait(0.1)
    gate.open()
    assert passed.wait(5)


# -- concurrency: auto ---------------------------------------------------------------------

BOUNDS = cc.Bounds(per_case_bytes=GIB // 2, ceiling=32)


@pytest.mark.parametrize(("current", "busy", "free", "expected"), [
    (2, 0.10, 20 * GIB, 4),     # an idle CPU (a slow model): doubles
    (16, 0.10, 20 * GIB, 32),   # up to the ceiling
    (32, 0.10, 20 * GIB, 32),   # never past it
    (8, 0.60, 20 * GIB, 10),    # some headroom: a quarter more
    (8, 0.85, 20 * GIB, 10),    # still some: a quarter more
    (8, 0.93, 20 * GIB, 8),     # busy: holds
    (8, 0.99, 20 * GIB, 6),     # saturated: a quarter less
    (1, 0.99, 20 * GIB, 1),     # never below the floor
    (4, 0.10, 1 * GIB, 5),      # idle but the memory fits one more at the limit
    (8, 0.10, 0, 8),            # no memory left: holds however idle the CPU
    (8, 0.60, GIB // 4, 8),
])
def test_decide(current: int, busy: float, free: int, expected: int) -> None:
    assert cc.decide(current, cc.Sample(cpu_busy=busy, mem_available=free), BOUNDS) == expected


def test_decide_lowers_when_memory_shrinks_below_the_running_ones() -> None:
    # memory_cap counts the running ones as already charged: with nothing free it holds,
    # and a ceiling below the current (fewer cases left) lowers it
    small = cc.Bounds(per_case_bytes=GIB // 2, ceiling=4)
    assert cc.decide(8, cc.Sample(cpu_busy=0.1, mem_available=0), small) == 4


def test_one_saturated_second_does_not_lower_the_count_a_saturated_stretch_does() -> None:
    # auto decides on the smoothed CPU share: a single spike (agents starting at once)
    # is averaged away, a CPU that stays saturated lowers the count; memory is not averaged
    seen = None
    limits = []
    for busy in (0.93, 0.99, 0.93, 0.99, 1.0, 1.0):
        seen = cc.smooth(seen, cc.Sample(cpu_busy=busy, mem_available=20 * GIB))
        limits.append(cc.decide(8, seen, BOUNDS))
    assert limits == [8, 8, 8, 8, 6, 6]
    raw = [cc.decide(8, cc.Sample(cpu_busy=b, mem_available=20 * GIB), BOUNDS)
           for b in (0.93, 0.99)]
    assert raw == [8, 6]  # what deciding on each raw second did
    shrunk = cc.smooth(seen, cc.Sample(cpu_busy=0.1, mem_available=0))
    assert shrunk.mem_available == 0 and cc.decide(8, shrunk, BOUNDS) == 8


def test_auto_starts_from_the_cores_within_memory() -> None:
    assert cc.initial(2, 20 * GIB, BOUNDS) == 2
    assert cc.initial(16, 2 * GIB, BOUNDS) == 3  # 0.8 x 2 GiB holds three at 512 MiB
    assert cc.initial(16, 0, BOUNDS) == 1


def test_lookahead_is_bounded_by_concurrency_and_memory() -> None:
    assert cc.lookahead(4, 20 * GIB, GIB // 2) == 4
    assert cc.lookahead(4, 4 * GIB, GIB // 2, running=4) == 2  # 0.8 x 4 GiB holds 6
    assert cc.lookahead(4, 2 * GIB, GIB // 2, running=4) == 0  # the running ones may grow
    assert cc.lookahead(32, 21 * GIB, GIB // 2, running=32) == 1
    assert cc.lookahead(4, 0, GIB // 2, running=4) == 0
    assert cc.lookahead(1, 20 * GIB, 6 * GIB) == 1
    assert cc.lookahead(2, 8 * GIB, 6 * GIB) == 0  # one at 6 GiB fits, not two running


def test_proc_parsing() -> None:
    stat = "cpu  100 5 50 800 45 0 0 0 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert cc.cpu_times(stat) == (155, 1000)
    assert cc.mem_available("MemTotal: 10 kB\nMemAvailable:   2048 kB\n") == 2 * 1024 * 1024
    with pytest.raises(ValueError):
        cc.mem_available("MemTotal: 10 kB\n")


def test_the_host_probe_reads_this_machine() -> None:
    probe = cc.HostProbe()
    time.sleep(0.05)
    s = probe.sample()
    assert 0.0 <= s.cpu_busy <= 1.0 and s.mem_available > 0


def test_a_fixed_setting_is_recorded_as_it_is(tmp_path: Path) -> None:
    control = cc.Control(3, 10, per_case_bytes=GIB // 2)
    control.depth(0)
    assert control.limit == 3 and control.workers == 3
    assert control.timings("baseline") == {"baseline.concurrency": 3.0,
                                           "baseline.lookahead_max": 3.0}


def test_stop_before_the_thread_started_is_quiet() -> None:
    """A signal between making the auto-concurrency thread and starting it: stop() in the
    stage's ``finally`` must not replace that signal with a RuntimeError."""
    control = cc.Control("auto", 4, per_case_bytes=GIB // 2, interval_s=0.01)
    control._thread = threading.Thread(target=lambda: None)
    control.stop()


def test_auto_raises_the_limit_while_the_host_is_idle() -> None:
    class Idle:
        def memory(self) -> int:
            return 20 * GIB

        def sample(self) -> cc.Sample:
            return cc.Sample(cpu_busy=0.0, mem_available=20 * GIB)

    control = cc.Control("auto", 40, per_case_bytes=GIB // 2, probe=Idle(),  # type: ignore[arg-type]
                         interval_s=0.01)
    seen: list[int] = []
    control.start(seen.append)
    wait_until(lambda: control.limit == 40)
    control.stop()
    assert seen[-1] == 40 and seen == sorted(seen)
    t = control.timings("baseline")
    assert t["baseline.concurrency.auto_max"] == 40.0
    assert t["baseline.concurrency"] == float(min(cc.cores(), 40))


# -- the seam: DeferredRun, launcher.prepare -------------------------------------------------

def spec_policy() -> RolePolicy:
    return RolePolicy(image="analyst", memory=GIB // 2, cpus=1.0, pids=64, timeout_s=10,
                      upstream="target")


def test_a_deferred_run_runs_once_and_never_after_a_discard(tmp_path: Path) -> None:
    box = FakeSandbox({"analyst": lambda _c: Result()})
    p = prepare(box, spec_policy(), role="analyst", run_id="r1", image="img",
                command=["true"])
    assert box.specs == []  # nothing ran yet
    d = DeferredRun(box, p.spec)
    d.run()
    with pytest.raises(SandboxError, match="already used"):
        d.run()
    d.discard()  # after the run: nothing
    d2 = DeferredRun(box, p.spec)
    d2.discard()
    with pytest.raises(SandboxError, match="already used or discarded"):
        d2.run()
    assert len(box.specs) == 1
    p.discard()


class Binder:
    """A GatewayBinder that counts its open bindings."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.open = 0
        self.exits: list[str | None] = []

    @contextmanager
    def bound(self, role: str, *, stage: str, uid: int, case: str | None = None,
              trial: int | None = None) -> Iterator[Binder]:
        self.open += 1
        try:
            yield self
        except BaseException as exc:
            self.exits.append(type(exc).__name__)
            raise
        else:
            self.exits.append(None)
        finally:
            self.open -= 1

    def mount(self) -> Mount:
        return Mount(source=self.tmp, target="/run/cyclebox", gateway=True)

    def env(self) -> dict[str, str]:
        return {"OPENAI_API_KEY": "token"}


@pytest.mark.parametrize("end", ["run", "discard", "fail"])
def test_the_binding_lives_until_the_prepared_run_is_used(tmp_path: Path, end: str) -> None:
    def behaviour(_c: object) -> Result:
        if end == "fail":
            raise SandboxError("engine gone")
        assert binder.open == 1  # bound while the container runs
        return Result()

    box = FakeSandbox({"analyst": behaviour})
    binder = Binder(tmp_path)
    p = prepare(box, spec_policy(), role="analyst", run_id="r1", image="img",
                command=["true"], gateway=binder)
    assert binder.open == 1
    assert dict(p.spec.env)["OPENAI_API_KEY"] == "token"
    if end == "discard":
        p.discard()
    elif end == "run":
        p.run()
    else:
        with pytest.raises(SandboxError):
            p.run()
    assert binder.open == 0
    assert binder.exits == [("SandboxError" if end == "fail" else None)]
    p.discard()
    assert binder.exits == [("SandboxError" if end == "fail" else None)]  # released once


def test_a_failed_prepare_releases_its_binding_at_once(tmp_path: Path) -> None:
    box = FakeSandbox({})
    box.prepare_error = lambda _s: SandboxError("create failed")
    binder = Binder(tmp_path)
    with pytest.raises(SandboxError, match="create failed"):
        prepare(box, spec_policy(), role="analyst", run_id="r1", image="img",
                command=["true"], gateway=binder)
    assert binder.open == 0


def test_unknown_memory_prepares_nothing_ahead() -> None:
    class Blind:
        def memory(self) -> int:
            raise OSError("no /proc")

    control = cc.Control(4, 10, per_case_bytes=GIB // 2, probe=Blind())  # type: ignore[arg-type]
    assert control.depth(0) == 0
    assert control.timings("baseline")["baseline.lookahead_max"] == 0.0


def test_auto_without_proc_starts_at_the_cores_and_stays(tmp_path: Path) -> None:
    probe = cc.HostProbe(tmp_path)  # an empty directory: no stat, no meminfo
    with pytest.raises((OSError, ValueError)):
        probe.sample()
    control = cc.Control("auto", 10, per_case_bytes=GIB // 2, probe=probe, interval_s=0.01)
    assert control.limit == min(cc.cores(), 10)
    control.start(lambda _n: None)
    time.sleep(0.1)
    control.stop()
    assert control.chosen == [control.limit]
    assert control.depth(0) == 0
