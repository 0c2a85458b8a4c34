"""Values the cycle trades in: scenario manifests, graded records, comparison policies and
verdicts. All frozen, ``extra="forbid"``, versioned; hashed with runner.hashing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from runner.cycle.scorer_specs import (
    TEXT_VALUE,
    Described,
    ExactScorer,
    NormalizedScorer,
    NumberScorer,
    RefusalScorer,
    ScorerSpec,
    Scoring,
    check_phrase,
    is_none,
)
from runner.isolation.sandbox import Frozen

Criterion = Literal["correctness", "evidence", "refusal"]
CRITERIA: tuple[Criterion, ...] = ("correctness", "evidence", "refusal")
DEVELOPMENT = "development"
"""The split the worker learns from: its failing cases (and only these) go into the brief."""
TRAIN = "train"
"""The split of generated dream variants (never written by hand)."""
SPLITS = (DEVELOPMENT, "acceptance", "reserved", TRAIN)
"""The documented splits, the only names a manifest may use: development (run on the
baseline; its failures are briefed to the worker), acceptance and reserved (held out:
compared, never shown to the worker), train (dream variants, generated). Any other name
is refused when the manifest is loaded, naming this set."""
MAX_ANSWER_BYTES = 256 * 1024
"""Largest answer kept in a record, both as answer.json read and as the record stores it
(the scorers read 10 000 characters of it): one role output of 16 MiB stored whole made
records.jsonl too large to review or export."""
RECORDS_MAX_BYTES = 1024 * 1024 * 1024
"""What a records.jsonl may hold when read back (review, export, report, ``compare``):
4096 answers of MAX_ANSWER_BYTES, or 10 000 cases of 100 KB. Reading one takes about
three times its size in memory."""


def check_split(value: str) -> str:
    """A split name from :data:`SPLITS`; ValueError naming the accepted ones otherwise."""
    if value not in SPLITS:
        raise ValueError(f"unknown split {value[:60]!r}; use one of {', '.join(SPLITS)}")
    return value


class Store(Frozen):
    """One data store the analyst reads (e.g. a SQLite file)."""

    path: str
    """Path relative to the data directory."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """sha256 of the store's exact bytes (`cyclebox manifest rehash` recomputes it)."""
    size_bytes: int = Field(ge=0)
    """The store's size in bytes."""

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        if not v or "\0" in v or "\\" in v:
            raise ValueError("store path must be a non-empty relative POSIX path")
        p = PurePosixPath(v)
        if p.is_absolute() or v.startswith("~"):
            raise ValueError(f"store path {v[:80]!r} is absolute; it must be relative to "
                             "data_dir")
        if ".." in p.parts:
            raise ValueError(f"store path {v[:80]!r} escapes data_dir (..)")
        return v


class Reference(Described):
    """What a correct answer looks like; the analyst never sees this."""

    kind: Literal["number", "text", "refuse"] | None = Field(default=None, exclude_if=is_none)
    """Legacy shorthand, kept so existing manifests validate: number -> the number scorer
    with ``tolerance`` as both relative and absolute tolerance; text -> normalized;
    refuse -> refusal. Leave it out when ``scorer`` is set."""
    scorer: ScorerSpec | None = Field(default=None, exclude_if=is_none)
    """This case's scorer (docs/scorers.md); when absent, ``kind`` decides, else the
    manifest's ``scoring.default``."""
    value: float | str | None = None
    """The expected answer the scorer compares against: a number or a string; null for
    refusal (kind refuse); unused by regex."""
    tolerance: float = 0.005
    """Legacy (kind: number only): tolerance * max(1, |value|)."""
    evidence: tuple[str, ...] = Field(default=(), max_length=32)
    """What the cited evidence must name (e.g. table names), matched as whole tokens
    (letters, digits, underscore; casefolded); an entry of several words matches as a
    contiguous run. Empty: the evidence criterion does not apply."""

    @field_validator("evidence")
    @classmethod
    def _evidence_tokens(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for e in v:
            check_phrase(e, "evidence")
        return v

    @model_validator(mode="after")
    def _value_fits_kind(self) -> Reference:
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError("tolerance must be a finite number >= 0")
        if self.kind is not None and self.scorer is not None:
            raise ValueError("set either kind (legacy) or scorer, not both")
        if self.kind == "number" and (not isinstance(self.value, int | float)
                                      or not math.isfinite(self.value)):
            raise ValueError("a number reference needs a finite numeric value")
        if self.kind == "text" and not (isinstance(self.value, str) and self.value):
            raise ValueError("a text reference needs a non-empty string value")
        if self.scorer is not None:
            self.check_value(self.scorer)
        return self

    def selected(self, default: ScorerSpec | None = None) -> ScorerSpec | None:
        """The scorer this reference is graded by: its own, its kind's, or ``default``.

        ``kind: text`` was a case-insensitive substring test, which passed an answer
        listing every candidate; it now means ``normalized`` equality (the
        case-insensitivity it promised, without the substring); ``contains`` is the
        explicit opt-in for the old behaviour."""
        if self.scorer is not None:
            return self.scorer
        if self.kind == "number":
            return NumberScorer(name="number", rel_tol=self.tolerance, abs_tol=self.tolerance)
        if self.kind == "text":
            return NormalizedScorer(name="normalized")
        if self.kind == "refuse":
            return RefusalScorer(name="refusal")
        return default

    def check_value(self, spec: ScorerSpec) -> None:
        """ValueError when ``value`` cannot be what ``spec`` compares against."""
        v = self.value
        if isinstance(spec, NumberScorer) and (not isinstance(v, int | float)
                                               or not math.isfinite(v)):
            raise ValueError("the number scorer needs a finite numeric value")
        if spec.name in TEXT_VALUE and not (isinstance(v, str) and v.strip()):
            raise ValueError(f"the {spec.name} scorer needs a non-empty string value")
        if isinstance(spec, ExactScorer) and v is None:
            raise ValueError("the exact scorer needs a value (a string or a number)")


class Scenario(Frozen):
    """One case: what the agent is asked and what a correct answer looks like."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Unique case id (letters, digits, ``_ . -``; at most 64 characters)."""
    split: str
    """development (briefed), acceptance or reserved (held out), or train (dream variants)."""
    input: dict[str, object]
    """What the analyst receives as /case/input.json."""
    reference: Reference
    """The expected answer; never shown to the agent or the worker."""
    mandatory: bool = False
    """A mandatory case failing on the candidate rejects the candidate."""
    store: str
    """Store id the case reads."""
    origin: str | None = None
    """dream for generated variants; None for real tasks."""
    derived_from: str | None = None
    """For a dream variant: the id of the development case it paraphrases."""

    @field_validator("split")
    @classmethod
    def _split(cls, v: str) -> str:
        return check_split(v)


class Manifest(Frozen):
    """The scenario manifest (SPEC §3)."""

    schema_: int = Field(alias="schema")
    """File format version; this code reads version 1."""
    dataset: str
    """Dataset name, recorded in the plan and the receipt."""
    split: str
    """Which splits this manifest covers, e.g. 'development+acceptance'."""

    @field_validator("split")
    @classmethod
    def _splits(cls, v: str) -> str:
        for part in v.split("+"):
            check_split(part)
        return v
    scenarios: tuple[Scenario, ...]
    """Every case, in a fixed order (the order enters reference_hash)."""
    stores: dict[str, Store]
    """Store id -> data file under data_dir, bound by size and sha256."""
    reference_hash: str
    """sha256 over the canonical list of (id, reference)."""
    data_hash: str
    """sha256 over the canonical stores mapping."""
    scoring: Scoring | None = Field(
        default=None, exclude_if=is_none,
        description="Default scorer, project scorer file and evidence vocabulary "
                    "(docs/scorers.md); absent: every reference chooses its own scorer.")

    @model_validator(mode="after")
    def _every_case_has_a_scorer(self) -> Manifest:
        for i, s in enumerate(self.scenarios):
            problem = scorer_problem(s.reference, self.scoring)
            if problem:
                raise ValueError(f"scenarios[{i}].reference: {problem}")
        return self


def scorer_problem(ref: Reference, scoring: Scoring | None) -> str | None:
    """Why ``ref`` has no usable scorer under the manifest's ``scoring``; None when it has."""
    spec = ref.selected(scoring.default if scoring else None)
    if spec is None:
        return "no scorer; set its scorer (or kind), or scoring.default for the whole manifest"
    if ref.scorer is None and ref.kind is None:
        try:
            ref.check_value(spec)
        except ValueError as exc:
            return f"(scoring.default) {exc}"
    if spec.name == "project" and (scoring is None or scoring.project is None):
        return "selects the project scorer but none is declared; add scoring.project.file"
    return None


class Grades(Frozen):
    """Per-criterion pass/fail for one (case, trial); None where the criterion does not apply."""

    correctness: bool | None = None
    """The answer matches the reference value (number within tolerance, or text)."""
    evidence: bool | None = None
    """The cited evidence mentions every string the reference requires."""
    refusal: bool | None = None
    """The agent refused exactly when the reference says it must."""
    judge_score: float | None = None
    """Judge method score, when a judge ran."""
    judge_pass: bool | None = None
    """judge_score >= the agreed threshold."""
    judge_error: str | None = None
    """Why the judge produced no score (it failed or could not be funded)."""
    scorer_error: str | None = Field(
        default=None, max_length=400, exclude_if=is_none,
        description="Why the case's scorer produced no grade (a project scorer raised, hung, "
                    "died or returned something other than criterion booleans); the record "
                    "is then infra_invalid.")

    @property
    def ungraded(self) -> bool:
        """The scorer or the judge produced no grade (a failure of the grading, not a
        fail of the answer)."""
        return self.scorer_error is not None or self.judge_error is not None

    def passed(self, criteria: Sequence[str] = CRITERIA) -> bool:
        """No criterion of ``criteria`` (the policy's; every one by default) and no judge
        verdict is false, and nothing that grades failed: a scorer or judge that produced
        no grade never vouches for a pass."""
        if self.ungraded:
            return False
        vals = [*(getattr(self, c) for c in criteria), self.judge_pass]
        return all(v is not False for v in vals)


class Identities(Frozen):
    """What a record was produced under; compare checks these against the policy."""

    data_hash: str
    """The manifest's data_hash (the stores' identity)."""
    reference_hash: str
    """The manifest's reference_hash (the expected answers' identity)."""
    scorer: str
    """sha256 of the scorer source the evaluator ran."""
    judge: str | None = None
    """Identity of the judge (model, prompt, upstream); None without a judge."""


class Record(Frozen):
    """One graded (case, trial) of one side of a comparison."""

    case_id: str
    """The scenario's id."""
    trial: int = Field(ge=0)
    """Zero-based trial number."""
    split: str
    """The scenario's split."""
    status: Literal["ok", "infra_invalid", "not_attempted"]
    """ok: the agent ran and its answer was graded; infra_invalid: the run or its output
    failed (see reason); not_attempted: the budget was spent before it could run."""
    reason: str | None = None
    """Named reason when status is not ok (e.g. timeout, budget)."""
    answer: dict[str, object] | None = None
    """The analyst's answer.json, as read from its output directory."""
    grades: Grades | None = None
    """The evaluator's grades; None when the case was not graded."""
    latency_s: float | None = None
    """Wall-clock seconds of the analyst container."""
    usage: dict[str, dict[str, object]] = Field(default_factory=dict)
    """Per role: calls, tokens, cost_usd (None when unknown), complete."""
    identities: Identities
    """What the record was produced under (data, references, scorer, judge)."""


class ComparisonPolicy(Frozen):
    """Frozen before anyone sees a result (SPEC §6)."""

    schema_: int = Field(alias="schema")
    """File format version; this code reads version 1."""
    cases: tuple[str, ...]
    """Exactly the cases compared (each times every trial)."""
    trials: int = Field(ge=1)
    """Trials per case; must equal the cycle file's trials."""
    mandatory: tuple[str, ...] = ()
    """Cases the candidate must pass (scenarios marked mandatory are added)."""
    criteria: tuple[Criterion, ...] = Field(default=CRITERIA, min_length=1)
    """Criteria compared; a case passes when none of them fails (at least one: with none,
    every case would pass)."""
    identities: Identities | None = None
    """Expected identities; filled in by freeze from the plan when absent."""
    require_judge: bool = False
    """Every graded record must carry a judge score, or the comparison is invalid."""
    max_case_latency_s: float | None = None
    """A candidate case slower than this is a regression."""
    max_total_cost_usd: float | None = None
    """A candidate side costing more (or of unknown cost) is rejected."""
    require_improvement: bool = True
    """Accept only when at least one case improves (not just nothing regressing)."""


Verdict = Literal["accept_for_review", "reject", "invalid_comparison"]


class CaseChange(Frozen):
    """One criterion of one (case, trial) that differs between the sides."""

    case_id: str
    """The scenario's id."""
    trial: int
    """Zero-based trial number."""
    criterion: str
    """The criterion that changed (correctness, evidence, refusal, judge_pass, ...)."""
    baseline: bool | None
    """The baseline's grade."""
    candidate: bool | None
    """The candidate's grade."""


class ComparisonResult(Frozen):
    verdict: Verdict
    """accept_for_review (exit 0), reject (1) or invalid_comparison (2)."""
    reasons: tuple[str, ...]
    """Every reason found, in check order; empty for accept_for_review."""
    regressions: tuple[CaseChange, ...] = ()
    """Criteria the candidate fails where the baseline passed."""
    improvements: tuple[CaseChange, ...] = ()
    """Criteria the candidate passes where the baseline failed."""
    usage: dict[str, dict[str, object]] = Field(default_factory=dict)
    """baseline / candidate totals per role."""
    statistics: dict[str, object] | None = None
    """Paired statistics (exact McNemar on pass/fail) when trials > 1; never the verdict."""


class ProposedFile(Frozen):
    path: str
    """Path relative to the source tree (apply refuses bad ones by name)."""
    content: str
    """The file's whole new content."""


class Proposal(Frozen):
    """``proposal.json`` as the worker writes it (``sandbox/worker.py``) and the host reads
    it back from the worker's output. Only the shape is checked here; the apply container
    refuses bad paths with named reasons."""

    schema_: int = Field(default=1, alias="schema")
    """File format version; this code reads version 1."""
    files: tuple[ProposedFile, ...]
    """The files the proposal replaces, each with its whole new content."""
    rationale: str = ""
    """The worker's explanation of what it changed and why."""
    base: dict[str, str | None] = Field(default_factory=dict)
    """path -> sha256 of the file the proposal was made against (None: a new file)."""


class ProposalFile(Proposal):
    """A proposal as ``cyclebox apply`` reads it. The path set and allowlist are the
    operator's: they are named here only so that a proposal carrying one is refused by
    name (``runner.cycle.apply.invocation_for``), not as an unknown key."""

    paths: tuple[str, ...] | None = None
    """Refused when present: the edit's path set is the operator's (``--paths`` or the
    plan), never the proposal's own."""
    allowlist: tuple[str, ...] | None = None
    """Refused when present: the allowlist is the operator's (``--allowlist`` or the
    plan), never the proposal's own."""


class Invocation(Frozen):
    """``invocation.json`` for the apply container: what the operator allows the edit."""

    paths: tuple[str, ...] = Field(min_length=1)
    """The exact path set the edit may change (plan or ``--paths``)."""
    allowlist: tuple[str, ...] = Field(min_length=1)
    """Globs every changed path must match."""
    base: dict[str, str | None]
    """path -> sha256 the tree must have before the edit (None: the file is new)."""
    max_file_bytes: int = Field(gt=0)
    """Largest file the edit may write, in bytes."""


class Applied(Frozen):
    """The apply container's claim (and, after the host's re-check, the stage's result)."""

    base_commit: str
    """The commit of the frozen base tree in the throwaway repository."""
    branch: str
    """The branch the candidate commit is on."""
    changed: tuple[str, ...]
    """Paths the edit changed."""
    commit: str
    """Checked to be a git object id before the host runs git on it."""
    status: Literal["applied"]
    """Always ``applied`` for this variant."""
    tree: str
    """The candidate tree; the host replaces it with the tree of its own bare clone."""


class ApplyRefusal(Frozen):
    """Why no candidate came out of the apply stage; ``reason`` is a named rule."""

    status: Literal["refused"]
    """Always ``refused`` for this variant."""
    reason: str
    """A proposal rule (sandbox.proposal), or git_failed (git in the apply container
    refused the edit: its stderr in ``message``), output_refused, apply_failed,
    host_verification_failed, export_mismatch."""
    message: str
    """What was wrong, for the operator."""


ApplyResult = Annotated[Applied | ApplyRefusal, Field(discriminator="status")]
"""``result.json`` of the apply stage."""


CUT_SHORT = "cut-short.txt"
"""The file a second signal leaves in a run directory: while the run's stages ran
(:mod:`runner.cycle.run`) or while its receipt was written (:mod:`runner.cycle.receipt`)."""
ENVELOPE = "receipt.dsse.json"
"""The DSSE envelope ``receipt sign`` writes beside a run's receipt (runner.cycle.signing)."""
NO_RECEIPT_VERDICT = "verdict.no-receipt.json"
"""Where a run's verdict is set aside when its receipt could not be written."""
