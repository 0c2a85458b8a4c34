"""compare returns one verdict with every reason of its class; loaders name file, line, field."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from runner.cycle.compare import EXIT_CODES, compare, load_policy, load_records, mcnemar_p
from runner.cycle.models import CaseChange, ComparisonPolicy, Grades, Identities, Record
from runner.errors import ConfigError

IDS = Identities(data_hash="d" * 64, reference_hash="r" * 64, scorer="scorer-1")
CASES = ("q1", "q2", "q3")
Sides = tuple[list[Record], list[Record], ComparisonPolicy]


def usage(cost: float | None = 0.01, *, complete: bool = True) -> dict[str, object]:
    return {"calls": 2, "tokens": 300, "cost_usd": cost, "complete": complete}


def rec(case: str, trial: int = 0, *, ok: bool = True, **kw: Any) -> Record:
    """One graded record: correctness and evidence both pass (ok) or both fail."""
    fields: dict[str, Any] = {
        "case_id": case, "trial": trial, "split": "acceptance", "status": "ok",
        "grades": Grades(correctness=ok, evidence=ok), "latency_s": 1.0,
        "usage": {"analyst": usage()}, "identities": IDS}
    return Record(**{**fields, **kw})


def side(fail: Iterable[tuple[str, int]] = (), *, cases: Iterable[str] = CASES,
         trials: int = 1) -> list[Record]:
    failing = set(fail)
    return [rec(c, t, ok=(c, t) not in failing) for c in cases for t in range(trials)]


def policy(**kw: Any) -> ComparisonPolicy:
    return ComparisonPolicy(**{"schema": 1, "cases": CASES, "trials": 1, "identities": IDS, **kw})


def swap(records: list[Record], case: str, trial: int = 0, **update: Any) -> list[Record]:
    """Replace the fields of one (case, trial) record."""
    return [r.model_copy(update=update) if (r.case_id, r.trial) == (case, trial) else r
            for r in records]


def standard() -> Sides:
    """Baseline fails q3; candidate passes everything: an acceptable improvement."""
    return side([("q3", 0)]), side(), policy()


def test_accept_lists_improvements_and_usage() -> None:
    res = compare(*standard())
    assert (res.verdict, res.reasons, res.regressions) == ("accept_for_review", (), ())
    assert res.improvements == (
        CaseChange(case_id="q3", trial=0, criterion="correctness", baseline=False, candidate=True),
        CaseChange(case_id="q3", trial=0, criterion="evidence", baseline=False, candidate=True))
    assert res.usage["candidate"]["analyst"] == {
        "calls": 6, "tokens": 900, "cost_usd": pytest.approx(0.03), "complete": True}
    assert res.statistics is None
    assert EXIT_CODES[res.verdict] == 0


def _judged(records: list[Record]) -> list[Record]:
    return [r.model_copy(update={"grades": Grades(correctness=True, evidence=True,
                                                  judge_score=0.9, judge_pass=True)})
            for r in records]


INVALID: list[tuple[str, Callable[[], Sides], str]] = [
    ("missing trial", lambda: (side(trials=2), side(trials=2)[:-1], policy(trials=2)),
     "candidate: missing (case q3, trial 1)"),
    ("duplicated trial", lambda: (side(), [*side(), rec("q2")], policy()),
     "candidate: duplicated (case q2, trial 0): 2 records"),
    ("extra case", lambda: (side(), [*side(), rec("q9")], policy()),
     "candidate: extra (case q9, trial 0) outside policy cases x trials"),
    ("data store changed",
     lambda: (side(), swap(side(), "q1", identities=IDS.model_copy(update={"data_hash": "e"})),
              policy()),
     f"candidate: data_hash differs from policy (case q1, trial 0): expected '{'d' * 64}', "
     "got 'e'"),
    ("reference mismatch",
     lambda: (swap(side(), "q2", identities=IDS.model_copy(update={"reference_hash": "x"})),
              side(), policy()),
     "baseline: reference_hash differs from policy (case q2, trial 0)"),
    ("scorer mismatch",
     lambda: (side(), swap(side(), "q3", identities=IDS.model_copy(update={"scorer": "s2"})),
              policy()),
     "candidate: scorer differs from policy (case q3, trial 0): expected 'scorer-1', got 's2'"),
    ("unknown cost under ceiling",
     lambda: (side(), swap(side(), "q1", usage={"analyst": usage(None)}),
              policy(max_total_cost_usd=1.0)),
     "candidate: unknown cost under a cost ceiling (role analyst: cost_usd unknown)"),
    ("incomplete usage under ceiling",
     lambda: (swap(side(), "q1", usage={"worker": usage(complete=False)}), side(),
              policy(max_total_cost_usd=1.0)),
     "baseline: unknown cost under a cost ceiling (role worker: usage incomplete)"),
    ("failed required judge",
     lambda: (_judged(side()),
              swap(_judged(side()), "q2", grades=Grades(correctness=True, evidence=True,
                                                        judge_error="budget exhausted")),
              policy(require_judge=True)),
     "candidate: required judge failed or could not be funded (case q2, trial 0): "
     "budget exhausted"),
    ("not attempted (budget)",
     lambda: (side(), swap(side(), "q3", status="not_attempted", reason="budget", grades=None),
              policy()),
     "candidate: not_attempted (case q3, trial 0): budget"),
    ("infra invalid",
     lambda: (swap(side(), "q1", status="infra_invalid", reason="timeout", grades=None), side(),
              policy()),
     "baseline: infra_invalid (case q1, trial 0): timeout"),
    ("mandatory case not compared", lambda: (side(), side(), policy(mandatory=("q9",))),
     "policy: mandatory: names cases that are not compared: q9"),
]


@pytest.mark.parametrize(("build", "reason"), [(b, r) for _, b, r in INVALID],
                         ids=[name for name, _, _ in INVALID])
def test_invalid_comparison(build: Callable[[], Sides], reason: str) -> None:
    res = compare(*build())
    assert res.verdict == "invalid_comparison"
    assert any(r.startswith(reason) for r in res.reasons), res.reasons
    assert EXIT_CODES[res.verdict] == 2


def test_invalid_collects_every_reason_on_both_sides() -> None:
    base = side()[1:]
    cand = swap(side(), "q2", status="not_attempted", reason="budget", grades=None)
    assert compare(base, cand, policy()).reasons == (
        "baseline: missing (case q1, trial 0)",
        "candidate: not_attempted (case q2, trial 0): budget")


def test_reject_mandatory_case_failing() -> None:
    base, _, pol = standard()
    res = compare(base, side([("q1", 0)]), pol.model_copy(update={"mandatory": ("q1",)}))
    assert res.verdict == "reject"
    assert res.reasons[:2] == ("candidate: mandatory case q1 failed correctness (trial 0)",
                               "candidate: mandatory case q1 failed evidence (trial 0)")
    assert EXIT_CODES[res.verdict] == 1


def test_reject_per_criterion_regression() -> None:
    base, cand, pol = standard()
    cand = swap(cand, "q2", grades=Grades(correctness=True, evidence=False))
    res = compare(base, cand, pol)
    assert res.verdict == "reject"
    assert res.reasons == (
        "regression: evidence passed on baseline, failed on candidate (case q2, trial 0)",)
    assert res.regressions == (CaseChange(case_id="q2", trial=0, criterion="evidence",
                                          baseline=True, candidate=False),)


def test_regression_outside_policy_criteria_is_not_rejected() -> None:
    base, cand, _ = standard()
    cand = swap(cand, "q2", grades=Grades(correctness=True, evidence=False))
    assert compare(base, cand, policy(criteria=("correctness",))).verdict == "accept_for_review"


def test_reject_latency_ceiling_including_unknown_latency() -> None:
    base, cand, _ = standard()
    cand = swap(swap(cand, "q2", latency_s=9.5), "q3", latency_s=None)
    res = compare(base, cand, policy(max_case_latency_s=5))
    assert res.reasons == (
        "candidate: latency 9.5s exceeds ceiling 5s (case q2, trial 0)",
        "candidate: latency unknown under a latency ceiling (case q3, trial 0)")


def test_reject_cost_ceiling() -> None:
    base, cand, _ = standard()
    res = compare(base, cand, policy(max_total_cost_usd=0.025))
    assert res.verdict == "reject"
    assert res.reasons == ("candidate: total cost $0.0300 exceeds ceiling $0.0250",)
    assert compare(base, cand, policy(max_total_cost_usd=0.05)).verdict == "accept_for_review"


def test_reject_no_improvement_when_required() -> None:
    base = side([("q3", 0)])
    res = compare(base, base, policy())
    assert res.reasons == ("no improvement: none of the 1 (case, trial) pairs failing on "
                           "baseline passes on candidate",)
    assert compare(base, base, policy(require_improvement=False)).verdict == "accept_for_review"


def test_invalid_outranks_reject() -> None:
    base, _, pol = standard()
    cand = swap(side(), "q1", grades=Grades(correctness=False, evidence=True))[:-1]
    res = compare(base, cand, pol)
    assert res.verdict == "invalid_comparison"
    assert res.reasons == ("candidate: missing (case q3, trial 0)",)
    assert [c.criterion for c in res.regressions] == ["correctness"]  # still reported


def test_nan_ceiling_is_invalid_not_silently_passed() -> None:
    res = compare(*standard()[:2], policy(max_case_latency_s=float("nan")))
    assert res.verdict == "invalid_comparison"
    assert res.reasons[0].startswith("policy: max_case_latency_s: must be a finite number")


@pytest.mark.parametrize(("b", "c", "p"), [(1, 6, 0.125), (6, 1, 0.125), (0, 0, 1.0),
                                           (0, 5, 0.0625), (3, 3, 1.0)])
def test_mcnemar_exact_p(b: int, c: int, p: float) -> None:
    assert mcnemar_p(b, c) == pytest.approx(p)


def test_statistics_with_trials_never_change_verdict() -> None:
    cases = ("q1", "q2", "q3", "q4")
    # b = 1 (q1/0 regresses), c = 6 (six baseline failures pass), one pair passes on both.
    passing = {("q1", 0), ("q2", 0)}
    base = side([(c, t) for c in cases for t in (0, 1) if (c, t) not in passing],
                cases=cases, trials=2)
    cand = side([("q1", 0)], cases=cases, trials=2)
    res = compare(base, cand, policy(cases=cases, trials=2))
    assert res.statistics is not None
    assert (res.statistics["b"], res.statistics["c"], res.statistics["pairs"]) == (1, 6, 8)
    assert res.statistics["p_value"] == pytest.approx(0.125)
    assert "never change" in str(res.statistics["note"])
    assert res.verdict == "reject"  # the regression decides, not p


def test_statistics_none_with_one_trial() -> None:
    assert compare(*standard()).statistics is None


def test_load_records_round_trip_and_errors_name_file_and_line(tmp_path: Path) -> None:
    good = tmp_path / "records.jsonl"
    good.write_text("".join(r.model_dump_json() + "\n" for r in side()))
    assert load_records(good) == side()
    bad = json.loads(rec("q1").model_dump_json())
    bad["trial"] = -1
    path = tmp_path / "bad.jsonl"
    path.write_text(rec("q1").model_dump_json() + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: trial: Input should be greater"):
        load_records(path)
    path.write_text(rec("q1").model_dump_json().replace('"latency_s":1.0', '"latency_s":NaN'))
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: .*NaN is not valid JSON"):
        load_records(path)


def test_load_policy_reads_yaml_and_json_and_names_field(tmp_path: Path) -> None:
    y = tmp_path / "policy.yaml"
    y.write_text("schema: 1\ncases: [q1, q2]\ntrials: 3\nmandatory: [q1]\n")
    assert load_policy(y).trials == 3
    j = tmp_path / "policy.json"
    j.write_text(json.dumps({"schema": 1, "cases": ["q1"], "trials": 1}))
    assert load_policy(j).cases == ("q1",)
    y.write_text("schema: 1\ncases: [q1]\ntrials: 0\n")
    with pytest.raises(ConfigError, match=r"policy\.yaml: trials: Input should be greater"):
        load_policy(y)
    y.write_text("schema: 1\ncases: [q1]\ntrials: 1\nmax_cost: 3\n")
    with pytest.raises(ConfigError, match=r"policy\.yaml: max_cost: Extra inputs"):
        load_policy(y)
    y.write_text("schema: 1\ncases: [q1]\ntrials: 1\nmandatory: [q2]\n")
    with pytest.raises(ConfigError, match=r"policy\.yaml: mandatory: names cases"):
        load_policy(y)


def test_load_policy_json_rejects_nan(tmp_path: Path) -> None:
    j = tmp_path / "policy.json"
    j.write_text('{"schema": 1, "cases": ["q1"], "trials": 1, "max_case_latency_s": NaN}')
    with pytest.raises(ConfigError, match=r"policy\.json: invalid JSON: NaN is not valid JSON"):
        load_policy(j)


# -- a judge that gave no verdict, criteria, identities (helper-44) ---------------------------
def _judge_failed(r: Record) -> Record:
    assert r.grades is not None
    return r.model_copy(update={"grades": r.grades.model_copy(update={
        "judge_score": None, "judge_pass": None, "judge_error": "JSONDecodeError: prose"})})


def test_a_judge_failure_never_passes_for_the_candidate() -> None:
    """An answer that makes the judge fail (prose instead of JSON) must not escape it:
    a case the baseline's judge passed regresses, a mandatory case fails, and a baseline
    failure 'fixed' only by a judge error is no improvement."""
    base = _judged(side())
    cand = [_judge_failed(r) if r.case_id == "q1" else r for r in _judged(side())]
    res = compare(base, cand, policy(require_improvement=False))
    assert res.verdict == "reject"
    assert any("judge_pass passed on baseline, no judge verdict on candidate (case q1"
               in r for r in res.reasons), res.reasons
    res = compare(base, cand, policy(require_improvement=False, mandatory=("q1",)))
    assert any("mandatory case q1 has no judge verdict" in r for r in res.reasons), res.reasons
    # baseline's judge failed q2; the candidate's judge errs on q2: no improvement
    base2 = swap(base, "q2", grades=Grades(correctness=True, evidence=True, judge_score=0.1,
                                           judge_pass=False))
    cand2 = [_judge_failed(r) if r.case_id == "q2" else r for r in _judged(side())]
    res = compare(base2, cand2, policy())
    assert res.verdict == "reject"
    assert any(r.startswith("no improvement") for r in res.reasons), res.reasons
    assert not Grades(correctness=True, judge_error="x").passed()


def test_improvement_is_judged_on_the_policys_criteria() -> None:
    """criteria [correctness]: fixing only evidence is not an improvement."""
    base = swap(side(), "q3", grades=Grades(correctness=True, evidence=False))
    res = compare(base, side(), policy(criteria=("correctness",)))
    assert res.verdict == "reject"
    assert any(r.startswith("no improvement") for r in res.reasons), res.reasons


def test_without_policy_identities_the_sides_must_share_one() -> None:
    """A standalone compare whose policy names no identities: a candidate graded by
    another scorer (or judge) than the baseline is invalid, never compared."""
    other = IDS.model_copy(update={"scorer": "lax-scorer"})
    cand = [r.model_copy(update={"identities": other}) for r in side()]
    res = compare(side([("q3", 0)]), cand, policy(identities=None))
    assert res.verdict == "invalid_comparison"
    assert any("scorer differs from baseline" in r for r in res.reasons), res.reasons
    assert compare(side([("q3", 0)]), side(), policy(identities=None)).verdict == \
        "accept_for_review"


def test_reasons_are_bounded_printable_lines() -> None:
    """helper-47 #1, #5: a megabyte identity copied into a reason per record made a
    1 MB input a 199 MB verdict; a judge error with newlines forged a verdict line."""
    from runner.cycle.compare import MAX_REASON_CHARS, MAX_REASONS
    huge = IDS.model_copy(update={"data_hash": "d" * 1_000_000})
    base = [rec(f"c{i}") for i in range(1500)]
    base[0] = base[0].model_copy(update={"identities": huge})
    cases = tuple(f"c{i}" for i in range(1500))
    res = compare(base, [rec(c) for c in cases], policy(cases=cases, identities=None))
    assert res.verdict == "invalid_comparison"
    assert len(res.reasons) == MAX_REASONS + 1 and res.reasons[-1].startswith("... and ")
    assert max(map(len, res.reasons)) <= MAX_REASON_CHARS + 1
    forged = "boom\naccept_for_review\n\x1b]0;t\x07" + "Z" * 100_000
    cand = [_judge_failed(r) for r in _judged(side())]
    cand = [r.model_copy(update={"grades": r.grades.model_copy(update={  # type: ignore[union-attr]
        "judge_error": forged})}) for r in cand]
    res = compare(_judged(side()), cand, policy(require_judge=True))
    assert res.verdict == "invalid_comparison"
    assert all("\n" not in r and "\x1b" not in r and len(r) <= MAX_REASON_CHARS + 1
               for r in res.reasons), res.reasons


def test_a_baseline_the_judge_could_not_grade_is_no_improvement() -> None:
    """helper-47 #2: a baseline judge error (a timeout) 'fixed' by the candidate passed
    require_improvement with no improvement listed, and counted in McNemar's c."""
    base = [_judge_failed(r) if r.case_id == "q1" else r for r in _judged(side())]
    res = compare(base, _judged(side()), policy())
    assert res.verdict == "reject"
    assert any(r.startswith("no improvement") for r in res.reasons), res.reasons
    base2 = [r.model_copy(update={"trial": t}) for t in (0, 1) for r in base]
    cand2 = [r.model_copy(update={"trial": t}) for t in (0, 1) for r in _judged(side())]
    res = compare(base2, cand2, policy(trials=2, require_improvement=False))
    assert res.statistics is not None and res.statistics["c"] == 0
    assert res.statistics["pairs"] == 4  # the two judge-error pairs tell neither way


def test_a_mandatory_case_is_judged_on_the_policys_criteria() -> None:
    """helper-47 #7a: criteria [correctness, refusal]; a mandatory case failing only
    evidence passes, as it does everywhere else."""
    cand = swap(side(), "q1", grades=Grades(correctness=True, evidence=False))
    res = compare(side([("q3", 0)]), cand,
                  policy(criteria=("correctness", "refusal"), mandatory=("q1",)))
    assert res.verdict == "accept_for_review", res.reasons
