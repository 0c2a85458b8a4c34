"""Assemble a Report from a run directory's files (pure over those files; no clock, no IO
beyond bounded reads)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runner.cycle.models import RECORDS_MAX_BYTES, Grades, Record
from runner.errors import CycleboxError, OutputRejected
from runner.gateway.calllog import CallRecord
from runner.gateway.report import summarize
from runner.report import readfs
from runner.report.model import (
    Arm,
    Attempt,
    CaseRow,
    Change,
    PassRate,
    Report,
    RoleCost,
    Statistics,
)

MAX_TEXT = 2000
"""Cap on one answer or reason string kept in the report."""
MAX_PATCH = 256 * 1024
EXIT = {"accept_for_review": 0, "reject": 1, "invalid_comparison": 2}
ARMS: tuple[Arm, ...] = ("baseline", "candidate")


def cap(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[:limit] + f"… [{len(text) - limit} more chars]"


class _Reader:
    """Bounded reads that record problems instead of stopping the report."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.problems: list[str] = []

    def _try(self, fn: Any, rel: str) -> Any:
        try:
            return fn(self.root, rel)
        except (CycleboxError, OSError, ValueError) as exc:
            self.problems.append(cap(f"{rel}: {exc}", 500))
            return None

    def json(self, rel: str) -> Any:
        return self._try(readfs.read_json, rel)

    def json_object(self, rel: str) -> dict[str, Any] | None:
        """A JSON object, or None with a problem naming the file when it is valid JSON of
        another kind (a list, a string, a number)."""
        known = len(self.problems)
        doc = self.json(rel)
        if isinstance(doc, dict):
            return doc
        if len(self.problems) > known:  # unreadable: that problem is named already
            return None
        self.problems.append(f"{rel}: expected a JSON object, found a {_kind(doc)}; "
                             "the file is not what cyclebox wrote")
        return None

    def jsonl(self, rel: str, cap: int = readfs.MAX_FILE) -> list[Any]:
        return self._try(lambda root, r: readfs.read_jsonl(root, r, cap), rel) or []

    def is_file(self, rel: str) -> bool:
        """Whether ``rel`` is a regular file; what stops it being read is a problem."""
        return bool(self._try(readfs.is_file, rel))

    def raw(self, rel: str, limit: int, *, head: bool = False) -> bytes | None:
        data: bytes | None = self._try(lambda r, p: readfs.read_bytes(r, p, limit, head=head),
                                       rel)
        return data


def _kind(doc: Any) -> str:
    names = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if doc is None else names.get(type(doc), type(doc).__name__)


def _answer_text(answer: dict[str, object] | None) -> str | None:
    if answer is None:
        return None
    value = answer.get("answer", answer)
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                           sort_keys=True)
    if answer.get("refused") is True:
        text = "(refused)" if value is None else f"(refused) {text}"
    return cap(text)


GRADE_FIELDS = frozenset(Grades.model_fields)
"""What a policy's criteria may name (a grade of every record)."""


def _names(policy: dict[str, Any], key: str, rd: _Reader) -> tuple[str, ...]:
    """``policy[key]`` as a list of strings; anything else a problem (the run directory
    may have been edited), read as empty rather than crashing the report."""
    value = policy.get(key)
    if value is None:
        return ()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    rd.problems.append(f"plan.json: policy.{key} is not a list of names")
    return ()


def _attempt(r: Record, criteria: tuple[str, ...], stage: str, rd: _Reader) -> Attempt:
    failed: tuple[str, ...] = ()
    if r.status != "ok":
        passed = False
    elif r.grades is None:
        passed, failed = False, ("ungraded",)
    else:
        names = (*criteria, "judge_pass")
        failed = tuple(c for c in names if getattr(r.grades, c) is False)
        if r.grades.judge_error is not None:  # no verdict is not a pass (Grades.passed)
            failed += ("judge_error",)
        passed = not failed
    base = f"stages/{stage}/cases/{r.case_id}__t{r.trial}"
    logs = tuple(rel for rel in (f"{base}/logs/analyst-{r.case_id}-t{r.trial}.stdout",
                                 f"{base}/logs/analyst-{r.case_id}-t{r.trial}.stderr",
                                 f"{base}/out/answer.json")
                 if rd.is_file(rel))
    return Attempt(trial=r.trial, status=r.status,
                   reason=None if r.reason is None else cap(r.reason), passed=passed,
                   failed_criteria=failed,
                   grades=None if r.grades is None else r.grades.model_dump(),
                   answer=_answer_text(r.answer), latency_s=r.latency_s, logs=logs)


def _records(rd: _Reader, arm: Arm) -> list[Record]:
    rel = f"stages/{arm}/records.jsonl"
    out = []
    for i, row in enumerate(rd.jsonl(rel, RECORDS_MAX_BYTES)):
        try:
            out.append(Record.model_validate(row))
        except ValidationError as exc:
            rd.problems.append(f"{rel}:{i + 1}: not a record ({exc.error_count()} errors)")
    return out


def pass_rates(rows: Iterable[tuple[Arm, str, Attempt]]) -> tuple[PassRate, ...]:
    """Per (arm, split): rows, ok, passed and rate, in arm then split order."""
    acc: dict[tuple[Arm, str], list[int]] = {}
    for arm, split, a in rows:
        n = acc.setdefault((arm, split), [0, 0, 0])
        n[0] += 1
        n[1] += a.status == "ok"
        n[2] += a.passed
    return tuple(PassRate(arm=arm, split=split, rows=n[0], ok=n[1], passed=n[2],
                          rate=round(n[2] / n[0], 4) if n[0] else None)
                 for (arm, split), n in sorted(acc.items(), key=lambda kv: (
                     ARMS.index(kv[0][0]), kv[0][1])))


CALL_LOG = "gateway/calls.jsonl"


def _costs(rd: _Reader) -> tuple[tuple[RoleCost, ...], bool]:
    calls = []
    for i, row in enumerate(rd.jsonl(CALL_LOG)):
        try:
            calls.append(CallRecord.model_validate(row))
        except ValidationError:
            rd.problems.append(f"gateway/calls.jsonl:{i + 1}: not a call record")
    totals = summarize(calls)
    rows = [RoleCost(role=role, **v.model_dump()) for role, v in totals.per_role.items()]
    rows.append(RoleCost(role="total", **totals.total.model_dump()))
    return tuple(rows), any(c.fixture for c in calls)


def _changes(raw: Any) -> tuple[Change, ...]:
    if not isinstance(raw, list):
        return ()
    out = []
    for c in raw:
        try:
            out.append(Change.model_validate(c))
        except ValidationError:
            continue
    return tuple(out)


def _timing(timing: Any, problems: list[str]) -> dict[str, float]:
    """The receipt's stage timings that are finite numbers of seconds; others noted."""
    out: dict[str, float] = {}
    if not isinstance(timing, dict):
        return out
    for k, t in timing.items():
        if isinstance(t, bool) or not isinstance(t, int | float):
            continue
        try:
            f = float(t)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            problems.append(cap(f"receipt.json: timing {str(k)!r} is not a finite number", 200))
            continue
        out[str(k)] = f
    return out


REPORT_VERIFY_BYTES = 2 << 30
"""Most bytes of files a report hashes to check the run against its receipt: a larger
run (or one a sparse file of terabytes was planted in) is shown as not checked, and
``cyclebox receipt verify`` checks it, however long it takes."""


def _verified(run_dir: Path, problems: list[str]) -> bool | None:
    """Whether the run directory is what its receipt binds (``receipt verify``, the data
    stores outside it aside): a report shows the receipt's hash beside the outcome only as
    binding when it is; otherwise the first problems are noted. None: not checked (more
    than :data:`REPORT_VERIFY_BYTES` to hash)."""
    from runner import fswalk
    from runner.cycle.receipt import verify

    total = 0
    try:
        for e in fswalk.walk(run_dir, max_depth=64, max_entries=1_000_000):
            if e.is_file:
                total += e.st.st_size
    except fswalk.WalkError as exc:
        problems.append(cap(f"receipt: does not verify: {exc}", 500))
        return False
    if total > REPORT_VERIFY_BYTES:
        problems.append(f"receipt: not checked here: the run directory holds {total} bytes, "
                        f"more than a report hashes ({REPORT_VERIFY_BYTES}); `cyclebox "
                        "receipt verify` checks it")
        return None
    try:
        found = verify(run_dir, external=False)
    except CycleboxError as exc:
        found = [str(exc)]
    problems += [cap(f"receipt: does not verify: {x}", 500) for x in found[:5]]
    if len(found) > 5:
        problems.append(f"receipt: and {len(found) - 5} more problems (cyclebox receipt "
                        "verify names them all)")
    return not found


def build_report(run_dir: Path, *, verified: bool | None = None) -> Report:
    """The report of one run directory; raises OutputRejected when it is not one.
    ``verified``: the caller verified the run against its receipt just before (attest),
    so the report does not hash it again."""
    hint = "pass a directory written by `cyclebox cycle run --out DIR`"
    try:
        found = readfs.is_file(run_dir, "plan.json")
    except OutputRejected as exc:
        raise OutputRejected(f"{exc} (plan.json); {hint}") from None
    if not found:
        raise OutputRejected(f"{run_dir}: no plan.json (a regular file); {hint}")
    rd = _Reader(run_dir)
    doc = rd.json_object("plan.json")
    raw_plan = doc.get("plan", {}) if isinstance(doc, dict) else {}
    plan: dict[str, Any] = raw_plan if isinstance(raw_plan, dict) else {}
    if not isinstance(raw_plan, dict):
        rd.problems.append("plan.json: plan is not an object")
    plan_hash = doc.get("plan_hash") if isinstance(doc, dict) else None
    if plan_hash is not None and not isinstance(plan_hash, str):
        rd.problems.append("plan.json: plan_hash is not a string")
        plan_hash = None
    raw_policy = plan.get("policy")
    policy: dict[str, Any] = raw_policy if isinstance(raw_policy, dict) else {}
    named = _names(policy, "criteria", rd)
    criteria = tuple(c for c in named if c in GRADE_FIELDS)
    if len(criteria) != len(named):
        rd.problems.append("plan.json: policy.criteria names what no grade has "
                           f"(grades: {', '.join(sorted(GRADE_FIELDS))})")
    compared = set(_names(policy, "cases", rd))
    mandatory = set(_names(policy, "mandatory", rd))

    by_case: dict[str, dict[str, Any]] = {}
    flat: list[tuple[Arm, str, Attempt]] = []
    for arm in ARMS:
        for r in _records(rd, arm):
            a = _attempt(r, criteria, arm, rd)
            row = by_case.setdefault(r.case_id, {"split": r.split, "baseline": [],
                                                 "candidate": []})
            row[arm].append(a)
            flat.append((arm, r.split, a))
    cases = tuple(CaseRow(case_id=cid, split=v["split"], mandatory=cid in mandatory,
                          compared=cid in compared,
                          baseline=tuple(sorted(v["baseline"], key=lambda a: a.trial)),
                          candidate=tuple(sorted(v["candidate"], key=lambda a: a.trial)))
                  for cid, v in by_case.items())

    v: dict[str, Any] = rd.json_object("stages/compare/verdict.json") or {}
    verdict = str(v.get("verdict", "incomplete"))
    if verdict not in EXIT:
        if "verdict" in v:
            rd.problems.append(cap(f"stages/compare/verdict.json: unknown verdict "
                                   f"{v['verdict']!r}", 500))
        verdict = "incomplete"
    stats = None
    if isinstance(v.get("statistics"), dict):
        try:
            stats = Statistics.model_validate(v["statistics"])
        except ValidationError:
            rd.problems.append("stages/compare/verdict.json: statistics unreadable")
    costs, fixture = _costs(rd)
    receipt = rd.raw("receipt.json", readfs.MAX_FILE)
    patch = rd.raw("stages/apply/candidate.patch", MAX_PATCH, head=True)
    receipt_doc = rd.json_object("receipt.json") if receipt is not None else None
    bound = receipt_doc.get("files") if isinstance(receipt_doc, dict) else None
    if isinstance(bound, dict) and CALL_LOG in bound and not rd.is_file(CALL_LOG):
        # no log is "no calls" only when the receipt recorded none
        rd.problems.append(f"{CALL_LOG}: missing; the run's receipt recorded it, so the "
                           "costs shown are not the run's")
        costs = tuple(c.model_copy(update={"complete": False, "cost_usd": None})
                      for c in costs)
    timing = receipt_doc.get("timing") if isinstance(receipt_doc, dict) else None
    reasons = v.get("reasons") if isinstance(v.get("reasons"), list) else []
    trials = plan.get("trials")
    return Report(
        run_dir=str(run_dir), name=str(plan["name"]) if "name" in plan else None,
        plan_hash=plan_hash,
        verdict=verdict, exit_code=EXIT.get(verdict, 2),
        reasons=tuple(cap(str(r)) for r in (reasons or [])),
        trials=trials if isinstance(trials, int) else None, criteria=criteria,
        pass_rates=pass_rates(flat), cases=cases,
        improved=_changes(v.get("improvements")), regressed=_changes(v.get("regressions")),
        costs=costs, fixture=fixture, statistics=stats,
        receipt_sha256=None if receipt is None else hashlib.sha256(receipt).hexdigest(),
        receipt_verified=None if receipt is None else (
            verified if verified is not None else _verified(run_dir, rd.problems)),
        patch=None if patch is None else patch[:MAX_PATCH].decode("utf-8", "replace"),
        patch_truncated=patch is not None and len(patch) > MAX_PATCH,
        timing=_timing(timing, rd.problems),
        problems=tuple(rd.problems))
