"""The report's schema (``cyclebox report --json``); documented in docs/report.md.

Strings copied from the run directory (answers, reasons, case ids, patch text) are kept
verbatim up to a length cap and are hostile: each renderer escapes them for its medium.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from runner.isolation.sandbox import Frozen

REPORT_SCHEMA = 1
Arm = Literal["baseline", "candidate"]


class PassRate(Frozen):
    """Pass rate of one arm on one split, over every (case, trial) row it holds."""

    arm: Arm
    split: str
    rows: int = Field(ge=0)
    """(case, trial) rows of this arm and split."""
    ok: int = Field(ge=0)
    """Rows whose analyst run produced a readable answer (status ok)."""
    passed: int = Field(ge=0)
    """Rows graded and passing every policy criterion (unknown never passes)."""
    rate: float | None
    """passed / rows; None when there are no rows."""


class Attempt(Frozen):
    """One (case, trial) of one arm."""

    trial: int
    status: str
    """ok, infra_invalid or not_attempted."""
    reason: str | None = None
    passed: bool
    failed_criteria: tuple[str, ...] = ()
    """Policy criteria graded false, or ``ungraded`` when no grades exist."""
    grades: dict[str, bool | float | str | None] | None = None
    answer: str | None = None
    """The analyst's answer text (``answer`` field, else the answer JSON), capped."""
    latency_s: float | None = None
    logs: tuple[str, ...] = ()
    """Run-directory-relative paths of this attempt's logs and answer file that exist."""


class CaseRow(Frozen):
    """One case, both arms side by side."""

    case_id: str
    split: str
    mandatory: bool
    compared: bool
    """True when the frozen policy compares this case (else: baseline-only, e.g. briefing)."""
    baseline: tuple[Attempt, ...] = ()
    candidate: tuple[Attempt, ...] = ()


class Change(Frozen):
    """One criterion that flipped between arms for a (case, trial)."""

    case_id: str
    trial: int
    criterion: str
    baseline: bool | None
    candidate: bool | None


class RoleCost(Frozen):
    """Model-call totals of one role (or ``total``) from the gateway's call log."""

    role: str
    calls: int
    ok: int
    refused: int
    infra_error: int
    tokens: int
    cost_usd: float | None
    """None when any call's cost is unknown (never a silent zero)."""
    cost_usd_known_part: float | None = None
    """Sum of the known costs when cost_usd is None."""
    complete: bool
    fixture_calls: int
    """Calls answered by the scripted provider (not a real model)."""
    bounded_calls: int = 0
    """Calls charged their admitted worst case (ended without usage): an upper bound."""


class Statistics(Frozen):
    """Exact McNemar on per-(case, trial) pass/fail, when trials > 1; never the verdict."""

    method: str
    pairs: int
    b: int
    """Pairs passing on baseline only."""
    c: int
    """Pairs passing on candidate only."""
    p_value: float
    note: str


class Report(Frozen):
    """Everything ``cyclebox report`` shows about one run directory."""

    schema_: int = Field(REPORT_SCHEMA, alias="schema")
    run_dir: str
    """The run directory as given."""
    name: str | None
    """The cycle's name from plan.json."""
    plan_hash: str | None
    verdict: str
    """accept_for_review, reject or invalid_comparison (``incomplete`` when no verdict file)."""
    exit_code: int
    """What ``cycle run`` exits with for this verdict (0, 1, 2)."""
    reasons: tuple[str, ...]
    trials: int | None
    criteria: tuple[str, ...]
    pass_rates: tuple[PassRate, ...]
    cases: tuple[CaseRow, ...]
    improved: tuple[Change, ...]
    regressed: tuple[Change, ...]
    costs: tuple[RoleCost, ...]
    """Per role, then one row named ``total``."""
    fixture: bool
    """True when any model call came from a scripted fixture."""
    statistics: Statistics | None
    receipt_sha256: str | None
    """sha256 of receipt.json's bytes; None when the run has no receipt."""
    receipt_verified: bool | None = None
    """Whether the run directory verified against that receipt (its files and every field
    they give; data stores outside it not read); None without a receipt, or when the run
    was too large for the report to check (a problem says so)."""
    patch: str | None
    """The candidate patch (stages/apply/candidate.patch), capped."""
    patch_truncated: bool = False
    timing: dict[str, float] = Field(default_factory=dict)
    problems: tuple[str, ...] = ()
    """Files that could not be read or parsed; the report shows what it could."""


def receipt_text(r: Report) -> str:
    """The receipt's hash and whether the run matches it, as every output shows it."""
    if r.receipt_sha256 is None:
        return "MISSING (no receipt.json)"
    if r.receipt_verified:
        return f"{r.receipt_sha256} (verified: the run matches it)"
    if r.receipt_verified is None:
        return (f"{r.receipt_sha256} (NOT VERIFIED here: the run is too large for a report "
                "to check; `cyclebox receipt verify` checks it)")
    return (f"{r.receipt_sha256} (NOT VERIFIED: the run directory does not match its "
            "receipt; what is shown may have been edited; `cyclebox receipt verify` names "
            "the problems)")
