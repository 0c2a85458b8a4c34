"""The cycle runner's analyst stages with containers prepared ahead (issue 23), through the
scripted sandbox's prepared runs (tests/fixtures/fake_sandbox.py): one spec, one run;
none outlives an interrupt, a budget halt or an engine error; none sees another case's
inputs; every case x trial exactly once, in plan order; outcomes the same at any
concurrency, ``auto`` included."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner import interrupts
from runner.cycle import run as run_module
from runner.cycle.plan import freeze
from runner.cycle.receipt import build, compare_receipts
from runner.cycle.run import CycleRunner
from runner.errors import SandboxError
from runner.gateway.server import CONTAINER_DIR
from tests.fixtures.cycle_project import example_agent, project_with_agent
from tests.fixtures.fake_sandbox import Call, FakeSandbox, Result
from tests.unit.test_cycle_runner import (
    IMAGES,
    POLICY_CASES,
    Freeze,
    analyst,
    fake,
    records,
    run,
    script,
)


@pytest.fixture
def planned(tmp_path: Path) -> Freeze:
    """test_cycle_runner's fixture, the policy's trials following the cycle's."""
    def make(**changes: Any) -> Path:
        cycle = project_with_agent(tmp_path / "project", example_agent(), **changes)
        policy = yaml.safe_load((cycle.parent / "policy.yaml").read_text())
        policy.pop("max_total_cost_usd")
        policy["trials"] = changes.get("trials", 1)
        (cycle.parent / "policy.yaml").write_text(yaml.safe_dump(policy))
        freeze(cycle, tmp_path / "run", images=IMAGES)
        return tmp_path / "run" / "plan.json"
    return make


def analyst_runs(box: FakeSandbox) -> list[Any]:
    return [p for p in box.prepared if p.spec.role == "analyst"]


def placement(spec: Any) -> tuple[str, str, str]:
    labels = dict(spec.labels)
    return labels["io.cyclebox.stage"], labels["io.cyclebox.case"], labels["io.cyclebox.trial"]


def signal_on_second_submit(started: threading.Event) -> type:
    """The stage's pool, with the signal landing at its second submit (as the handler
    raises it, mid-submit), once the first job runs."""
    class SignalOnSecondSubmit(run_module.ThreadPoolExecutor):
        submitted = 0

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            type(self).submitted += 1
            if type(self).submitted == 2:
                assert started.wait(5), "the first job never ran"
                raise KeyboardInterrupt
            return super().submit(fn, *args, **kwargs)
    return SignalOnSecondSubmit


@pytest.mark.parametrize("concurrency", [1, 3, "auto"])
def test_every_case_runs_once_in_its_own_container(planned: Freeze,
                                                   concurrency: int | str) -> None:
    plan = planned(concurrency=concurrency, trials=2, seeds=[7, 8])
    seen: list[tuple[str, str]] = []

    def own_inputs(call: Call) -> Result:
        # the /case mount holds this case's input and nothing else
        case_dir = call.mount("/case")
        assert sorted(p.name for p in case_dir.iterdir()) == ["input.json"]
        assert case_dir.parent.name == f"{call.case}__t{call.labels['io.cyclebox.trial']}"
        assert dict(call.spec.env)["CYCLEBOX_CASE_ID"] == call.case
        seen.append((str(call.case), call.labels["io.cyclebox.trial"]))
        return analyst(call)

    box = fake(script(analyst=own_inputs))
    outcome = run(plan, box)
    assert outcome.failure is None, outcome.result.reasons
    runs = analyst_runs(box)
    assert all(p.state == "ran" and p.uses == 1 for p in runs)
    assert box.live() == []
    # one container per case x trial x side, each spec run once, no spec shared
    assert len(runs) == 2 * POLICY_CASES * 2  # two trials, two sides
    assert len({id(p.spec) for p in runs}) == len(runs)
    counts = Counter(placement(p.spec) for p in runs)
    assert set(counts.values()) == {1}
    mounts = [next(m.source for m in p.spec.mounts if m.target == "/case") for p in runs]
    assert len(set(mounts)) == len(mounts)
    outs = [p.spec.output_dir for p in runs]
    assert len(set(outs)) == len(outs)
    gateways = [next(m.source for m in p.spec.mounts if m.target == CONTAINER_DIR)
                for p in runs]
    assert len(set(gateways)) == len(gateways)  # a socket per container
    # results in plan order: case by case, trial by trial
    base = [json.loads(x) for x in
            (plan.parent / "stages" / "baseline" / "records.jsonl").read_text().splitlines()]
    keys = [(r["case_id"], r["trial"]) for r in base]
    assert keys == [(c, t) for c in dict.fromkeys(k[0] for k in keys) for t in (0, 1)]
    timing = outcome.timings
    assert timing["baseline.concurrency"] >= 1
    assert all(f"baseline.prepared_wait_s.{c}__t{t}" in timing for c, t in keys)


def test_the_next_cases_are_prepared_while_one_runs(planned: Freeze) -> None:
    plan = planned(concurrency=1)
    box: FakeSandbox

    def slow_first(call: Call) -> Result:
        if call.stage == "baseline" and len([p for p in analyst_runs(box)
                                             if p.state == "ran"]) == 0:
            deadline = time.monotonic() + 5
            while len(analyst_runs(box)) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            ahead = [p for p in analyst_runs(box) if p.state == "prepared"]
            assert ahead, "nothing was prepared while the first case ran"
            time.sleep(0.05)
        return analyst(call)

    box = fake(script(analyst=slow_first))
    outcome = run(plan, box)
    assert outcome.failure is None, outcome.result.reasons
    waits = [v for k, v in outcome.timings.items()
             if k.startswith("baseline.prepared_wait_s.") and "__t" in k]
    assert max(waits) > 0  # a case took a container that had waited for it
    assert outcome.timings["baseline.lookahead_max"] >= 1
    assert box.live() == []


@pytest.fixture
def controller_signals() -> Iterator[None]:
    """SIGINT handled as the CLI handles it (``interrupts.install``), whatever this
    process inherited: a test run started in the background ignores SIGINT."""
    state = interrupts._state
    saved = (state.signals, state.shield, state.pending, state.redeliver, state.handled)
    previous = signal.signal(signal.SIGINT, interrupts._handler)
    state.signals, state.shield, state.pending, state.redeliver = 0, 0, False, False
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        state.signals, state.shield, state.pending, state.redeliver, state.handled = saved


@pytest.mark.usefixtures("controller_signals")
def test_an_interrupt_mid_stage_discards_every_prepared_container(planned: Freeze) -> None:
    plan = planned(concurrency=1)
    sent: list[bool] = []

    def interrupting(call: Call) -> Result:
        # once, at the first call from the third case on (">=": the next case may have
        # taken its container already, as its job may once this one's command ended)
        if call.stage == "baseline" and not sent and len([
                p for p in analyst_runs(box) if p.state != "prepared"]) >= 3:
            sent.append(True)
            deadline = time.monotonic() + 5
            while not [p for p in analyst_runs(box) if p.state == "prepared"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # as a terminal's SIGINT reaches the controller: in its main thread
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            time.sleep(0.5)
        return analyst(call)

    box = fake(script(analyst=interrupting))
    outcome = run(plan, box)
    assert outcome.failure is not None and outcome.failure.reason == "interrupted"
    assert box.live() == []
    assert [p for p in analyst_runs(box) if p.state == "discarded"], [
        (placement(p.spec), p.state) for p in box.prepared]
    assert all(p.uses <= 1 for p in box.prepared)


@pytest.mark.usefixtures("controller_signals")
def test_a_prepare_in_flight_at_an_interrupt_gives_up_with_the_run(planned: Freeze) -> None:
    """A container being prepared when the run stops (its prepare waiting on the engine or
    the holder's READY) is told so: the prepare gives up and removes what it made before
    the cycle returns, rather than finishing after the controller is gone (a container
    only the next ``gc`` would remove)."""
    plan = planned(concurrency=1)
    blocking = threading.Event()

    def slow(spec: Any, cancel: threading.Event | None) -> None:
        if spec.role != "analyst" or len(analyst_runs(box)) < 2:
            return
        blocking.set()  # the third analyst container: stuck until the run stops
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise SandboxError("analyst container not started: the run is stopping")
            time.sleep(0.01)

    sent: list[bool] = []

    def interrupting(call: Call) -> Result:
        if call.stage == "baseline" and not sent and blocking.wait(5):
            sent.append(True)
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            time.sleep(0.5)
        return analyst(call)

    box = fake(script(analyst=interrupting))
    box.prepare_wait = slow
    outcome = run(plan, box)
    assert outcome.failure is not None and outcome.failure.reason == "interrupted"
    assert box.in_prepare == 0, "a prepare goes on after the cycle returned"
    assert box.live() == []


def test_an_interrupt_while_jobs_are_submitted_stops_the_jobs_already_running(
        planned: Freeze, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal lands while the stage submits its jobs (each submit may start a thread
    and wait for it): the jobs already running are stopped and waited for like any
    others, so none goes on preparing or running containers, or writing into the run
    directory, after the cycle returned (CI: a case's crash log after the receipt)."""
    plan = planned(concurrency=1)
    started = threading.Event()
    ran_after: list[float] = []
    returned: list[float] = []

    def slow(call: Call) -> Result:
        if call.stage == "baseline":
            started.set()
            time.sleep(0.5)
            if returned:
                ran_after.append(time.monotonic())
        return analyst(call)

    monkeypatch.setattr(run_module, "ThreadPoolExecutor", signal_on_second_submit(started))
    box = fake(script(analyst=slow))
    outcome = run(plan, box)
    returned.append(time.monotonic())
    prepared = len(box.prepared)
    time.sleep(1.0)  # what a job left running would do meanwhile
    assert outcome.failure is not None and outcome.failure.reason == "interrupted"
    assert ran_after == [], "a baseline case was still running after the cycle returned"
    assert len(box.prepared) == prepared, "containers prepared after the cycle returned"
    assert box.live() == []
    assert not list((plan.parent / "logs").glob("error-*")), "a case crashed on the way out"
    assert all(p.uses <= 1 for p in box.prepared)


def test_a_first_signal_delivered_again_does_not_cut_the_stop_cleanup_short(
        planned: Freeze, monkeypatch: pytest.MonkeyPatch) -> None:
    """runner.interrupts delivers a swallowed first signal again a moment later; landing
    in the stage's stop cleanup, it is held there (shielded), so the cleanup drains the
    jobs before the stage unwinds."""
    plan = planned(concurrency=1)
    started = threading.Event()

    def slow(call: Call) -> Result:
        if call.stage == "baseline":
            started.set()
            time.sleep(0.3)
        return analyst(call)

    log: list[str] = []
    calls: list[int] = []
    drain = CycleRunner._drain
    state = interrupts._state
    saved = (state.signals, state.shield, state.pending, state.redeliver, state.handled)

    def drain_redelivered(self: CycleRunner, futures: Any) -> None:
        calls.append(1)
        if len(calls) == 1:  # the stage's stop cleanup; later ones are _finish's backstop
            state.signals, state.redeliver = 1, True  # the first signal, delivered again
            interrupts._handler(signal.SIGTERM, None)
            drain(self, futures)
            log.append("stop cleanup drained")
        else:
            drain(self, futures)
            log.append("drained again")

    monkeypatch.setattr(run_module, "ThreadPoolExecutor", signal_on_second_submit(started))
    monkeypatch.setattr(CycleRunner, "_drain", drain_redelivered)
    try:
        outcome = run(plan, box := fake(script(analyst=slow)))
    finally:
        state.signals, state.shield, state.pending, state.redeliver, state.handled = saved
    assert outcome.failure is not None and outcome.failure.reason == "interrupted"
    assert log[:1] == ["stop cleanup drained"], log
    assert box.live() == []


def test_a_budget_halt_discards_what_was_prepared(planned: Freeze) -> None:
    plan = planned(concurrency=1)
    runner: CycleRunner

    def halting(call: Call) -> Result:
        # the look-ahead has the next container waiting when the budget halts (as the
        # gateway halts it on an unknown or excess cost) during the second case
        if call.stage == "baseline" and len(analyst_runs(box)) >= 2:
            deadline = time.monotonic() + 5
            while not [p for p in analyst_runs(box) if p.state == "prepared"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            runner.budget.halted = "unknown cost for a analyst call"
        return analyst(call)

    box = fake(script(analyst=halting))
    runner = CycleRunner(plan, sandbox=box)
    runner.run()
    base = records(plan, "baseline")
    not_attempted = [c for c, r in base.items() if r["status"] == "not_attempted"]
    assert len(not_attempted) == POLICY_CASES - 2, base
    assert all(base[c]["reason"] == "budget: unknown cost for a analyst call"
               for c in not_attempted)
    assert box.live() == []
    discarded = [p for p in analyst_runs(box) if p.state == "discarded"]
    assert len(discarded) == 1  # prepared before the halt, removed unrun
    ran = {placement(p.spec)[1] for p in analyst_runs(box) if p.state == "ran"}
    assert len(ran) == 2 and not ran & set(not_attempted)
    # nothing is prepared once the budget halted
    assert len(analyst_runs(box)) == 3


@pytest.mark.parametrize("where", ["run", "prepare"])
def test_an_engine_error_discards_every_prepared_container(planned: Freeze,
                                                           where: str) -> None:
    plan = planned(concurrency=2)
    started = threading.Event()

    def failing(call: Call) -> Result:
        if call.stage == "baseline" and where == "run" and len(analyst_runs(box)) >= 4:
            raise SandboxError("engine connection lost")
        started.set()
        return analyst(call)

    box = fake(script(analyst=failing))
    if where == "prepare":
        n = [0]

        def error(spec: Any) -> Exception | None:
            n[0] += 1
            return SandboxError("engine connection lost") if n[0] == 5 else None
        box.prepare_error = error
    outcome = run(plan, box)
    assert outcome.failure is not None and outcome.failure.reason == "engine_error", (
        outcome.result.reasons)
    assert box.live() == []
    assert all(p.uses <= 1 for p in box.prepared)


def test_a_prepare_that_fails_for_its_own_reasons_invalidates_that_case_only(
        planned: Freeze) -> None:
    plan = planned(concurrency=2)
    box = fake(script())
    box.prepare_error = lambda s: (ValueError("bad spec") if dict(s.labels).get(
        "io.cyclebox.case") == "a01-revenue-april" else None)
    outcome = run(plan, box)
    base = records(plan, "baseline")
    assert base["a01-revenue-april"]["status"] == "infra_invalid"
    assert "bad spec" in base["a01-revenue-april"]["reason"]
    assert sum(r["status"] == "ok" for r in base.values()) == len(base) - 1
    assert box.live() == []
    assert outcome.failure is None


def test_outcome_hashes_do_not_depend_on_concurrency(planned: Freeze, tmp_path: Path) -> None:
    receipts = []
    for setting in (1, 4, "auto"):
        plan = planned(concurrency=setting)
        receipts.append(build(run(plan, fake(script()))))
        plan.parent.rename(tmp_path / f"run-{setting}")
        (tmp_path / "project").rename(tmp_path / f"project-{setting}")
    for other in receipts[1:]:
        rows = {r.key: r for r in compare_receipts(receipts[0], other)}
        assert any(k.startswith("outcome.") for k in rows)
        assert "inputs.concurrency" not in rows  # how many ran at once is no input of theirs
        assert all(r.equal for r in rows.values()), [k for k, r in rows.items() if not r.equal]


def test_the_next_case_starts_while_the_last_container_is_removed(
        planned: Freeze, monkeypatch: pytest.MonkeyPatch) -> None:
    """At concurrency 1 a case leaves the gate when its command ended (``ended``), so the
    next one runs while the last one's container is still removed and recorded."""
    from tests.fixtures.fake_sandbox import FakePrepared

    plan = planned(concurrency=1, trials=2, seeds=[7, 8])
    started: list[str] = []
    second = threading.Event()
    overlapped: list[bool] = []

    def behaviour(call: Call) -> Result:
        started.append(str(call.case))
        if len(started) == 2:
            second.set()
        return analyst(call)

    orig = FakePrepared.run

    def run_(self: Any, *, on_output: Any = None, cancel: Any = None,
             ended: Any = None, handing: Any = None) -> Any:
        def ended_then_removing() -> None:
            if ended is not None:
                ended()
            if self.spec.role == "analyst" and len(started) == 1:
                # this container is "still being removed": the next case must start now
                overlapped.append(second.wait(10))

        return orig(self, on_output=on_output, cancel=cancel, ended=ended_then_removing,
                    handing=handing)

    monkeypatch.setattr(FakePrepared, "run", run_)
    outcome = run(plan, fake(script(analyst=behaviour)))
    assert outcome.failure is None, outcome.result.reasons
    assert overlapped == [True]


def test_receipt_compare_verifies_both_runs_before_it_compares(planned: Freeze,
                                                               tmp_path: Path) -> None:
    """An attack review: compare read only what the two receipts claim, so a run whose
    verdict and grades were edited after its receipt compared equal (exit 0), and
    compare exit 0 is what the docs give as evidence that a run reproduced."""
    import os
    import shutil
    import subprocess
    import sys

    plan = planned(concurrency=1)
    build(run(plan, fake(script())))  # the receipt, as the CLI writes it after a run
    one, other = plan.parent, tmp_path / "other"
    shutil.copytree(one, other)
    cmd = [str(Path(sys.executable).with_name("cyclebox")), "receipt", "compare", str(one),
           str(other)]
    env = {**os.environ, "COLUMNS": "300"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    verdict = other / "stages" / "compare" / "verdict.json"
    verdict.write_text(verdict.read_text().replace("accept_for_review", "reject"))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert res.returncode == 8, res.stdout + res.stderr
    assert "stages/compare/verdict.json: sha256 differs from the receipt" in res.stderr
    assert "recorded vs replayed" not in res.stdout
