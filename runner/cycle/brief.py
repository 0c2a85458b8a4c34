"""The failure brief for the coding worker: built only from development-split failures.

Invariant: nothing from another split (acceptance, reserved, held-out) can enter the
brief; the function filters by the scenarios' split (development, or a dream variant
of a development task), not by what records claim.

Untrusted text (questions, answers) is fenced as data and length-capped (see
:func:`build_brief`); the worker model reads this file.
"""

from __future__ import annotations

import json

from runner.cycle.models import DEVELOPMENT, Record, Scenario
from runner.termsafe import DATA_NOTE, fence, plain

BRIEF_SPLIT = DEVELOPMENT


def briefable(scenarios: dict[str, Scenario]) -> dict[str, Scenario]:
    """Development tasks and the dream variants derived from them; nothing else."""
    dev = {k: s for k, s in scenarios.items() if s.split == BRIEF_SPLIT and s.origin is None}
    dev.update({k: s for k, s in scenarios.items() if s.origin == "dream"
                and s.derived_from in dev})
    return dev


def failing_development(records: list[Record], scenarios: dict[str, Scenario]) -> list[Record]:
    """Graded development records (or of their dream variants) that failed a criterion:
    exactly what a generated brief quotes, in (case, trial) order."""
    dev = briefable(scenarios)
    return [r for r in sorted(records, key=lambda r: (r.case_id, r.trial))
            if r.case_id in dev and r.status == "ok" and r.grades is not None
            and not r.grades.passed()]


def nothing_to_brief(records: list[Record], scenarios: dict[str, Scenario]) -> str:
    """The named reason a cycle ends when no development failure can be briefed (the
    worker is then not called): ``nothing_to_improve`` when every development run passed,
    ``no_failure_to_brief`` when some did not complete (the first one's reason quoted)."""
    dev = briefable(scenarios)
    runs = sorted((r for r in records if r.case_id in dev), key=lambda r: (r.case_id, r.trial))
    not_ok = [r for r in runs if r.status != "ok"]
    if not not_ok:
        return (f"nothing_to_improve: all {len(runs)} development run(s) passed on the "
                "baseline, so there is no failure to brief; the worker was not called. "
                "Add development cases the agent fails, or give a fixed brief "
                "(brief: {mode: file})")
    first = not_ok[0]
    return (f"no_failure_to_brief: no development run failed a graded criterion and "
            f"{len(not_ok)} of {len(runs)} did not complete, so there is nothing to brief; "
            f"the worker was not called. First: {first.case_id} t{first.trial} "
            f"{first.status}: {first.reason or 'no reason recorded'}")


ITEM_LIMIT = 2000
"""Characters quoted of one question or answer (a visible marker shows a cut)."""
TOTAL_LIMIT = 24_000
"""Characters of the whole brief; failing cases past it are counted, not quoted."""


def build_brief(records: list[Record], scenarios: dict[str, Scenario]) -> str:
    """Markdown listing each failing development case: question, expected, got, criteria.

    Questions (dream variants are model-written) and answers (the agent's) are untrusted:
    each is quoted in a fenced block longer than any backtick run inside it, with controls
    escaped, capped at :data:`ITEM_LIMIT` characters, under a note that it is data, not
    instructions. The brief stays under :data:`TOTAL_LIMIT` characters: cases past it are
    named in a count only."""
    dev = briefable(scenarios)
    head = ["Failures of the current agent on development cases.", "", DATA_NOTE, ""]
    lines: list[str] = []
    size = sum(len(x) + 1 for x in head)
    failing = 0
    omitted = 0
    for r in failing_development(records, scenarios):
        s = dev[r.case_id]
        assert r.grades is not None  # noqa: S101 - failing_development keeps graded ones
        failing += 1
        failed = [c for c in ("correctness", "evidence", "refusal", "judge_pass")
                  if getattr(r.grades, c) is False]
        ref = s.reference
        expected = "a refusal" if ref.kind == "refuse" else json.dumps(ref.value)
        got = (r.answer or {}).get("answer")
        question = s.input.get("question", json.dumps(s.input, sort_keys=True))
        item = [f"## {r.case_id} (trial {r.trial})", "- question:", "",
                fence(question if isinstance(question, str) else json.dumps(question),
                      ITEM_LIMIT), "",
                f"- expected: {plain(expected, ITEM_LIMIT, newlines=False)}",
                "- got" + (" (refused)" if (r.answer or {}).get("refused") else "") + ":", "",
                fence(got if isinstance(got, str) else json.dumps(got), ITEM_LIMIT), "",
                f"- failed criteria: {', '.join(failed)}", ""]
        cost = sum(len(x) + 1 for x in item)
        if omitted or size + cost > TOTAL_LIMIT:
            omitted += 1
            continue
        lines += item
        size += cost
    if not failing:
        lines.append("No development case failed.")
    if omitted:
        lines.append(f"{omitted} more failing case(s) omitted: the brief is capped at "
                     f"{TOTAL_LIMIT} characters.")
    return "\n".join(head + lines).rstrip() + "\n"
