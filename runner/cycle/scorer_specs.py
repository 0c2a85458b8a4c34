"""Scorer specifications as manifests state them (docs/scorers.md): one model per scorer,
chosen by ``name``, and the manifest's ``scoring`` section. Frozen, ``extra="forbid"``,
every field described. The scoring itself is sandbox/scoring.py, in the evaluator."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, field_validator

from runner.isolation.sandbox import Frozen
from sandbox import scoring


class Described(Frozen):
    """A Frozen model whose field docstrings are its schema descriptions."""

    model_config = ConfigDict(use_attribute_docstrings=True)


def is_none(v: object) -> bool:
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

TEXT_VALUE = ("normalized", "contains")
"""Scorers whose value must be a non-empty string."""


def check_phrase(e: str, what: str) -> None:
    """ValueError unless ``e`` is 1..8 word tokens of at most 64 characters each."""
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
            check_phrase(e, "evidence_vocabulary")
        return v
