"""Values the cycle trades in: scenario manifests, graded records, comparison policies and
verdicts. All frozen, ``extra="forbid"``, versioned; hashed with runner.hashing."""

from __future__ import annotations

import math
import re
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator

from runner.isolation.sandbox import Frozen
from sandbox import scoring

Criterion = Literal["correctness", "evidence", "refusal"]
CRITERIA: tuple[Criterion, ...] = ("correctness", "evidence", "refusal")
SPLITS = ("development", "acceptance", "reserved", "train")
"""The documented splits: development (briefed to the worker), acceptance and reserved
(held out; never reach the worker), train (dream variants, generated)."""


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
    size_bytes: int = Field(ge=0)

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


class Described(Frozen):
    """A Frozen model whose field docstrings are its schema descriptions."""

    model_config = ConfigDict(use_attribute_docstrings=True)


def _is_none(v: object) -> bool:
    return v is None


class ExactScorer(Described):
    """The answer equals ``value`` exactly: the same string, or the same number."""

    name: Literal["exact"]
    """Scorer name: exact."""


class NormalizedScorer(Described):
    """Equal after normalising both sides: NFKC, casefold, whitespace runs collapsed,
    punctuation trimmed from both ends."""

    name: Literal["normalized"]
    """Scorer name: normalized."""


class ContainsScorer(Described):
    """The normalised ``value`` occurs inside the normalised answer. Opt-in only: an
    answer listing every candidate passes it."""

    name: Literal["contains"]
    """Scorer name: contains."""


class NumberScorer(Described):
    """A numeric answer (a JSON number or a numeric string) within
    ``max(abs_tol, rel_tol * |value|)`` of ``value``."""

    name: Literal["number"]
    """Scorer name: number."""
    rel_tol: float = Field(default=1e-9, ge=0)
    """Relative tolerance, a fraction of |value| (0.01 = 1 %)."""
    abs_tol: float = Field(default=0.0, ge=0)
    """Absolute tolerance, in the answer's unit."""


class RegexScorer(Described):
    """The whole answer matches ``pattern`` (Python ``re.fullmatch``); answers longer
    than 1000 characters score false."""

    name: Literal["regex"]
    """Scorer name: regex."""
    pattern: str = Field(min_length=1, max_length=scoring.MAX_PATTERN_CHARS)
    """Python regular expression the whole answer must match (compiled once)."""
    ignore_case: bool = False
    """Match case-insensitively."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as exc:
            raise ValueError(f"pattern does not compile: {exc}") from None
        return v


class JsonFieldScorer(Described):
    """The answer is a JSON object (or a string holding one); the value at ``path``
    equals ``value``."""

    name: Literal["json_field"]
    """Scorer name: json_field."""
    path: str = Field(pattern=r"^[^.]+(\.[^.]+)*$", max_length=200)
    """Dotted path into the answer: object keys, or decimal indexes into arrays
    (``totals.0.amount``)."""
    match: Literal["exact", "normalized"] = "exact"
    """exact: same string / same number / null; normalized: equal after normalisation."""

    @field_validator("path")
    @classmethod
    def _depth(cls, v: str) -> str:
        if len(v.split(".")) > scoring.MAX_PATH_SEGMENTS:
            raise ValueError(f"path has more than {scoring.MAX_PATH_SEGMENTS} segments")
        return v


class RefusalScorer(Described):
    """The agent must decline (``refused: true`` in answer.json); correctness and
    evidence do not apply."""

    name: Literal["refusal"]
    """Scorer name: refusal."""


class ProjectScorerRef(Described):
    """The project's own scorer file (``scoring.project`` in the manifest) decides."""

    name: Literal["project"]
    """Scorer name: project."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Free-form JSON handed to the project's score() as reference["scorer"]["options"]."""


def _shorthand(v: object) -> object:
    """``scorer: normalized`` is short for ``scorer: {name: normalized}``."""
    return {"name": v} if isinstance(v, str) else v


ScorerSpec = Annotated[
    ExactScorer | NormalizedScorer | ContainsScorer | NumberScorer | RegexScorer
    | JsonFieldScorer | RefusalScorer | ProjectScorerRef,
    Field(discriminator="name"), BeforeValidator(_shorthand)]
"""One scorer, chosen by ``name``; a bare name is accepted where no option is needed."""

LEGACY_KINDS = {"number": "number", "text": "normalized", "refuse": "refusal"}
"""kind -> the scorer it stands for. ``text`` was a case-insensitive substring test, which
passed an answer listing every candidate; it now means ``normalized`` equality (the
case-insensitivity it promised, without the substring). ``contains`` is the opt-in for
the old behaviour."""

TEXT_VALUE = ("normalized", "contains")
"""Scorers whose value must be a non-empty string."""


class Reference(Described):
    """What a correct answer looks like; the analyst never sees this."""

    kind: Literal["number", "text", "refuse"] | None = Field(default=None, exclude_if=_is_none)
    """Legacy shorthand, kept so existing manifests validate: number -> the number scorer
    with ``tolerance`` as both relative and absolute tolerance; text -> normalized;
    refuse -> refusal. Leave it out when ``scorer`` is set."""
    scorer: ScorerSpec | None = Field(default=None, exclude_if=_is_none)
    """This case's scorer (docs/scorers.md); when absent, ``kind`` decides, else the
    manifest's ``scoring.default``."""
    value: float | str | None = None
    """The expected answer (a number or a string); unused by regex and refusal."""
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
            _check_phrase(e, "evidence")
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
        """The scorer this reference is graded by: its own, its kind's, or ``default``."""
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


def _check_phrase(e: str, what: str) -> None:
    words = scoring.tokens(e)
    if not words:
        raise ValueError(f"{what} entry {e[:40]!r} has no word characters (letters, "
                         "digits or underscore) to match")
    if len(words) > scoring.MAX_PHRASE_TOKENS:
        raise ValueError(f"{what} entry {e[:40]!r} has more than "
                         f"{scoring.MAX_PHRASE_TOKENS} words")
    if any(w is None for w in words):
        raise ValueError(f"{what} entry {e[:40]!r} has a word longer than "
                         f"{scoring.MAX_TOKEN_CHARS} characters")


class ProjectScorerFile(Described):
    """The project's own scorer: a Python file defining ``score(answer, reference, case)``
    that runs inside the evaluator container, never on the host (docs/scorers.md)."""

    file: str
    """Path of the file, relative to the manifest's directory (e.g. scorer.py)."""
    timeout_s: float = Field(default=10.0, gt=0, le=120)
    """Wall time one score() call may take (the first call also loads the file)."""

    @field_validator("file")
    @classmethod
    def _relative(cls, v: str) -> str:
        p = PurePosixPath(v)
        if not v or "\0" in v or "\\" in v or p.is_absolute() or v.startswith("~") \
                or ".." in p.parts:
            raise ValueError(f"scorer file {v[:80]!r} must be a relative path inside the "
                             "manifest's directory, without ..")
        return v


class Scoring(Described):
    """How the manifest's cases are scored, beyond each reference's own settings."""

    default: ScorerSpec | None = None
    """Scorer for every reference that sets neither ``scorer`` nor ``kind``."""
    project: ProjectScorerFile | None = None
    """The project's own scorer file, selected by ``scorer: project``."""
    evidence_vocabulary: tuple[str, ...] = Field(default=(), max_length=256)
    """Evidence a case may be tempted to cite (e.g. every table of the store), added to
    every entry any reference requires; citing one that the case does not require counts
    as an extra (the evidence rule in docs/scorers.md)."""
    evidence_max_extra: int = Field(default=0, ge=0, le=64)
    """Extras a citation may carry and still count as evidence."""

    @field_validator("evidence_vocabulary")
    @classmethod
    def _vocabulary_tokens(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for e in v:
            _check_phrase(e, "evidence_vocabulary")
        return v


class Scenario(Frozen):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    split: str
    """development (briefed), acceptance or reserved (held out), or train (dream variants)."""
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

    @field_validator("split")
    @classmethod
    def _split(cls, v: str) -> str:
        return check_split(v)


class Manifest(Frozen):
    """The scenario manifest (SPEC §3)."""

    schema_: int = Field(alias="schema")
    dataset: str
    split: str
    """Which splits this manifest covers, e.g. 'development+acceptance'."""

    @field_validator("split")
    @classmethod
    def _splits(cls, v: str) -> str:
        for part in v.split("+"):
            check_split(part)
        return v
    scenarios: tuple[Scenario, ...]
    stores: dict[str, Store]
    reference_hash: str
    """sha256 over the canonical list of (id, reference)."""
    data_hash: str
    """sha256 over the canonical stores mapping."""
    scoring: Scoring | None = Field(
        default=None, exclude_if=_is_none,
        description="Default scorer, project scorer file and evidence vocabulary "
                    "(docs/scorers.md); absent: every reference chooses its own scorer.")

    @model_validator(mode="after")
    def _every_case_has_a_scorer(self) -> Manifest:
        sc = self.scoring
        for i, s in enumerate(self.scenarios):
            spec = s.reference.selected(sc.default if sc else None)
            where = f"scenarios[{i}].reference"
            if spec is None:
                raise ValueError(f"{where}: no scorer; set its scorer (or kind), or "
                                 "scoring.default for the whole manifest")
            if s.reference.scorer is None and s.reference.kind is None:
                try:
                    s.reference.check_value(spec)
                except ValueError as exc:
                    raise ValueError(f"{where} (scoring.default): {exc}") from None
            if spec.name == "project" and (sc is None or sc.project is None):
                raise ValueError(f"{where}: selects the project scorer but the manifest "
                                 "declares none; add scoring.project.file")
        return self


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
    scorer_error: str | None = Field(
        default=None, max_length=400, exclude_if=_is_none,
        description="Why the case's scorer produced no grade (a project scorer raised, hung, "
                    "died or returned something other than criterion booleans); the record "
                    "is then infra_invalid.")

    def passed(self) -> bool:
        if self.scorer_error is not None:
            return False
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


class ProposedFile(Frozen):
    path: str
    """Path relative to the source tree (apply refuses bad ones by name)."""
    content: str
    """The file's whole new content."""


class ProposalFile(Frozen):
    """``proposal.json`` as the worker writes it and ``cyclebox apply`` reads it. Only the
    shape is checked here; the apply container refuses bad paths with named reasons."""

    schema_: int = Field(default=1, alias="schema")
    files: tuple[ProposedFile, ...]
    rationale: str = ""
    base: dict[str, str | None] = Field(default_factory=dict)
    """path -> sha256 of the file the proposal was made against (None: a new file)."""
    paths: tuple[str, ...] | None = None
    """The invocation's exact path set; defaults to the proposal's own paths."""
    allowlist: tuple[str, ...] = ("*",)
