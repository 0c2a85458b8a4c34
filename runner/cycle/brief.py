"""The failure brief for the coding worker: built only from development-split failures.

Invariant: nothing from another split (acceptance, reserved, held-out) can enter the
brief; the function filters by the scenarios' split (development, or a dream variant
of a development task), not by what records claim.
"""

from __future__ import annotations

import json

from runner.cycle.models import Record, Scenario

BRIEF_SPLIT = "development"


def briefable(scenarios: dict[str, Scenario]) -> dict[str, Scenario]:
    """Development tasks and the dream variants derived from them; nothing else."""
    dev = {k: s for k, s in scenarios.items() if s.split == BRIEF_SPLIT and s.origin is None}
    dev.update({k: s for k, s in scenarios.items() if s.origin == "dream"
                and s.derived_from in dev})
    return dev


def build_brief(records: list[Record], scenarios: dict[str, Scenario]) -> str:
    """Markdown listing each failing development case: question, expected, got, criteria."""
    dev = briefable(scenarios)
    lines = ["Failures of the current agent on development cases.", ""]
    failing = 0
    for r in sorted(records, key=lambda r: (r.case_id, r.trial)):
        s = dev.get(r.case_id)
        if s is None or r.status != "ok" or r.grades is None or r.grades.passed():
            continue
        failing += 1
        failed = [c for c in ("correctness", "evidence", "refusal", "judge_pass")
                  if getattr(r.grades, c) is False]
        ref = s.reference
        expected = "a refusal" if ref.kind == "refuse" else json.dumps(ref.value)
        got = (r.answer or {}).get("answer")
        lines += [f"## {r.case_id} (trial {r.trial})",
                  f"- question: {s.input.get('question', json.dumps(s.input, sort_keys=True))}",
                  f"- expected: {expected}",
                  f"- got: {json.dumps(got)}" + (" (refused)" if (r.answer or {}).get("refused")
                                                  else ""),
                  f"- failed criteria: {', '.join(failed)}", ""]
    if not failing:
        lines.append("No development case failed.")
    return "\n".join(lines).rstrip() + "\n"
