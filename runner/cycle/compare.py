"""Compare a candidate with a baseline under a frozen policy (SPEC §6).

Invariants:
- ``compare`` is pure: records and a policy in, one ComparisonResult out; no IO, no clock.
- Exactly one verdict, by class in a fixed order: invalid_comparison outranks reject, which
  outranks accept_for_review. Every reason of the winning class is listed in check order;
  reasons of an outranked class are not (an invalid comparison has no meaningful rejection).
- Fail closed: nothing unknown reads as a pass. A missing pair, an unknown or negative cost
  under a cost ceiling, an unknown latency under a latency ceiling, or a required judge
  without a verdict never passes a check.
- Records are never merged, deduplicated or replaced: a duplicated (case, trial) is invalid,
  never "the better attempt" (every attempt is kept).
- Regressions, improvements, usage and statistics are reported whatever the verdict;
  statistics never change it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from runner.cycle.models import (
    RECORDS_MAX_BYTES,
    CaseChange,
    ComparisonPolicy,
    ComparisonResult,
    Grades,
    Record,
    Verdict,
)
from runner.errors import EXIT_INVALID, EXIT_OK, EXIT_REJECT, ConfigError
from runner.loading import load_lines, load_model, show

EXIT_CODES: dict[Verdict, int] = {"accept_for_review": EXIT_OK, "reject": EXIT_REJECT,
                                  "invalid_comparison": EXIT_INVALID}
"""Exit code per verdict (``runner.errors`` holds the one table)."""
POLICY_SCHEMA = 1
_IDENTITIES = ("data_hash", "reference_hash", "scorer", "judge")
_NOTE = ("statistics are reported beside the verdict and never change it; trials of one case "
         "are correlated, so read the p-value as descriptive")

Key = tuple[str, int]
Pairs = dict[Key, tuple[Grades, Grades]]


@dataclass
class _RoleTotals:
    calls: int = 0
    tokens: int = 0
    cost_usd: float | None = 0.0
    complete: bool = True


def compare(baseline: Sequence[Record], candidate: Sequence[Record],
            policy: ComparisonPolicy) -> ComparisonResult:
    """Return the one verdict for candidate against baseline, with every reason of its class."""
    sides = {"baseline": baseline, "candidate": candidate}
    totals = {side: _usage_totals(recs) for side, recs in sides.items()}
    pairs = _pairs(baseline, candidate, policy)
    criteria = (*policy.criteria, "judge_pass")
    regressions = _changes(pairs, criteria, before=True)
    verdict: Verdict = "invalid_comparison"
    reasons = [f"policy: {field}: {problem}" for field, problem in _policy_problems(policy)]
    reasons += _invalid_reasons(sides, totals, policy)
    if not reasons:
        reasons = _reject_reasons(candidate, pairs, regressions, totals["candidate"], policy)
        verdict = "reject" if reasons else "accept_for_review"
    return ComparisonResult(
        verdict=verdict, reasons=_bounded(reasons), regressions=regressions,
        improvements=_changes(pairs, criteria, before=False),
        usage={side: {role: asdict(t) for role, t in ts.items()} for side, ts in totals.items()},
        statistics=_statistics(pairs, policy.criteria) if policy.trials > 1 else None)


MAX_REASONS = 1000
"""Reasons kept in a verdict; past it, one line counts the rest."""
MAX_REASON_CHARS = 500


def _bounded(reasons: list[str]) -> tuple[str, ...]:
    """Each reason one printable line of at most :data:`MAX_REASON_CHARS` (records hold
    what a container and an evaluator wrote: an identity of a megabyte, a judge error with
    newlines), at most :data:`MAX_REASONS` of them and a count of the rest."""
    out = [show(r, MAX_REASON_CHARS) for r in reasons[:MAX_REASONS]]
    if len(reasons) > MAX_REASONS:
        out.append(f"... and {len(reasons) - MAX_REASONS} more reasons of this class")
    return tuple(out)


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: binomial test of min(b, c) in b + c trials at 0.5."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / (1 << n)
    return min(1.0, 2 * tail)


def _invalid_reasons(sides: dict[str, Sequence[Record]],
                     totals: dict[str, dict[str, _RoleTotals]],
                     policy: ComparisonPolicy) -> list[str]:
    expected = {(c, t) for c in policy.cases for t in range(policy.trials)}
    each = [(side, r) for side, recs in sides.items() for r in recs]
    out: list[str] = []
    for side, recs in sides.items():
        counts = Counter((r.case_id, r.trial) for r in recs)
        out += [f"{side}: missing (case {c}, trial {t})" for c, t in sorted(expected - set(counts))]
        for (c, t), n in sorted(counts.items()):
            if (c, t) not in expected:
                out.append(f"{side}: extra (case {c}, trial {t}) outside policy cases x trials")
            if n > 1:
                out.append(f"{side}: duplicated (case {c}, trial {t}): {n} records")
    if (want := policy.identities) is not None:
        for side, r in each:
            for name in _IDENTITIES:
                exp, got = getattr(want, name), getattr(r.identities, name)
                if exp != got:
                    out.append(f"{side}: {name} differs from policy (case {r.case_id}, trial "
                               f"{r.trial}): expected {show(repr(exp), 80)}, got "
                               f"{show(repr(got), 80)}")
    elif each:
        # No identities in the policy (a standalone `cyclebox compare`): the two sides must
        # at least agree with each other, as a frozen cycle's records agree with its plan.
        first_side, first = each[0]
        for side, r in each[1:]:
            for name in _IDENTITIES:
                exp, got = getattr(first.identities, name), getattr(r.identities, name)
                if exp != got:
                    out.append(f"{side}: {name} differs from {first_side} (case {r.case_id}, "
                               f"trial {r.trial} vs case {first.case_id}, trial "
                               f"{first.trial}): {show(repr(exp), 80)} vs "
                               f"{show(repr(got), 80)}; the policy names no "
                               "identities, so the sides must share one")
    if policy.require_judge:
        for side, r in each:
            g = r.grades
            if r.status == "ok" and (g is None or g.judge_score is None or g.judge_pass is None
                                     or g.judge_error is not None):
                why = (g.judge_error if g else None) or "no judge verdict"
                out.append(f"{side}: required judge failed or could not be funded "
                           f"(case {r.case_id}, trial {r.trial}): {show(why, 200)}")
    if policy.max_total_cost_usd is not None:
        for side, ts in totals.items():
            for role, tot in sorted(ts.items()):
                if tot.cost_usd is None or not tot.complete:
                    what = "cost_usd unknown" if tot.cost_usd is None else "usage incomplete"
                    out.append(f"{side}: unknown cost under a cost ceiling (role {role}: {what})")
        out += [f"{side}: unknown cost under a cost ceiling (case {r.case_id}, trial {r.trial}: "
                "no usage recorded)" for side, r in each if r.status == "ok" and not r.usage]
    for side, r in each:
        where = f"(case {r.case_id}, trial {r.trial})"
        if r.status != "ok":
            out.append(f"{side}: {r.status} {where}: "
                       f"{show(r.reason, 300) if r.reason else 'no reason given'}")
        elif r.grades is None:
            out.append(f"{side}: ok record without grades {where}")
    return out


def _reject_reasons(candidate: Sequence[Record], pairs: Pairs,
                    regressions: tuple[CaseChange, ...], cand_totals: dict[str, _RoleTotals],
                    policy: ComparisonPolicy) -> list[str]:
    out: list[str] = []
    for r in candidate:
        if r.case_id in policy.mandatory and r.grades is not None:
            out += [f"candidate: mandatory case {r.case_id} failed {crit} (trial {r.trial})"
                    for crit in (*policy.criteria, "judge_pass")
                    if getattr(r.grades, crit) is False]
            if r.grades.judge_error is not None:
                out.append(f"candidate: mandatory case {r.case_id} has no judge verdict "
                           f"(trial {r.trial}): {show(r.grades.judge_error, 200)}")
    out += [f"regression: {ch.criterion} passed on baseline, failed on candidate "
            f"(case {ch.case_id}, trial {ch.trial})" for ch in regressions]
    # A judge that gave no verdict on the candidate (an answer can make it fail) cannot
    # keep a pass the baseline had: the failure is never a way around the judge.
    out += [f"regression: judge_pass passed on baseline, no judge verdict on candidate "
            f"(case {case}, trial {trial}): {show(gc.judge_error, 200)}"
            for (case, trial), (gb, gc) in pairs.items()
            if gb.judge_pass is True and gc.judge_error is not None]
    if (lat_max := policy.max_case_latency_s) is not None:
        for r in candidate:
            where = f"(case {r.case_id}, trial {r.trial})"
            lat = r.latency_s
            if lat is None or not math.isfinite(lat):
                out.append(f"candidate: latency unknown under a latency ceiling {where}")
            elif lat > lat_max:
                out.append(f"candidate: latency {lat:g}s exceeds ceiling {lat_max:g}s {where}")
    if (cost_max := policy.max_total_cost_usd) is not None:
        # Unknown costs were ruled invalid above, so every cost here is known.
        total = sum(t.cost_usd or 0.0 for t in cand_totals.values())
        if total > cost_max:
            out.append(f"candidate: total cost ${total:.4f} exceeds ceiling ${cost_max:.4f}")
    if policy.require_improvement:
        # a baseline the scorer or judge could not grade failed nothing the candidate fixed
        failed = [k for k, (b, _) in pairs.items()
                  if not b.passed(policy.criteria) and not b.ungraded]
        if not any(pairs[k][1].passed(policy.criteria) for k in failed):
            out.append(f"no improvement: none of the {len(failed)} (case, trial) pairs failing "
                       "on baseline passes on candidate")
    return out


def _policy_problems(policy: ComparisonPolicy) -> list[tuple[str, str]]:
    """(field, problem) for each way the policy cannot be applied soundly."""
    out: list[tuple[str, str]] = []
    if not policy.cases:
        out.append(("cases", "is empty, so nothing would be compared"))
    if dup := sorted(c for c, n in Counter(policy.cases).items() if n > 1):
        out.append(("cases", f"lists {', '.join(dup)} more than once"))
    if stray := sorted(set(policy.mandatory) - set(policy.cases)):
        out.append(("mandatory", f"names cases that are not compared: {', '.join(stray)}"))
    for name, v in (("max_case_latency_s", policy.max_case_latency_s),
                    ("max_total_cost_usd", policy.max_total_cost_usd)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            out.append((name, f"must be a finite number >= 0, got {v!r}"))
    return out


def _pairs(baseline: Sequence[Record], candidate: Sequence[Record],
           policy: ComparisonPolicy) -> Pairs:
    """Graded (case, trial) pairs present exactly once on each side and in the policy."""
    def single(recs: Sequence[Record]) -> dict[Key, Grades]:
        counts = Counter((r.case_id, r.trial) for r in recs)
        return {(r.case_id, r.trial): r.grades for r in recs
                if r.grades is not None and counts[(r.case_id, r.trial)] == 1}
    b, c = single(baseline), single(candidate)
    expected = {(case, t) for case in policy.cases for t in range(policy.trials)}
    return {k: (b[k], c[k]) for k in sorted(expected & b.keys() & c.keys())}


def _changes(pairs: Pairs, criteria: Sequence[str], *, before: bool) -> tuple[CaseChange, ...]:
    return tuple(
        CaseChange(case_id=case, trial=trial, criterion=crit, baseline=before, candidate=not before)
        for (case, trial), (b, c) in pairs.items() for crit in criteria
        if getattr(b, crit) is before and getattr(c, crit) is (not before))


def _statistics(pairs: Pairs, criteria: Sequence[str]) -> dict[str, object]:
    both = {k: v for k, v in pairs.items() if not v[0].ungraded and not v[1].ungraded}
    pairs = both  # pairs either side could not grade tell neither way
    b = sum(1 for gb, gc in pairs.values() if gb.passed(criteria) and not gc.passed(criteria))
    c = sum(1 for gb, gc in pairs.values() if not gb.passed(criteria) and gc.passed(criteria))
    return {"method": "exact McNemar, two-sided, on per-(case, trial) pass/fail; b = baseline "
                      "pass & candidate fail, c = baseline fail & candidate pass",
            "pairs": len(pairs), "b": b, "c": c, "p_value": mcnemar_p(b, c), "note": _NOTE}


def _usage_totals(records: Sequence[Record]) -> dict[str, _RoleTotals]:
    out: dict[str, _RoleTotals] = {}
    for r in records:
        for role, u in r.usage.items():
            t = out.setdefault(role, _RoleTotals())
            calls, tokens, cost = _count(u.get("calls")), _count(u.get("tokens")), u.get("cost_usd")
            t.calls += calls or 0
            t.tokens += tokens or 0
            if (not isinstance(cost, int | float) or isinstance(cost, bool)
                    or not (math.isfinite(cost) and cost >= 0)):
                t.cost_usd = None  # unknown, non-finite or negative: never counted as cheap
            elif t.cost_usd is not None:
                t.cost_usd += cost
            t.complete = t.complete and u.get("complete") is True and None not in (calls, tokens)
    return out


def _count(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def load_records(path: Path) -> list[Record]:
    """Read JSON Lines records; a bad line raises ConfigError naming file, line and field."""
    return load_lines(path, Record, what="records file", max_bytes=RECORDS_MAX_BYTES,
                      fix="a records.jsonl written by a cycle stage: one Record object per "
                          "line (runner/cycle/models.py), no NaN/Infinity")


def load_policy(path: Path) -> ComparisonPolicy:
    """Read a comparison policy from .yaml/.yml or .json; ConfigError names file and field."""
    fix = "`cyclebox schema policy` lists the accepted keys"
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"unsupported suffix {show(path.suffix)}", path=show(str(path)),
                          fix="name the policy *.yaml, *.yml or *.json")
    policy = load_model(path, ComparisonPolicy, what="comparison policy", schema=POLICY_SCHEMA,
                        fix=fix)
    if problems := _policy_problems(policy):
        field, problem = problems[0]
        raise ConfigError(problem, path=show(str(path)), field=field, fix=fix)
    return policy


def compare_files(baseline: Path, candidate: Path, policy: Path, out_dir: Path
                  ) -> ComparisonResult:
    """``cyclebox compare``: load both record sets and the policy, compare, and write
    ``out_dir/verdict.json`` into a fresh directory (an existing one is refused before any
    work; the directory is removed again if the write fails)."""
    from runner.outdir import make_fresh_dir, refuse_existing, remove_created

    refuse_existing(out_dir)
    result = compare(load_records(baseline), load_records(candidate), load_policy(policy))
    created = make_fresh_dir(out_dir)
    try:
        (out_dir / "verdict.json").write_text(result.model_dump_json(indent=1))
    except BaseException:
        remove_created(created)
        raise
    return result
