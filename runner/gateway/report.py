"""Totals over a call log: per role, with ``complete`` false whenever any cost is unknown.

The totals are frozen values; their JSON (``model_dump(mode="json")``) is what receipts,
records and reports hold, so field order and presence are part of the format:
``cost_usd_known_part`` appears only when ``complete`` is false, ``bounded_calls`` only
when some call was charged its worst case (so totals of runs without one keep their hash).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from runner.gateway.calllog import CallRecord
from runner.isolation.sandbox import Frozen


class UsageTotals(Frozen):
    """Model calls of one role (or of the whole run)."""

    calls: int
    """Calls, counting each refusal that was counted but not itemized."""
    ok: int
    refused: int
    infra_error: int
    tokens: int
    """Total tokens as the upstream reported them (calls without usage add nothing)."""
    cost_usd: float | None
    """None when any charged call's cost is unknown (never a silent zero)."""
    complete: bool
    """Every call that reached an upstream has a known cost."""
    fixture_calls: int
    """Calls answered by the scripted provider (never a real model)."""
    cost_usd_known_part: float | None = Field(default=None, exclude_if=lambda v: v is None)
    """Sum of the known costs; present only when ``cost_usd`` is None."""
    bounded_calls: int = Field(default=0, ge=0, exclude_if=lambda v: v == 0)
    """Calls charged their admitted worst case because they ended without usage
    (``cost_basis: upper_bound``): their part of ``cost_usd`` is an upper bound, not a
    measurement. Present only when non-zero."""


class UsageReport(Frozen):
    """Per-role and overall totals (``receipt.json``'s ``usage``)."""

    per_role: dict[str, UsageTotals]
    """Role -> totals, sorted by role."""
    total: UsageTotals


@dataclass
class _Row:
    calls: int = 0
    ok: int = 0
    refused: int = 0
    infra_error: int = 0
    tokens: int = 0
    cost_usd: float = 0.0
    complete: bool = True
    fixture_calls: int = 0
    bounded_calls: int = 0

    def add(self, r: CallRecord) -> None:
        n = r.not_itemized or 1  # one record standing for refusals counted, not itemized
        self.calls += n
        setattr(self, r.status, getattr(self, r.status) + n)
        self.fixture_calls += int(r.fixture)
        if r.usage:
            self.tokens += r.usage.total_tokens
        if r.status == "refused":
            return  # never reached an upstream: no charge
        if r.cost_usd is None:
            self.complete = False
        else:
            self.bounded_calls += int(r.cost_basis == "upper_bound")
            self.cost_usd = round(self.cost_usd + r.cost_usd, 9)

    def totals(self) -> UsageTotals:
        return UsageTotals(calls=self.calls, ok=self.ok, refused=self.refused,
                           infra_error=self.infra_error, tokens=self.tokens,
                           cost_usd=self.cost_usd if self.complete else None,
                           complete=self.complete, fixture_calls=self.fixture_calls,
                           cost_usd_known_part=None if self.complete else self.cost_usd,
                           bounded_calls=self.bounded_calls)


def summarize(records: list[CallRecord]) -> UsageReport:
    """Per-role and overall calls, statuses, tokens and cost; cost is None when unknown."""
    per_role: dict[str, _Row] = {}
    total = _Row()
    for r in records:
        per_role.setdefault(r.role, _Row()).add(r)
        total.add(r)
    return UsageReport(per_role={k: v.totals() for k, v in sorted(per_role.items())},
                       total=total.totals())
