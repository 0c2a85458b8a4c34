"""Values the cycle trades in: scenario manifests, graded records, comparison policies and
verdicts. All frozen, ``extra="forbid"``, versioned; hashed with runner.hashing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from runner.sandbox import Frozen

Criterion = Literal["correctness", "evidence", "refusal"]
CRITERIA: tuple[Criterion, ...] = ("correctness", "evidence", "refusal")


class Store(Frozen):
    """One data store the analyst reads (e.g. a SQLite file)."""

    path: str
    """Path relative to the data directory."""
    sha256: str
    size_bytes: int = Field(ge=0)


class Reference(Frozen):
    """What a correct answer looks like; the analyst never sees this."""

    kind: Literal["number", "text", "refuse"]
    """number: numeric answer within tolerance; text: case-insensitive substring;
    refuse: the agent must decline."""
    value: float | str | None = None
    tolerance: float = 0.005
    """Relative tolerance for numbers."""
    evidence: tuple[str, ...] = ()
    """Strings the cited evidence must contain (e.g. table names)."""


class Scenario(Frozen):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    split: str
    """development (briefed), acceptance (held out), or train (dream variants)."""
    input: dict[str, object]
    """What the analyst receives as /case/input.json."""
    reference: Reference
    mandatory: bool = False
    """A mandatory case failing on the candidate rejects the candidate."""
    store: str
    """Store id the case reads."""
    origin: str | None = None
    """dream for generated variants; None for real tasks."""
    derived_from: str | None = None


class Manifest(Frozen):
    """The scenario manifest (SPEC §3)."""

    schema_: int = Field(alias="schema")
    dataset: str
    split: str
    """Which splits this manifest covers, e.g. 'development+acceptance'."""
    scenarios: tuple[Scenario, ...]
    stores: dict[str, Store]
    reference_hash: str
    """sha256 over the canonical list of (id, reference)."""
    data_hash: str
    """sha256 over the canonical stores mapping."""


class Grades(Frozen):
    """Per-criterion pass/fail for one (case, trial); None where the criterion does not apply."""

    correctness: bool | None = None
    evidence: bool | None = None
    refusal: bool | None = None
    judge_score: float | None = None
    """Judge method score, when a judge ran."""
    judge_pass: bool | None = None
    """judge_score >= the agreed threshold."""
    judge_error: str | None = None
    """Why the judge produced no score (it failed or could not be funded)."""

    def passed(self) -> bool:
        vals = [self.correctness, self.evidence, self.refusal, self.judge_pass]
        return all(v is not False for v in vals)


class Identities(Frozen):
    """What a record was produced under; compare checks these against the policy."""

    data_hash: str
    reference_hash: str
    scorer: str
    judge: str | None = None


class Record(Frozen):
    """One graded (case, trial) of one side of a comparison."""

    case_id: str
    trial: int = Field(ge=0)
    split: str
    status: Literal["ok", "infra_invalid", "not_attempted"]
    reason: str | None = None
    """Named reason when status is not ok (e.g. timeout, budget)."""
    answer: dict[str, object] | None = None
    """The analyst's answer.json, as read from its output directory."""
    grades: Grades | None = None
    latency_s: float | None = None
    usage: dict[str, dict[str, object]] = Field(default_factory=dict)
    """Per role: calls, tokens, cost_usd (None when unknown), complete."""
    identities: Identities


class ComparisonPolicy(Frozen):
    """Frozen before anyone sees a result (SPEC §6)."""

    schema_: int = Field(alias="schema")
    cases: tuple[str, ...]
    """Exactly the cases compared (each times every trial)."""
    trials: int = Field(ge=1)
    mandatory: tuple[str, ...] = ()
    criteria: tuple[Criterion, ...] = CRITERIA
    identities: Identities | None = None
    """Expected identities; filled in by freeze from the plan when absent."""
    require_judge: bool = False
    max_case_latency_s: float | None = None
    max_total_cost_usd: float | None = None
    require_improvement: bool = True


Verdict = Literal["accept_for_review", "reject", "invalid_comparison"]


class CaseChange(Frozen):
    case_id: str
    trial: int
    criterion: str
    baseline: bool | None
    candidate: bool | None


class ComparisonResult(Frozen):
    verdict: Verdict
    reasons: tuple[str, ...]
    """Every reason found, in check order; empty for accept_for_review."""
    regressions: tuple[CaseChange, ...] = ()
    improvements: tuple[CaseChange, ...] = ()
    usage: dict[str, dict[str, object]] = Field(default_factory=dict)
    """baseline / candidate totals per role."""
    statistics: dict[str, object] | None = None
    """Paired statistics (exact McNemar on pass/fail) when trials > 1; never the verdict."""
