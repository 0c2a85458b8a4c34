"""Paired dream evidence: the same cycle with dream off and on, one receipt (SPEC §8).

Both arms freeze the same cycle file (same tasks, models, seeds, images); only the dream
setting differs. The receipt reports each arm's held-out scores (every policy case that
is not development-split) and verdict, the dream acceptance and fallback rates, the
incremental held-out delta and the incremental cost, and claims lift only when the
delta is positive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, NoReturn

from pydantic import Field

from runner import interrupts
from runner.cycle.compare import load_records
from runner.cycle.config import DreamSpec, load_cycle
from runner.cycle.dream import DreamSummary
from runner.cycle.models import CRITERIA, DEVELOPMENT, Verdict
from runner.cycle.plan import (
    check_cycle,
    freeze,
    load_frozen_manifest,
    read_plan_doc,
)
from runner.cycle.receipt import build_receipt
from runner.cycle.run import CycleRunner, Progress
from runner.errors import (
    ConfigError,
    CycleboxError,
    EnvironmentFailure,
    Interrupted,
    SandboxError,
)
from runner.failures import Failure
from runner.hashing import canonical_bytes, sha256_file
from runner.isolation.sandbox import Frozen, Sandbox
from runner.outdir import make_fresh_dir, refuse_existing


class Heldout(Frozen):
    """Pass counts over one side's held-out cases."""

    passed: int
    """Cases with status ok and every criterion of the arm's policy passed."""
    total: int
    ungraded: int = Field(default=0, exclude_if=lambda v: v == 0)
    """Cases not graded ok (not_attempted, infra_invalid, no grades, a scorer or judge
    error): counted in ``total`` as not passed, and no lift is claimed from an arm that
    has any."""
    rate: float | None
    """passed / total (6 places); None without held-out records."""


class HeldoutSides(Frozen):
    baseline: Heldout | None
    """None when the side wrote no records (the arm stopped before it)."""
    candidate: Heldout | None


class DreamArm(Frozen):
    """One arm (dream off or on): a whole cycle run and what it showed."""

    dir: str
    plan_hash: str
    receipt_sha256: str
    verdict: Verdict
    reasons: tuple[str, ...]
    heldout_cases: tuple[str, ...]
    """Policy cases that are not development-split, sorted."""
    heldout: HeldoutSides
    cost_usd: float | None
    cost_complete: bool
    model_calls: int
    dream: DreamSummary | None
    """The dream stage's summary (None with dream off)."""
    patch_sha256: str | None


class DreamArms(Frozen):
    off: DreamArm
    on: DreamArm


class DreamReceipt(Frozen):
    """``dream-receipt.json``: both arms, the delta and the claim."""

    schema_: int = Field(default=1, alias="schema")
    kind: Literal["dream-paired"] = "dream-paired"
    cycle_sha256: str
    dream: DreamSpec
    """The dream setting of the on arm (the off arm differs only here)."""
    arms: DreamArms
    acceptance_rate: float | None
    """Accepted model paraphrases per requested slot (on arm); None with no slot."""
    fallback_rate: float | None
    heldout_delta: float | None
    """Candidate held-out pass rate, on minus off; None when either is missing, an arm's
    comparison is invalid, or an arm's candidate has a held-out case not graded ok (the
    claim names which)."""
    incremental_cost_usd: float | None
    """Cost on minus off; None when either is unknown."""
    lift_claimed: bool
    """Only when the held-out delta is positive (so both arms compared validly, every
    held-out case graded)."""
    claim: str


def heldout(records_file: Path, cases: set[str],
            criteria: Sequence[str] = CRITERIA) -> Heldout:
    """Pass counts over held-out cases (status ok and every policy criterion passed)."""
    rows = [r for r in load_records(records_file) if r.case_id in cases]
    graded = [r.grades for r in rows
              if r.status == "ok" and r.grades is not None and not r.grades.ungraded]
    passed = sum(g.passed(criteria) for g in graded)
    return Heldout(passed=passed, total=len(rows), ungraded=len(rows) - len(graded),
                   rate=round(passed / len(rows), 6) if rows else None)


def _not_comparable(arms: dict[str, DreamArm]) -> list[str]:
    """Why the arms' held-out rates are no evidence of lift (empty when they are): an arm
    whose comparison was invalid, or whose candidate has a held-out case not graded ok
    (a case that did not run is not a failure the other arm fixed)."""
    out = []
    for name, arm in arms.items():
        h = arm.heldout.candidate
        if arm.verdict == "invalid_comparison":
            out.append(f"the {name} arm's comparison is invalid_comparison")
        if h is None or h.rate is None:
            out.append(f"the {name} arm has no candidate held-out records")
        elif h.ungraded:
            out.append(f"the {name} arm's candidate has {h.ungraded} held-out case(s) not "
                       "graded ok")
    return out


def _arm(cycle: Path, out: Path, *, images: dict[str, str], spec: DreamSpec,
         sandbox: Sandbox, progress: Progress | None) -> DreamArm:
    _, plan_hash = freeze(cycle, out, images=images, dream_override=spec)
    outcome = CycleRunner(out / "plan.json", sandbox=sandbox, progress=progress).run()
    failure = outcome.failure
    if failure is not None and failure.reason == "environment_failure":
        # disk full: no receipt (as `cycle run`), and no second arm
        raise EnvironmentFailure(f"{_first(outcome.result.reasons, failure.reason)} (no "
                                 f"receipt written; partial arm in {out})")
    with interrupts.shielded():
        receipt = build_receipt(outcome)
    if failure is not None or interrupts.seen():
        # A signal, a lost engine or a bug ended this arm: the paired comparison cannot be
        # made, so the other arm never starts and no dream receipt is written. This arm's
        # verdict and receipt (naming the reason) stay as evidence.
        _stop(failure, out)
    plan = read_plan_doc(out / "plan.json").plan
    split = {s.id: s.split for s in load_frozen_manifest(out).scenarios}
    cases = {c for c in plan.policy.cases if split.get(c) != DEVELOPMENT}
    stages = out / "stages"
    total = receipt.usage.total

    def side(name: str) -> Heldout | None:
        f = stages / name / "records.jsonl"
        return heldout(f, cases, plan.policy.criteria) if f.is_file() else None

    return DreamArm(
        dir=str(out), plan_hash=plan_hash,
        receipt_sha256=sha256_file(out / "receipt.json"),
        verdict=outcome.result.verdict, reasons=outcome.result.reasons,
        heldout_cases=tuple(sorted(cases)),
        heldout=HeldoutSides(baseline=side("baseline"), candidate=side("candidate")),
        cost_usd=total.cost_usd, cost_complete=total.complete,
        model_calls=total.calls, dream=receipt.dream,
        patch_sha256=outcome.patch_sha256,
    )


def _first(reasons: tuple[str, ...] | list[str], default: str) -> str:
    return reasons[0] if reasons else default


def _stop(failure: Failure | None, arm: Path) -> NoReturn:
    """Raise the error whose exit code says why an arm stopped (130, 6 or 10)."""
    where = f"the {arm.name} arm's verdict and receipt are in {arm}; no dream receipt"
    if failure is None or failure.reason == "interrupted":
        raise Interrupted(f"dream compare interrupted; {where}")
    if failure.reason == "engine_error":
        raise SandboxError(f"dream compare stopped: {failure.message}; {where}")
    raise CycleboxError(f"dream compare stopped: {failure.message}; {where}")


def paired(cycle: Path, out: Path, *, images: dict[str, str], sandbox: Sandbox,
           progress_for: Callable[[str], Progress | None] = lambda _a: None) -> DreamReceipt:
    """Run both arms under ``out/off`` and ``out/on``; write ``out/dream-receipt.json``."""
    parsed, _ = load_cycle(cycle)
    if parsed.dream.mode == "off":
        raise ConfigError("dream.mode is off; the paired run needs template or model",
                          path=str(cycle), field="dream.mode", fix="set dream: {mode: model}")
    # every input checked before anything is written (the arms' freezes check again)
    refuse_existing(out)
    check_cycle(cycle)
    make_fresh_dir(out)
    off = _arm(cycle, out / "off", images=images, spec=DreamSpec(mode="off"),
               sandbox=sandbox, progress=progress_for("off"))
    on = _arm(cycle, out / "on", images=images, spec=parsed.dream, sandbox=sandbox,
              progress=progress_for("on"))
    d = on.dream
    requested = d.requested if d else 0
    rate_off = off.heldout.candidate.rate if off.heldout.candidate else None
    rate_on = on.heldout.candidate.rate if on.heldout.candidate else None
    why_not = _not_comparable({"off": off, "on": on})
    delta = (None if why_not or rate_off is None or rate_on is None
             else round(rate_on - rate_off, 6))
    cost = (None if off.cost_usd is None or on.cost_usd is None
            else round(on.cost_usd - off.cost_usd, 9))
    lift = delta is not None and delta > 0
    receipt = DreamReceipt(
        cycle_sha256=sha256_file(cycle), dream=parsed.dream,
        arms=DreamArms(off=off, on=on),
        acceptance_rate=round(d.accepted / requested, 6) if d and requested else None,
        fallback_rate=round(d.fallback / requested, 6) if d and requested else None,
        heldout_delta=delta, incremental_cost_usd=cost, lift_claimed=lift,
        claim=(f"held-out pass rate {rate_off} -> {rate_on} (+{delta}) with dream on"
               if lift else "no lift claimed: " + ("; ".join(why_not) if why_not else
                                                   "the held-out delta is not positive")))
    (out / "dream-receipt.json").write_bytes(canonical_bytes(receipt))
    return receipt
