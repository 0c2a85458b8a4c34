"""Executing a frozen plan: baseline, evaluate, brief, propose, apply, candidate, evaluate,
compare, receipt — each container stage in its own fresh directory under ``DIR/stages/``.

Invariants: the plan hash, the frozen inputs and the data stores are re-checked before
and after every stage, and drift ends the cycle as ``invalid_comparison`` with the named
reason; every container's run record is appended to ``DIR/containers.jsonl``; nothing
is retried and every attempt stays on disk; a receipt is written even when a stage
fails. The operator's repository is only read.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic_core

from runner import gitops, interrupts
from runner.cycle.apply import apply_proposal, read_proposal
from runner.cycle.brief import build_brief, failing_development, nothing_to_brief
from runner.cycle.compare import compare
from runner.cycle.concurrency import Control
from runner.cycle.config import refuse_out_in_data
from runner.cycle.models import (
    CUT_SHORT,
    DEVELOPMENT,
    MAX_ANSWER_BYTES,
    ComparisonResult,
    Identities,
    Invocation,
    Proposal,
    Record,
    Scenario,
)
from runner.cycle.plan import (
    BLIND_ROLES,
    check_agent_tree,
    check_drift,
    check_upstreams,
    frozen_role,
    load_frozen_manifest,
    load_plan,
    plan_lock,
)
from runner.cycle.schedule import Gate, Lookahead
from runner.cycle.scoring import (
    PROJECT_SCORER_INPUT,
    apply_grades,
    evaluator_scoring,
    parse_grades,
    resolved_reference,
)
from runner.errors import ConfigError, IntegrityError, OutputRejected
from runner.failures import Failure, classify, is_engine_error, is_environment_error, one_line
from runner.gateway.budget import RunBudget
from runner.gateway.config import UpstreamPolicy
from runner.gateway.report import summarize
from runner.gateway.server import Gateway
from runner.hashing import safe_text, sha256_bytes, write_json
from runner.isolation import image_use
from runner.isolation.collect import Limits, collect
from runner.isolation.launcher import output_dir, prepare
from runner.isolation.sandbox import Mount, PreparedRun, RunRecord, Sandbox, StopReason
from runner.loading import read_capped, show

STOP_GRACE_S = 6.0
"""How long, after a stop, the run's containers are swept while case threads return."""

Progress = Callable[[str, int, int], None]
"""(stage, done, total) as work completes."""


@dataclass(frozen=True)
class _Ready:
    """One analyst case made ready: its fresh output directory and its container."""

    out: Path
    run: PreparedRun


def _discard(ready: _Ready | None) -> None:
    if ready is not None:
        ready.run.discard()


def _waits(stage: str, waits: dict[int, float],
           jobs: list[tuple[Scenario, int]]) -> dict[str, float]:
    """Timing keys: how long each case's container waited prepared before its case took
    it (0 when the case prepared its own), and the median and longest wait."""
    out = {f"{stage}.prepared_wait_s.{jobs[i][0].id}__t{jobs[i][1]}": round(w, 3)
           for i, w in sorted(waits.items())}
    if waits:
        ordered = sorted(waits.values())
        out[f"{stage}.prepared_wait_s.median"] = round(ordered[len(ordered) // 2], 3)
        out[f"{stage}.prepared_wait_s.max"] = round(ordered[-1], 3)
    return out


class StageFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Outcome:
    """What a cycle run produced; the receipt is built from this."""

    run_dir: Path
    plan_hash: str
    result: ComparisonResult
    timings: dict[str, float] = field(default_factory=dict)
    proposal_sha256: str | None = None
    patch_sha256: str | None = None
    candidate_tree: str | None = None
    leftovers: list[str] = field(default_factory=list)
    failure: Failure | None = None
    """Set when the cycle ended on a signal, an engine or environment failure or a bug;
    its exit code replaces the verdict's."""



def worker_api(optimizer: UpstreamPolicy | None) -> str:
    """The API family the worker and the dream relay speak: Messages for an anthropic
    upstream; for a replayed one, the family its recorded worker calls spoke (replay
    matches on request bytes, so it must be asked in the same family); else chat."""
    if optimizer is None:
        return "chat"
    if optimizer.provider == "anthropic":
        return "messages"
    if optimizer.provider == "replay":
        from runner.gateway.calllog import CallLog

        log = Path(optimizer.replay_from) / "gateway"
        if (log / "calls.jsonl").is_file():
            apis = {r.api for r in CallLog.reader(log).records() if r.role == "worker" and r.api}
            if apis in ({"messages"}, {"responses"}):
                return apis.pop()
    return "chat"

class CycleRunner:
    """Runs one prepared plan on ``sandbox``; one instance per run directory."""

    def __init__(self, plan_path: Path, *, sandbox: Sandbox,
                 progress: Progress | None = None) -> None:
        self.plan_path = plan_path.resolve()
        self.dir = self.plan_path.parent
        self.plan, self.plan_hash = load_plan(self.plan_path)
        self.manifest = load_frozen_manifest(self.dir)
        self.scenarios = {s.id: s for s in self.manifest.scenarios}
        self.run_id = f"{self.plan.name}-{self.plan_hash[:10]}"
        self.progress = progress or (lambda _s, _d, _t: None)
        self.budget = RunBudget(self.plan.budget)
        self.timings: dict[str, float] = {}
        self.backend = sandbox
        # The agent's model is the first of its upstream's allowlist (docs/contracts.md).
        target = self.plan.upstreams.get(self.plan.roles["analyst"].upstream or "")
        self._model_env = {"CYCLEBOX_MODEL": target.models[0]} if target else {}
        # The worker and the dream relay speak the optimizer upstream's API family (the
        # gateway never translates): Messages for an anthropic upstream, else chat.
        optimizer = self.plan.upstreams.get(self.plan.roles["worker"].upstream or "")
        self._worker_env = {"CYCLEBOX_API": worker_api(optimizer)}
        self._stopping = threading.Event()
        self._told_stopping = False  # before run(): a first signal's hook reads it

    # -- entry -------------------------------------------------------------------
    def run(self) -> Outcome:
        # One process per prepared plan: the loser of a race is refused by the lock (or,
        # arriving after the winner started, by stages/ existing), never by a crash.
        with plan_lock(self.plan_path), interrupts.on_exit(self._cut_short), \
                interrupts.on_first(self._hurry):
            return self._run_locked()

    def _cut_short(self) -> None:
        """A second signal ends the process at once (no verdict, no receipt): say so in
        the run directory, in one small file, once stages/ exists."""
        if (self.dir / "stages").is_dir():
            (self.dir / CUT_SHORT).write_text(
                "a second signal ended the controller at once: no verdict, no receipt; "
                "containers and temporary directories may be left (`cyclebox gc` removes "
                "them)\n")

    def _check_blind_trees(self) -> None:
        """What freeze checked of the trees the agent (and the worker) read, again now:
        ``data_dir`` or a role's mount may have come to hold a run or a copy of the
        manifest since (ConfigError naming it; nothing has started)."""
        manifest = read_capped(self.dir / "inputs" / "manifest.json")
        frozen = [("frozen manifest", self.dir / "inputs" / "manifest.json")]
        where = str(self.plan_path)
        check_agent_tree(Path(self.plan.data_dir), "/data", manifest, frozen, path=where,
                         field="data_dir")
        for role in BLIND_ROLES:
            for i, m in enumerate(self.plan.roles[role].mounts):
                check_agent_tree(Path(m.source), m.target, manifest, frozen, path=where,
                                 field=f"roles.{role}.mounts[{i}].source")

    def _run_locked(self) -> Outcome:
        stages = self.dir / "stages"
        if stages.exists():
            raise ConfigError(f"{self.dir} was already executed (stages/ exists); every "
                              "attempt is kept", field="--plan",
                              fix="freeze again into a new directory")
        check_upstreams(dict(self.plan.upstreams), path=str(self.plan_path))
        refuse_out_in_data(self.dir, Path(self.plan.data_dir), path=str(self.plan_path),
                           field="--plan")
        self._check_blind_trees()
        image_use.hold(self.plan.images.values())  # `images gc` leaves them alone
        for role, image in self.plan.images.items():
            if self.backend.image_id(image) is None:
                raise IntegrityError(f"frozen image for {role} ({image}) is not present; "
                                     "rebuild the same inputs or freeze again")
        self._containers_lock = threading.Lock()
        self._inflight: list[Future[Record]] = []
        outcome = Outcome(self.dir, self.plan_hash, _invalid("cycle did not complete"))
        role_upstream = {r: p.upstream for r, p in self.plan.roles.items() if p.upstream}
        # Before stages/ is made: a missing credential or upstream is the operator's input
        # error (exit 3/5), not a verdict, and a signal here leaves a plan that can still
        # run. Once stages/ exists, every way out ends with a verdict and a receipt (a
        # signal between the two left an empty stages/: no verdict, and a plan refused as
        # already executed).
        self.gw = Gateway(self.dir, self.run_id, dict(self.plan.upstreams), role_upstream,
                          self.budget).start()
        # A first signal from stages.mkdir() on is held until the verdict path is entered
        # (hold.close() there; the first stage's check unwinds it): a signal just after the
        # mkdir left an empty stages/ (no verdict, the plan refused as already executed).
        hold = contextlib.ExitStack()
        try:
            self.containers = (self.dir / "containers.jsonl").open("a", encoding="utf-8")
            try:
                hold.enter_context(interrupts.shielded())
                stages.mkdir()
            except BaseException:
                hold.close()
                self.containers.close()
                raise
        except FileExistsError:
            self.gw.close()
            raise ConfigError(f"{self.dir} was already executed (stages/ exists); every "
                              "attempt is kept", field="--plan",
                              fix="freeze again into a new directory") from None
        except BaseException:
            self.gw.close()
            raise
        try:
            try:
                try:
                    hold.close()  # from here a signal unwinds inside this path
                    outcome = self._stages(outcome)
                except BaseException as exc:
                    # Containers first: a killed container drops its gateway
                    # connections, so closing the gateway does not wait on them. Only a
                    # signal, the engine or the disk puts the engine on short waits: an
                    # invalid comparison (a failed stage, a crash) ends no process, and a
                    # dream comparison's second arm may run on the same backend.
                    self._stop_containers(hurry=classify(exc).overrides_verdict)
                    raise
                finally:
                    with interrupts.shielded():  # a signal here must not skip the close
                        self.gw.close()
            except StageFailed as exc:
                outcome.result = _invalid(exc.reason)
            except BaseException as exc:  # no crash without a verdict and receipt
                self._failed(outcome, exc)
        except BaseException as exc:  # e.g. a second failure while closing
            self._failed(outcome, exc)
        with interrupts.shielded():
            self._finish(outcome)
        return outcome

    def _finish(self, outcome: Outcome) -> None:
        """Close the records, sweep leftovers and write verdict.json, whatever failed."""
        with contextlib.suppress(OSError):
            self.containers.close()
        outcome.timings = self.timings
        if any(not f.done() for f in self._inflight):
            self._drain(self._inflight, hurry=outcome.failure is not None)
        try:
            outcome.leftovers = self._leftovers()
        except Exception as exc:  # the engine may be gone; say so
            outcome.leftovers = [f"unknown: leftovers not checked ({one_line(repr(exc), 200)})"]
            if outcome.failure is None:
                self._failed(outcome, exc)
        try:
            (self.dir / "stages" / "compare").mkdir(exist_ok=True)
            write_json(self.dir / "stages" / "compare" / "verdict.json",
                       outcome.result.model_dump(mode="json"))
        except OSError as exc:
            outcome.failure = classify(exc)
            _remove_partial(self.dir / "stages" / "compare" / "verdict.json")

    def _failed(self, outcome: Outcome, exc: BaseException) -> None:
        """Record why the cycle stopped: invalid_comparison with the named reason, and
        for a signal, the engine or the disk, the failure whose exit code ends the CLI."""
        failure = classify(exc)
        if outcome.failure is not None and outcome.failure.overrides_verdict:
            return  # keep the first cause (e.g. the signal, not the error it provoked)
        outcome.result = _invalid(self._failure_reason(exc, failure))
        if failure.overrides_verdict:
            outcome.failure = failure

    def _failure_reason(self, exc: BaseException, failure: Failure) -> str:
        """The verdict reason for a failure; an unexpected one gets its traceback logged."""
        if failure.reason == "interrupted":
            return "interrupted"
        where = ""
        if failure.reason == "unexpected_error":
            log = self._traceback_log(exc)
            where = f" (traceback in {log.relative_to(self.dir)})" if log else ""
        return f"{failure.reason}: {failure.message}{where}"

    def _traceback_log(self, exc: BaseException) -> Path | None:
        ts = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
        path = self.dir / "logs" / f"error-{ts}.log"
        try:
            path.parent.mkdir(exist_ok=True)
            path.write_bytes("".join(traceback.format_exception(exc)).encode(
                "utf-8", "backslashreplace"))
        except OSError:
            return None
        return path

    def _drain(self, futures: list[Future[Record]], *, hurry: bool = True) -> None:
        """Stop the run's containers until every case thread has returned (or the grace
        period is over): a thread past the admission check when the stop came may still
        create its container after the first sweep, and would then wait on it."""
        deadline = time.monotonic() + STOP_GRACE_S
        while True:
            self._stop_containers(hurry=hurry)
            # done() counts a job the pool's shutdown cancelled before it started;
            # wait() never does (it waits for a notification that never comes), so
            # waiting on those alone took the whole grace period
            pending = [f for f in futures if not f.done()]
            if not pending or time.monotonic() > deadline:
                return
            wait(pending, timeout=0.3)

    def _stop_containers(self, *, hurry: bool = True) -> None:
        """Admit no new container and kill and remove the run's running ones. With
        ``hurry`` (a signal, the engine, the disk) the engine gets short waits from now on
        (a backend that can: ``stopping``), so a hung one cannot hold the verdict and
        receipt for minutes."""
        self._stopping.set()
        if hurry:
            self._hurry()
        with contextlib.suppress(Exception):
            self._leftovers()

    def _hurry(self) -> None:
        """Short engine waits from now on (once; also on a first signal, so a
        container's removal on the way out does not wait 60 s on a hung engine)."""
        if not self._told_stopping:
            self._told_stopping = True
            stopping = getattr(self.backend, "stopping", None)
            if callable(stopping):
                with contextlib.suppress(Exception):
                    stopping()

    def _stages(self, o: Outcome) -> Outcome:
        pol = self.plan.policy
        dev = [s.id for s in self.manifest.scenarios if s.split == DEVELOPMENT]
        base_cases = list(dict.fromkeys([*pol.cases, *dev]))
        src = self._stage("export", self._export_base)
        if self.plan.dream.mode != "off":
            variants = self._stage("dream", self._dream)
            clash = sorted(v.id for v in variants if v.id in self.scenarios)
            if clash:  # refused at freeze; a dream override reaches here
                raise StageFailed(f"dream: variant ids {clash[:5]} are ids of the manifest's "
                                  "own cases (a variant would replace them)")
            self.scenarios.update({v.id: v for v in variants})
            base_cases += [v.id for v in variants]
        baseline = self._stage("baseline", lambda: self._analyst("baseline", src, base_cases))
        baseline = self._stage("evaluate-baseline", lambda: self._evaluate("baseline", baseline))
        brief = self._stage("brief", lambda: self._brief(baseline))
        proposal = self._stage("propose", lambda: self._propose(brief))
        o.proposal_sha256 = sha256_bytes((self.dir / "stages/propose/out/proposal.json")
                                         .read_bytes())
        cand_src, o.candidate_tree = self._stage("apply", lambda: self._apply(proposal))
        o.patch_sha256 = sha256_bytes((self.dir / "stages/apply/candidate.patch").read_bytes())
        candidate = self._stage("candidate", lambda: self._analyst("candidate", cand_src,
                                                                   list(pol.cases)))
        candidate = self._stage("evaluate-candidate",
                                lambda: self._evaluate("candidate", candidate))
        t = time.monotonic()
        in_policy = set(pol.cases)
        o.result = compare([r for r in baseline if r.case_id in in_policy],
                           [r for r in candidate if r.case_id in in_policy], pol)
        self.timings["compare"] = round(time.monotonic() - t, 3)
        return o

    def _stage(self, name: str, fn: Callable[[], Any]) -> Any:
        drift = check_drift(self.plan_path, self.plan_hash, self.plan)
        if drift:
            raise StageFailed(f"before {name}: {drift}")
        interrupts.check()  # a first signal whose KeyboardInterrupt was swallowed
        t = time.monotonic()
        self.progress(name, 0, 0)
        result = fn()
        self.timings[name] = round(time.monotonic() - t, 3)
        interrupts.check()
        drift = check_drift(self.plan_path, self.plan_hash, self.plan)
        if drift:
            raise StageFailed(f"after {name}: {drift}")
        return result

    # -- containers --------------------------------------------------------------
    def _run(self, role: str, command: list[str], *, mounts: list[Mount], out: Path,
             stage: str, case: str | None = None, trial: int | None = None,
             output_target: str = "/out", env: dict[str, str] | None = None) -> RunRecord:
        if self._stopping.is_set():
            raise StageFailed("stopping: no new container is started")
        run = prepare(self.backend, frozen_role(self.plan, self.dir, role), role=role,
                      run_id=self.run_id, image=self.plan.images[role], command=command,
                      mounts=mounts, output_dir=out, output_target=output_target, env=env,
                      gateway=self.gw, stage=stage, case=case, trial=trial,
                      cancel=self._stopping)
        return self._record_run(run, stage=stage, out=out, case=case, trial=trial)

    def _record_run(self, run: PreparedRun, *, stage: str, out: Path,
                    case: str | None = None, trial: int | None = None,
                    ended: Callable[[], None] | None = None) -> RunRecord:
        """Run a prepared container (or remove it unrun when the run is stopping) and
        keep its record and output tails; ``ended``: see :meth:`PreparedRun.run`."""
        role = run.spec.role
        try:
            if self._stopping.is_set():
                raise StageFailed("stopping: no new container is started")
            rec = run.run(cancel=self._stopping, ended=ended)
        finally:
            run.discard()  # a no-op after the run; otherwise it never runs
        row = {"stage": stage, "case": case, "trial": trial, **rec.model_dump(mode="json")}
        row.pop("stdout_tail")
        row.pop("stderr_tail")
        with self._containers_lock:
            self.containers.write(json.dumps(row, sort_keys=True) + "\n")
            self.containers.flush()
        stderr = _stderr_log(out, role, case, trial)
        stderr.parent.mkdir(exist_ok=True)
        stderr.with_suffix(".stdout").write_bytes(safe_text(rec.stdout_tail).encode())
        stderr.write_bytes(safe_text(rec.stderr_tail).encode())
        return rec

    def _stderr_note(self, rec: RunRecord, out: Path, role: str, case: str | None = None,
                     trial: int | None = None) -> str:
        """`` (stderr: LOG, ends: TAIL)`` for a reason: where the container's stderr was
        kept (relative to the run directory) and its last lines, so a failing case says
        where to look and what it said."""
        log = _stderr_log(out, role, case, trial).relative_to(self.dir)
        tail = stderr_tail(rec.stderr_tail)
        return f" (stderr: {log}, " + (f"ends: {tail})" if tail else "empty)")

    def _fresh(self, role: str, path: Path) -> Path:
        """A fresh output directory for ``role``'s user."""
        return output_dir(self.plan.roles[role], path)

    def _limits(self, role: str) -> Limits:
        cap = self.plan.roles[role].output_cap
        return Limits(max_file_bytes=cap, max_total_bytes=cap)

    # -- stages --------------------------------------------------------------------
    def _export_base(self) -> Path:
        dest = self.dir / "stages" / "baseline" / "src"
        dest.parent.mkdir(parents=True)
        gitops.export_tree(Path(self.plan.project.repo), self.plan.project.base_tree, dest)
        return dest

    def _analyst(self, stage: str, src: Path, cases: list[str]) -> list[Record]:
        """Every case x trial exactly once, in plan order, ``concurrency`` at once, the
        next ones' containers prepared ahead (:mod:`runner.cycle.schedule`)."""
        jobs = [(self.scenarios[c], t) for c in cases for t in range(self.plan.trials)]
        done = 0
        self.progress(stage, 0, len(jobs))
        results: list[Record] = []
        control = Control(self.plan.concurrency, len(jobs),
                          per_case_bytes=self.plan.roles["analyst"].memory)
        gate = Gate(control.limit)
        ahead: Lookahead[_Ready | None] = Lookahead(
            len(jobs), prepare=lambda i: self._prepare_case(stage, src, *jobs[i]),
            discard=_discard, depth=lambda: control.depth(gate.inside),
            closed=lambda: StageFailed("stopping: no new container is started"))

        def job(i: int) -> Record:
            gate.enter(i)
            inside = [True]

            def leave() -> None:
                # once, on this job's thread: when its command ended and its output is
                # copied out (the next case starts while this container is removed and
                # its record written), or on the way out
                if inside[0]:
                    inside[0] = False
                    gate.leave()

            try:
                return self._case(stage, *jobs[i], lambda: ahead.take(i), leave)
            finally:
                leave()

        # twice the cases that may run at once: a case that left the gate (its command
        # ended) still removes its container and writes its record meanwhile
        pool = ThreadPoolExecutor(max_workers=2 * control.workers)
        # Known to the stop path before the first job exists: a signal landing while the
        # jobs are submitted (each submit may start a thread and wait for it) must
        # stop and drain those already running, or they go on preparing containers
        # and writing into the run directory after its receipt.
        futures: list[Future[Record]] = []
        self._inflight = futures
        try:
            control.start(gate.set_limit)
            ahead.start()
            for i in range(len(jobs)):
                with interrupts.deferred():  # a job queued is a job in ``futures``
                    futures.append(pool.submit(job, i))
            for fut in futures:
                results.append(interrupts.result(fut))
                done += 1
                self.progress(stage, done, len(jobs))
        except BaseException:
            # Never wait for the pool on the way out: admit nothing new, discard what was
            # prepared, kill the run's containers, cancel what did not start and give
            # running cases a moment to see their container go. Shielded: a first signal
            # delivered again (see runner.interrupts) must not cut this short.
            with interrupts.shielded():
                self._stopping.set()
                with contextlib.suppress(Exception):  # the sweep below removes the rest
                    # a prepare stuck in the engine is not waited for: it sees the stop
                    # and discards its own container when it returns; _drain sweeps
                    ahead.close(join_s=1.0)
                gate.open()
                pool.shutdown(wait=False, cancel_futures=True)
                self._drain(futures)
            raise
        finally:
            control.stop()
            self.timings.update(control.timings(stage))
            self.timings.update(_waits(stage, dict(ahead.waits), jobs))
            ahead.close(join_s=1.0)  # the normal way out: nothing is left to discard
        pool.shutdown(wait=True)
        return results

    def _identities(self) -> Identities:
        return Identities(data_hash=self.plan.data_hash, reference_hash=self.plan.reference_hash,
                          scorer=self.plan.scorer, judge=self.plan.judge_id)

    def _case(self, stage: str, sc: Scenario, trial: int,
              take: Callable[[], _Ready | None],
              ended: Callable[[], None] | None = None) -> Record:
        """One analyst case; a crash while handling its output invalidates this case only.

        Engine and environment failures, and a stop, end the whole cycle instead.
        """
        try:
            rec = self._case_inner(stage, sc, trial, take, ended)
        except StageFailed:
            raise
        except Exception as exc:
            if is_engine_error(exc) or is_environment_error(exc):
                raise
            reason = self._failure_reason(exc, classify(exc))
            return Record(case_id=sc.id, trial=trial, split=sc.split,
                          identities=self._identities(), status="infra_invalid",
                          reason=f"crash: {reason}")
        if rec.reason is not None:
            rec = rec.model_copy(update={"reason": safe_text(rec.reason)})
        return rec

    def _prepare_case(self, stage: str, src: Path, sc: Scenario, trial: int) -> _Ready | None:
        """The case's own input and output directories and its container, prepared (None
        once the budget halted: nothing is prepared for a case that will not run)."""
        if self.budget.halted:
            return None
        if self._stopping.is_set():
            raise StageFailed("stopping: no new container is started")
        case_dir = self.dir / "stages" / stage / "cases" / f"{sc.id}__t{trial}"
        (case_dir / "input").mkdir(parents=True)
        write_json(case_dir / "input" / "input.json", sc.input)
        out = self._fresh("analyst", case_dir / "out")
        env = {"CYCLEBOX_SEED": str(self.plan.seeds[trial]), "CYCLEBOX_TRIAL": str(trial),
               "CYCLEBOX_CASE_ID": sc.id, **self._model_env}
        run = prepare(self.backend, frozen_role(self.plan, self.dir, "analyst"),
                      role="analyst", run_id=self.run_id, image=self.plan.images["analyst"],
                      command=list(self.plan.project.spec.entry), output_dir=out, env=env,
                      gateway=self.gw, stage=stage, case=sc.id, trial=trial,
                      warm=self.plan.project.spec.warm, cancel=self._stopping,
                      mounts=[Mount(source=src, target="/src"),
                              Mount(source=case_dir / "input", target="/case"),
                              Mount(source=Path(self.plan.data_dir), target="/data")])
        return _Ready(out=out, run=run)

    def _case_inner(self, stage: str, sc: Scenario, trial: int,
                    take: Callable[[], _Ready | None],
                    ended: Callable[[], None] | None = None) -> Record:
        base = dict(case_id=sc.id, trial=trial, split=sc.split, identities=self._identities())
        ready = take()
        if ready is None or self.budget.halted:
            # Prepared before the budget halted: removed unrun, the case not attempted.
            _discard(ready)
            return Record(**base, status="not_attempted", reason=f"budget: {self.budget.halted}")
        out = ready.out
        rec = self._record_run(ready.run, stage=stage, out=out, case=sc.id, trial=trial,
                               ended=ended)
        calls = self.gw.calls(stage, sc.id, trial, forget=True)
        usage = {r: t.model_dump(mode="json") for r, t in summarize(calls).per_role.items()}
        common = dict(base, latency_s=rec.wall_s, usage=usage)
        if any(c.error == "budget" for c in calls):
            # The headline names the real cause (the refusal's own reason), never a
            # generic "call refused".
            why = (f"admission halted: {self.budget.halted}" if self.budget.halted
                   else self.budget.last_refusal or "call refused")
            return Record(**common, status="not_attempted", reason=f"budget: {why}")
        infra = [c.error for c in calls if c.status == "infra_error"]
        if infra:
            return Record(**common, status="infra_invalid", reason=f"gateway: {infra[0]}")
        note = self._stderr_note(rec, out, "analyst", sc.id, trial)
        if rec.stop_reason is not StopReason.OK:
            return Record(**common, status="infra_invalid",
                          reason=f"{rec.stop_reason.value}: {rec.detail}{note}")
        try:
            got = collect(out, self._limits("analyst"))
            size = len(got.files.get("answer.json", b""))
            if size > MAX_ANSWER_BYTES:
                raise OutputRejected(f"answer.json of {size} bytes is over {MAX_ANSWER_BYTES} "
                                     "(the answer is kept whole in the records)")
            answer = got.json("answer.json")
        except OutputRejected as exc:
            return Record(**common, status="infra_invalid",
                          reason=f"invalid_output: {exc}{note}")
        if not isinstance(answer, dict):
            return Record(**common, status="infra_invalid",
                          reason=f"invalid_output: answer.json is not a JSON object{note}")
        stored = len(pydantic_core.to_json(answer))
        if stored > MAX_ANSWER_BYTES:
            # Re-serialised, a number can grow (1E15 is 4 bytes read, 18 written): the bound
            # holds for what the records keep, not only for the file read.
            return Record(**common, status="infra_invalid",
                          reason=f"invalid_output: answer.json is {stored} bytes as stored "
                                 f"(over {MAX_ANSWER_BYTES}; numbers such as 1E15 are "
                                 f"written out whole){note}")
        return Record(**common, status="ok", answer=answer)

    def _evaluate(self, side: str, records: list[Record]) -> list[Record]:
        stage = f"evaluate-{side}"
        d = self.dir / "stages" / stage
        for sub in ("in", "ref", "cfg"):
            (d / sub).mkdir(parents=True)
        ok = [r for r in records if r.status == "ok"]
        (d / "in" / "answers.jsonl").write_text("".join(json.dumps(
            {"case_id": r.case_id, "trial": r.trial, "answer": r.answer}, sort_keys=True) + "\n"
            for r in ok))
        cases = {r.case_id for r in records}
        write_json(d / "ref" / "references.json",
                   {c: resolved_reference(self.scenarios[c].reference, self.manifest)
                    for c in cases})
        judge = self.plan.judge
        write_json(d / "cfg" / "evaluator.json", {
            "judge": judge.model_dump(mode="json") if judge else None,
            "questions": {c: str(self.scenarios[c].input.get("question", "")) for c in cases},
            "inputs": {c: self.scenarios[c].input for c in cases},
            "scoring": evaluator_scoring(self.manifest)})
        mounts = [Mount(source=d / "in", target="/in"), Mount(source=d / "ref", target="/ref"),
                  Mount(source=d / "cfg", target="/cfg")]
        project = self.dir / "inputs" / PROJECT_SCORER_INPUT
        if PROJECT_SCORER_INPUT in self.plan.inputs:
            mounts.append(Mount(source=project.parent, target="/scorer"))
        out = self._fresh("evaluator", d / "out")
        rec = self._run("evaluator", ["python", "-m", "sandbox.evaluator"], stage=stage, out=out,
                        mounts=mounts)
        if rec.stop_reason is not StopReason.OK:
            raise StageFailed(f"{stage}: evaluator {rec.stop_reason.value}: {rec.detail}"
                              + self._stderr_note(rec, out, "evaluator"))
        try:
            raw = collect(out, self._limits("evaluator")).files.get("grades.jsonl", b"")
            grades = parse_grades(raw, {(r.case_id, r.trial) for r in records
                                        if r.status == "ok"},
                                  judge_threshold=judge.threshold if judge else None)
        except (OutputRejected, ValueError) as exc:
            raise StageFailed(f"{stage}: unreadable grades ({exc})") from None
        graded = apply_grades(records, grades)
        path = self.dir / "stages" / side / "records.jsonl"
        path.write_text("".join(r.model_dump_json() + "\n" for r in graded))
        return graded

    def _brief(self, baseline: list[Record]) -> str:
        """The worker's brief; a generated one with no development failure in it ends the
        cycle here (the worker is not called), with the reason named."""
        d = self.dir / "stages" / "brief"
        d.mkdir(parents=True)
        if self.plan.brief.mode == "file":
            text = (self.dir / "inputs" / "brief.md").read_text()
        else:
            text = build_brief(baseline, self.scenarios)
        (d / "brief.md").write_text(text)
        if self.plan.brief.mode == "generate" and not failing_development(baseline,
                                                                          self.scenarios):
            raise StageFailed(nothing_to_brief(baseline, self.scenarios))
        return text

    def _base_files(self) -> list[dict[str, Any]]:
        repo, tree = Path(self.plan.project.repo), self.plan.project.base_tree
        files = []
        for p in self.plan.edit.paths:
            data = gitops.read_blob(repo, tree, p)
            try:
                content = "" if data is None else data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise StageFailed(f"propose: edit.paths {safe_text(p)} is not UTF-8 text in the "
                                  f"base tree (byte {exc.start}); the worker edits text files "
                                  "only: take it out of edit.paths") from None
            files.append({"path": p, "content": content,
                          "sha256": None if data is None else sha256_bytes(data)})
        return files

    def _propose(self, brief: str) -> Proposal:
        d = self.dir / "stages" / "propose"
        (d / "in").mkdir(parents=True)
        request = {"brief": brief, "files": self._base_files(),
                   "paths": list(self.plan.edit.paths), "allowlist": list(self.plan.edit.allowlist),
                   "model": self.plan.worker.model, "max_tokens": self.plan.worker.max_tokens}
        write_json(d / "in" / "request.json", request)
        out = self._fresh("worker", d / "out")
        rec = self._run("worker", ["python", "-m", "sandbox.worker"], stage="propose", out=out,
                        env=self._worker_env,
                        mounts=[Mount(source=d / "in", target="/in")])
        got = collect(out, self._limits("worker"))
        if any(c.error == "budget" for c in self.gw.calls("propose")):
            # named as the analyst's cases are: the budget, not the worker's exit 1
            why = (f"admission halted: {self.budget.halted}" if self.budget.halted
                   else self.budget.last_refusal or "call refused")
            raise StageFailed(f"no candidate: budget: {why}")
        # The worker's own account of a refusal (exit 3) stands only for a worker that
        # ended by itself: a timeout or a kill is named as such, whatever it wrote.
        if "proposal-error.json" in got.files and rec.stop_reason in (
                StopReason.OK, StopReason.PROCESS_FAILED):
            err = got.json("proposal-error.json")
            if not isinstance(err, dict):
                raise StageFailed("no candidate: worker output refused (invalid_output: "
                                  "proposal-error.json is not a JSON object)")
            raise StageFailed(f"no candidate: proposal refused ({show(err.get('reason'), 80)}"
                              f": {show(err.get('message'), 500)})")
        if rec.stop_reason is not StopReason.OK or "proposal.json" not in got.files:
            what = (f"{rec.stop_reason.value}: {rec.detail}" if rec.stop_reason is not
                    StopReason.OK else "exited without writing proposal.json")
            raise StageFailed(f"no candidate: worker {what}"
                              + self._stderr_note(rec, out, "worker"))
        try:
            return read_proposal(got.files["proposal.json"])
        except OutputRejected as exc:
            raise StageFailed(f"no candidate: worker proposal refused (invalid_output: {exc})"
                              ) from None

    def _apply(self, proposal: Proposal) -> tuple[Path, str]:
        d = self.dir / "stages" / "apply"
        (d / "in").mkdir(parents=True)
        base_hashes = {f["path"]: f["sha256"] for f in self._base_files()}
        invocation = Invocation(paths=self.plan.edit.paths, allowlist=self.plan.edit.allowlist,
                                base=base_hashes, max_file_bytes=self.plan.edit.max_file_bytes)
        write_json(d / "in" / "invocation.json", invocation.model_dump(mode="json"))
        write_json(d / "in" / "proposal.json", proposal.model_dump(mode="json", by_alias=True))
        src = self.dir / "stages" / "candidate" / "src"
        # apply_proposal exports the verified candidate tree to src, the committed blobs as
        # they are, and checks the export against them.
        result = apply_proposal(d, Path(self.plan.project.repo), self.plan.project.base_tree,
                                run=lambda work: self._run(
                                    "apply", ["python", "-m", "sandbox.apply_main"],
                                    stage="apply", out=work, output_target="/work",
                                    mounts=[Mount(source=d / "in", target="/in")]),
                                uid=self.plan.roles["apply"].uid, export_to=src)
        if result.status != "applied":
            raise StageFailed(f"no candidate: apply refused ({result.reason}: "
                              f"{result.message})")
        return src, result.tree

    def _dream(self) -> list[Scenario]:
        """Dream variants of development tasks (SPEC §8); model calls via the relay."""
        from runner.cycle import dream

        spec = self.plan.dream
        d = self.dir / "stages" / "dream"
        d.mkdir(parents=True)
        dev = [s for s in self.manifest.scenarios if s.split == DEVELOPMENT]
        key = spec.intent_key
        parents = {s.id: s for s in dev}
        if spec.mode == "template":
            variants = [v for s in dev for v in dream.template_variants(s, spec.factor, key)]
            result = dream.DreamResult(variants=variants, summary=dream.DreamSummary(
                mode="template", source_tasks=len(dev), requested=len(dev) * spec.factor,
                accepted=0, fallback=0, reasons=dict.fromkeys(dream.REASONS, 0),
                optimizer_tokens=0, optimizer_cost_usd=0.0, cost_complete=True))
        else:
            gen = self._relay("dream-generate", dream.generation_calls(dev, spec.factor, key))
            existing = [dream.intent_of(s, key) for s in self.manifest.scenarios]
            slots, calls = dream.after_generation(dev, spec.factor, key, gen, existing)
            dream.after_verification(slots, self._relay("dream-verify", calls) if calls else {})
            calls_log = [*self.gw.calls("dream-generate", forget=True),
                         *self.gw.calls("dream-verify", forget=True)]
            tot = summarize(calls_log).total
            result = dream.finish(slots, parents, key, tot.tokens, tot.cost_usd, tot.complete)
        (d / "variants.json").write_text(dream.dumps_variants(result.variants))
        (d / "events.jsonl").write_text("".join(json.dumps(e, sort_keys=True) + "\n"
                                                for e in result.events))
        write_json(d / "summary.json", result.summary.model_dump(mode="json"))
        return result.variants

    def _relay(self, stage: str, calls: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        d = self.dir / "stages" / "dream" / stage
        (d / "in").mkdir(parents=True)
        write_json(d / "in" / "calls.json", {"model": self.plan.worker.model,
                                              "max_tokens": self.plan.worker.max_tokens,
                                              "calls": calls})
        out = self._fresh("worker", d / "out")
        rec = self._run("worker", ["python", "-m", "sandbox.relay"], stage=stage, out=out,
                        env=self._worker_env,
                        mounts=[Mount(source=d / "in", target="/in")])
        try:
            replies = _replies(collect(out, self._limits("worker")).json("replies.json"))
        except OutputRejected as exc:
            replies = {c["id"]: {"ok": False, "error": f"relay output refused: {exc}"}
                       for c in calls}
        if rec.stop_reason is not StopReason.OK and not replies:
            replies = {c["id"]: {"ok": False, "error": rec.stop_reason.value} for c in calls}
        return replies

    def _leftovers(self) -> list[str]:
        return self.backend.leftovers(self.run_id)


def _stderr_log(out: Path, role: str, case: str | None, trial: int | None) -> Path:
    """Where :meth:`CycleRunner._run` keeps a container's stderr: ``logs/`` beside its
    output directory, named by role (and case and trial)."""
    name = role + (f"-{case}-t{trial}" if case is not None else "")
    return out.parent / "logs" / f"{name}.stderr"


STDERR_TAIL_CHARS = 240
"""Characters of a container's stderr quoted in a reason (its last lines)."""


def stderr_tail(text: str, *, lines: int = 3, limit: int = STDERR_TAIL_CHARS) -> str:
    """The last ``lines`` non-empty lines of ``text`` as one line (`` / `` between them),
    at most ``limit`` characters (the end kept), control characters escaped."""
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
    flat = one_line(" / ".join(kept), limit=len(" / ".join(kept)) + 1)
    return flat if len(flat) <= limit else "..." + flat[-(limit - 3):]


def _replies(obj: object) -> dict[str, dict[str, Any]]:
    """The relay's ``replies.json`` with its shape checked (``{id: {"ok": true, "text":
    STRING} | {"ok": false, "error": ...}}``); OutputRejected naming what is not: every
    call then counts as a generation error, never a crash of the host."""
    if not isinstance(obj, dict):
        raise OutputRejected("replies.json is not a JSON object")
    for key, reply in obj.items():
        if not (isinstance(reply, dict) and isinstance(reply.get("ok"), bool)
                and (not reply["ok"] or isinstance(reply.get("text"), str))):
            raise OutputRejected(f"replies.json: the reply to {show(key, 80)} is not "
                                 "{ok: true, text: STRING} or {ok: false, error: ...}")
    return obj


def _invalid(reason: str) -> ComparisonResult:
    return ComparisonResult(verdict="invalid_comparison", reasons=(safe_text(reason),))


def _remove_partial(path: Path) -> None:
    """Remove a file whose writing failed, so that no truncated evidence stays."""
    with contextlib.suppress(OSError):
        os.unlink(path)




