"""The cyclebox evaluation predicate: what one recorded cycle concluded about a candidate.

``predicateType`` ``https://cyclebox.dev/attestations/evaluation/v1``; its JSON schema is
docs/attestations/evaluation-v1.schema.json (a test validates a real run's predicate
against it). A change that renames, removes or retypes a field is a new version (v2),
never an edit of v1. Every value comes from files the verified receipt binds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from runner.attest.statement import ResourceDescriptor, Statement
from runner.cycle.plan import PlanDoc
from runner.cycle.receipt import RECEIPT, Receipt
from runner.report.model import Report

EVALUATION_PREDICATE = "https://cyclebox.dev/attestations/evaluation/v1"
PATCH = "stages/apply/candidate.patch"
TREE_SUBJECT = "candidate-tree"
"""Subject name of the candidate's git tree (named by ``gitTree``; it is no file)."""


class _Model(BaseModel):
    """Field names are lowerCamelCase, as in-toto predicates spell them."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class PlanDigests(_Model):
    """The frozen plan and what it bound the grading to."""

    planHash: str
    """sha256 of the plan's canonical JSON (plan.json ``plan_hash``)."""
    inputsSha256: str
    """sha256 over the plan's section hashes (receipt ``outcome.inputs``)."""
    policySha256: str
    """sha256 of the frozen comparison policy (plan section ``policy``)."""
    manifestSha256: str
    """sha256 of the scenario manifest's bytes (inputs/manifest.json)."""
    referenceHash: str
    """sha256 over every scenario's reference answer."""
    dataHash: str
    """sha256 over every scenario's input and data store binding."""
    scorer: str
    """Scorer identity (evaluator sources, scoring config, project scorer file)."""
    judgeId: str | None
    """Judge identity (spec, prompt, upstream); None when no judge grades."""


class PassCount(_Model):
    """One arm on one split, over every (case, trial) row."""

    arm: str
    """``baseline`` or ``candidate``."""
    split: str
    rows: int
    ok: int
    """Rows whose agent run produced a readable answer."""
    passed: int
    """Rows graded and passing every policy criterion (unknown never passes)."""


class Cost(_Model):
    """Model usage of the whole cycle, every role."""

    usd: float | None
    """None when some charged call's cost is unknown (never a silent zero)."""
    complete: bool
    """Every call that reached an upstream has a known cost."""
    calls: int
    tokens: int
    fixtureCalls: int
    """Calls answered by scripted fixtures (no real model)."""


class Candidate(_Model):
    patchSha256: str | None
    gitTree: str | None
    gitCommit: str | None
    baseTree: str
    """git tree id the baseline ran (project.base_ref, frozen)."""
    baseCommit: str | None


class ReceiptRef(_Model):
    sha256: str
    """sha256 of receipt.json's bytes, as attested."""
    generatedAt: str


class EvaluationPredicate(_Model):
    """``predicate`` of an evaluation Statement (v1)."""

    cycle: str
    """The cycle's name (plan ``name``)."""
    runId: str
    """The run id every container of the run was labelled with."""
    verdict: str
    """accept_for_review, reject or invalid_comparison."""
    reasons: tuple[str, ...]
    """Why, for anything but accept_for_review (named reasons, in check order)."""
    plan: PlanDigests
    passCounts: tuple[PassCount, ...]
    cost: Cost
    candidate: Candidate
    receipt: ReceiptRef
    fixture: bool
    """Some model call was answered by a scripted fixture: not a real model's result."""


@dataclass(frozen=True)
class RunFacts:
    """What both Statements are made of, read once from a verified run directory."""

    run_dir: Path
    receipt: Receipt
    receipt_sha256: str
    plan: PlanDoc
    report: Report
    apply_result: dict[str, Any]
    """stages/apply/result.json ({} when the run never applied a candidate)."""
    run_id: str

    @property
    def candidate_commit(self) -> str | None:
        c = self.apply_result.get("commit")
        return c if isinstance(c, str) else None

    @property
    def base_commit(self) -> str | None:
        c = self.apply_result.get("base_commit")
        return c if isinstance(c, str) else None


def candidate_subjects(f: RunFacts) -> list[ResourceDescriptor]:
    """The candidate patch (sha256 of its bytes) and tree (git tree id), when there is one."""
    out = []
    patch = f.receipt.files.get(PATCH)
    if f.receipt.patch_sha256 is not None and patch is not None:
        out.append(ResourceDescriptor(name=PATCH, digest={"sha256": patch}))
    if f.receipt.outcome.candidate_tree is not None:
        out.append(ResourceDescriptor(name=TREE_SUBJECT,
                                      digest={"gitTree": f.receipt.outcome.candidate_tree},
                                      annotations=None if f.candidate_commit is None else
                                      {"gitCommit": f.candidate_commit}))
    return out


def evaluation_statement(f: RunFacts) -> Statement:
    r, plan = f.receipt, f.plan.plan
    total = r.usage.total
    predicate = EvaluationPredicate(
        cycle=plan.name, runId=f.run_id, verdict=r.verdict.verdict,
        reasons=tuple(r.verdict.reasons),
        plan=PlanDigests(planHash=r.plan_hash, inputsSha256=r.outcome.inputs,
                         policySha256=f.plan.hashes["policy"],
                         manifestSha256=plan.manifest_sha256,
                         referenceHash=plan.reference_hash, dataHash=plan.data_hash,
                         scorer=plan.scorer, judgeId=plan.judge_id),
        passCounts=tuple(PassCount(arm=p.arm, split=p.split, rows=p.rows, ok=p.ok,
                                   passed=p.passed) for p in f.report.pass_rates),
        cost=Cost(usd=total.cost_usd, complete=total.complete, calls=total.calls,
                  tokens=total.tokens, fixtureCalls=total.fixture_calls),
        candidate=Candidate(patchSha256=r.patch_sha256,
                            gitTree=r.outcome.candidate_tree, gitCommit=f.candidate_commit,
                            baseTree=r.base_tree, baseCommit=f.base_commit),
        receipt=ReceiptRef(sha256=f.receipt_sha256, generatedAt=r.generated_at),
        fixture=r.fixture)
    subjects = [*candidate_subjects(f),
                ResourceDescriptor(name=RECEIPT, digest={"sha256": f.receipt_sha256})]
    return Statement(subject=tuple(subjects), predicateType=EVALUATION_PREDICATE,
                     predicate=predicate.model_dump(mode="json"))
