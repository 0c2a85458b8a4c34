"""Totals over a call log: per role, with ``complete`` false whenever any cost is unknown."""

from __future__ import annotations

from typing import Any

from runner.gateway.calllog import CallRecord


def summarize(records: list[CallRecord]) -> dict[str, Any]:
    """Per-role and overall calls, statuses, tokens and cost; cost is None when unknown."""
    def empty() -> dict[str, Any]:
        return {"calls": 0, "ok": 0, "refused": 0, "infra_error": 0, "tokens": 0,
                "cost_usd": 0.0, "complete": True, "fixture_calls": 0}

    per_role: dict[str, dict[str, Any]] = {}
    total = empty()
    for r in records:
        n = r.not_itemized or 1  # one record standing for refusals counted, not itemized
        for row in (per_role.setdefault(r.role, empty()), total):
            row["calls"] += n
            row[r.status] += n
            row["fixture_calls"] += int(r.fixture)
            if r.usage:
                row["tokens"] += r.usage.total_tokens
            if r.status == "refused":
                continue  # never reached an upstream: no charge
            if r.cost_usd is None:
                row["complete"] = False
            elif row["cost_usd"] is not None:
                row["cost_usd"] = round(row["cost_usd"] + r.cost_usd, 9)
    for row in [*per_role.values(), total]:
        if not row["complete"]:
            row["cost_usd_known_part"] = row["cost_usd"]
            row["cost_usd"] = None
    return {"per_role": dict(sorted(per_role.items())), "total": total}
