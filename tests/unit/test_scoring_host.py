"""Scorer selection in manifests, the scorer identity, the project scorer file checks and
reading grades back as hostile input (runner/cycle/models.py, runner/cycle/scoring.py),
plus the evaluator's client for a project scorer (sandbox/evaluator.py ProjectScorer).

The project scorer tests run fixture scorer files in a child process, as the evaluator
does inside its container; the host process itself never imports them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from runner.cycle import scorer_specs as specs
from runner.cycle.manifest import build_manifest, reference_hash, write_manifest
from runner.cycle.models import Grades, Identities, Manifest, Record, Reference, Scenario
from runner.cycle.plan import freeze
from runner.cycle.scoring import (
    PROJECT_SCORER_INPUT,
    apply_grades,
    evaluator_scoring,
    parse_grades,
    project_scorer_file,
    resolved_reference,
    scorer_identity,
)
from runner.errors import ConfigError
from runner.hashing import sha256_json
from runner.paths import PROJECT_ROOT
from sandbox import evaluator

EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
STORE = {"path": "s.db", "sha256": "0" * 64, "size_bytes": 0}


def manifest(refs: list[dict[str, Any]], scoring: dict[str, Any] | None = None) -> Manifest:
    scen = [Scenario.model_validate({"id": f"c{i}", "split": "development", "input": {},
                                     "reference": r, "store": "s"}) for i, r in enumerate(refs)]
    doc: dict[str, Any] = {"schema": 1, "dataset": "d", "split": "development",
                           "scenarios": [s.model_dump(mode="json") for s in scen],
                           "stores": {"s": STORE}, "reference_hash": reference_hash(scen),
                           "data_hash": "x"}
    if scoring is not None:
        doc["scoring"] = scoring
    return Manifest.model_validate(doc)


# -- schema --------------------------------------------------------------------------------
def test_legacy_references_hash_as_before() -> None:
    """Fields added for scorers stay out of a legacy reference's dump, so every manifest
    hashed before them still verifies."""
    ref = Reference(kind="number", value=3.0, evidence=("orders",))
    old_dump = {"kind": "number", "value": 3.0, "tolerance": 0.005, "evidence": ["orders"]}
    assert ref.model_dump(mode="json") == old_dump
    scen = Scenario(id="a", split="development", input={}, reference=ref, store="s")
    assert reference_hash([scen]) == sha256_json([["a", old_dump]])


def test_shop_manifest_declares_its_tables_and_still_loads() -> None:
    from runner.cycle.manifest import load_manifest

    m = load_manifest(EXAMPLE / "manifest.json", EXAMPLE / "data")
    assert m.scoring is not None
    assert set(m.scoring.evidence_vocabulary) == {"customers", "orders", "order_items",
                                                  "products"}


def test_kinds_map_to_scorers() -> None:
    m = manifest([{"kind": "number", "value": 2.0, "tolerance": 0.01},
                  {"kind": "text", "value": "Lyon"}, {"kind": "refuse"}])
    got = [resolved_reference(s.reference, m)["scorer"] for s in m.scenarios]
    assert got == [{"name": "number", "rel_tol": 0.01, "abs_tol": 0.01},
                   {"name": "normalized"}, {"name": "refusal"}]


def test_scorer_per_case_shorthand_and_default() -> None:
    m = manifest([{"scorer": "exact", "value": "x"},
                  {"value": "Lyon"},
                  {"scorer": {"name": "regex", "pattern": r"\d+"}}],
                 scoring={"default": "contains"})
    got = [resolved_reference(s.reference, m)["scorer"]["name"] for s in m.scenarios]
    assert got == ["exact", "contains", "regex"]


@pytest.mark.parametrize(("refs", "scoring", "msg"), [
    ([{"value": "x"}], None, r"scenarios\[0\].reference: no scorer"),
    ([{"value": 3.0}], {"default": "normalized"}, "needs a non-empty string value"),
    ([{"value": "x"}], {"default": "number"}, "needs a finite numeric value"),
    ([{"scorer": "project"}], None, "none is declared; add scoring.project.file"),
])
def test_manifest_refuses_a_case_without_a_usable_scorer(
        refs: list[dict[str, Any]], scoring: dict[str, Any] | None, msg: str) -> None:
    with pytest.raises(ValidationError, match=msg):
        manifest(refs, scoring)


@pytest.mark.parametrize(("ref", "msg"), [
    ({"kind": "number", "value": 1.0, "scorer": "number"}, "either kind"),
    ({"scorer": "nope"}, "does not match any of the expected tags"),
    ({"scorer": {"name": "regex", "pattern": "(("}}, "does not compile"),
    ({"scorer": {"name": "regex", "pattern": "a" * 300}}, "at most 256"),
    ({"scorer": {"name": "json_field", "path": "a..b"}, "value": 1}, "pattern"),
    ({"scorer": {"name": "number", "rel_tol": -1}, "value": 1}, "greater than or equal"),
    ({"scorer": "exact"}, "needs a value"),
    ({"scorer": "refusal", "evidence": ["--"]}, "no word characters"),
    ({"scorer": "refusal", "evidence": ["a b c d e f g h i"]}, "more than 8 words"),
    ({"scorer": "refusal", "evidence": ["x" * 65]}, "longer than 64"),
    ({"scorer": "refusal", "extra": 1}, "Extra inputs"),
])
def test_reference_refusals_name_the_problem(ref: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValidationError, match=msg):
        Reference.model_validate(ref)


def test_project_file_must_stay_relative() -> None:
    for bad in ("/abs/scorer.py", "../scorer.py", "a/../../s.py", "~/s.py", "a\\b.py"):
        with pytest.raises(ValidationError, match="relative path"):
            specs.ProjectScorerFile(file=bad)


def test_every_new_schema_field_is_described() -> None:
    new: list[type[BaseModel]] = [
        specs.ExactScorer, specs.NormalizedScorer, specs.ContainsScorer,
        specs.NumberScorer, specs.RegexScorer, specs.JsonFieldScorer,
        specs.RefusalScorer, specs.ProjectScorerRef, specs.ProjectScorerFile,
        specs.Scoring, Reference]
    for model in new:
        props = model.model_json_schema()["properties"]
        missing = [k for k, v in props.items() if not v.get("description")]
        assert not missing, f"{model.__name__}: {missing}"
    assert Manifest.model_json_schema()["properties"]["scoring"].get("description")
    assert Grades.model_json_schema()["properties"]["scorer_error"].get("description")


# -- identity ------------------------------------------------------------------------------
def test_vocabulary_is_declared_plus_required() -> None:
    m = manifest([{"kind": "number", "value": 1.0, "evidence": ["Orders", "order items"]}],
                 scoring={"evidence_vocabulary": ["customers"], "evidence_max_extra": 1})
    assert evaluator_scoring(m) == {"vocabulary": ["customers", "order items", "orders"],
                                    "max_extra": 1, "project": None}


def test_scorer_identity_covers_config_and_project_bytes() -> None:
    base = manifest([{"kind": "number", "value": 1.0}])
    ids = {scorer_identity(base, None), scorer_identity(base, "a" * 64),
           scorer_identity(base, "b" * 64),
           scorer_identity(manifest([{"kind": "number", "value": 1.0}],
                                    {"evidence_vocabulary": ["t"]}), None),
           scorer_identity(manifest([{"kind": "number", "value": 1.0}],
                                    {"evidence_max_extra": 2}), None)}
    assert len(ids) == 5
    assert scorer_identity(base, None) == scorer_identity(base, None)


# -- the project scorer file, checked without importing it -----------------------------------
GOOD = "def score(answer, reference, case):\n    return {'correctness': True}\n"


@pytest.mark.parametrize(("content", "msg"), [
    (None, "does not exist"),
    (b"\xff\xfe", "not UTF-8"),
    (b"def score(:\n", "does not parse"),
    (b"def grade(a, b, c):\n    return {}\n", "defines no top-level function score"),
    (b"def score(a, b):\n    return {}\n", "three arguments"),
    (b"x" * (256 * 1024 + 1), "the limit is 262144"),
])
def test_project_scorer_file_problems_name_the_field(tmp_path: Path, content: bytes | None,
                                                     msg: str) -> None:
    if content is not None:
        (tmp_path / "scorer.py").write_bytes(content)
    m = manifest([{"scorer": "project"}], {"project": {"file": "scorer.py"}})
    with pytest.raises(ConfigError, match=msg) as info:
        project_scorer_file(m, tmp_path / "manifest.json")
    assert info.value.field == "scoring.project.file"


def test_project_scorer_file_symlinked_out_is_refused(tmp_path: Path) -> None:
    (tmp_path / "outside.py").write_text(GOOD)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "scorer.py").symlink_to(tmp_path / "outside.py")
    m = manifest([{"scorer": "project"}], {"project": {"file": "scorer.py"}})
    with pytest.raises(ConfigError, match="resolves outside"):
        project_scorer_file(m, tmp_path / "m" / "manifest.json")


def test_project_scorer_file_is_never_imported(tmp_path: Path) -> None:
    (tmp_path / "scorer.py").write_text("raise SystemExit('imported on the host')\n" + GOOD)
    m = manifest([{"scorer": "project"}], {"project": {"file": "scorer.py"}})
    assert project_scorer_file(m, tmp_path / "manifest.json") == tmp_path / "scorer.py"


def _cycle_with_project_scorer(tmp_path: Path, scorer_src: str) -> Path:
    """The bundled example with one case scored by a project scorer file."""
    ex = tmp_path / "ex"
    shutil.copytree(EXAMPLE, ex, ignore=shutil.ignore_patterns("project"))
    m = Manifest.model_validate(json.loads((ex / "manifest.json").read_text()))
    scen = [s.model_copy(update={"reference": Reference.model_validate(
        {"scorer": {"name": "project", "options": {"unit": "EUR"}},
         "value": s.reference.value, "evidence": s.reference.evidence})})
        if s.id == "d04-customers-lyon" else s for s in m.scenarios]
    scoring = specs.Scoring(project=specs.ProjectScorerFile(file="scoring/scorer.py"),
                             evidence_vocabulary=("customers",))
    write_manifest(build_manifest(m.dataset, m.split, scen, m.stores, scoring),
                   ex / "manifest.json")
    (ex / "scoring").mkdir()
    (ex / "scoring" / "scorer.py").write_text(scorer_src)
    doc = yaml.safe_load((EXAMPLE / "cycle.yaml").read_text())
    doc["project"]["repo"] = str(PROJECT_ROOT)
    doc["roles"] = str(PROJECT_ROOT / "policies" / "roles.yaml")
    doc["data_dir"] = str(EXAMPLE / doc["data_dir"])
    doc["policy"] = str(EXAMPLE / doc["policy"])
    for up in doc["upstreams"].values():
        up["script"] = str((EXAMPLE / up["script"]).resolve())
    (ex / "cycle.yaml").write_text(yaml.safe_dump(doc))
    return ex / "cycle.yaml"


FAKE = {r: "sha256:" + "0" * 64 for r in ("analyst", "worker", "evaluator", "apply")}


def test_freeze_copies_the_project_scorer_and_binds_its_bytes(tmp_path: Path) -> None:
    cyc = _cycle_with_project_scorer(tmp_path, GOOD)
    plan, _ = freeze(cyc, tmp_path / "run1", images=FAKE)
    frozen = tmp_path / "run1" / "inputs" / PROJECT_SCORER_INPUT
    assert frozen.read_text() == GOOD and PROJECT_SCORER_INPUT in plan.inputs
    assert plan.policy.identities is not None and plan.policy.identities.scorer == plan.scorer
    (cyc.parent / "scoring" / "scorer.py").write_text(GOOD + "# edited\n")
    plan2, _ = freeze(cyc, tmp_path / "run2", images=FAKE)
    assert plan2.scorer != plan.scorer  # a scorer edit is an identity difference


def test_freeze_refuses_a_broken_project_scorer_before_writing(tmp_path: Path) -> None:
    cyc = _cycle_with_project_scorer(tmp_path, "def score(:\n")
    with pytest.raises(ConfigError, match="does not parse") as info:
        freeze(cyc, tmp_path / "run", images=FAKE)
    assert info.value.field == "scoring.project.file"
    assert not (tmp_path / "run").exists()


# -- grades from the evaluator are hostile input ---------------------------------------------
IDS = Identities(data_hash="d", reference_hash="r", scorer="s")


def rec(case: str, status: str = "ok") -> Record:
    return Record(case_id=case, trial=0, split="development", status=status,  # type: ignore[arg-type]
                  identities=IDS, answer={} if status == "ok" else None)


def line(case: str = "a", trial: Any = 0, **grades: Any) -> bytes:
    return json.dumps({"case_id": case, "trial": trial, "grades": grades}).encode() + b"\n"


def test_parse_grades_accepts_one_valid_row_per_case() -> None:
    got = parse_grades(line("a", correctness=True) + b"\n" + line("b", scorer_error="boom"),
                       {("a", 0), ("b", 0)})
    assert got[("a", 0)].correctness is True and got[("b", 0)].scorer_error == "boom"


@pytest.mark.parametrize(("raw", "msg"), [
    (b"{not json\n", "invalid JSON"),
    (b'{"case_id": "a", "trial": 0, "grades": {}, "x": 1}\n', "expected an object"),
    (line("zz", correctness=True), "unexpected"),
    (line("a", trial=True, correctness=True), "unexpected"),
    (line("a", correctness=True) + line("a", correctness=True), "graded twice"),
    (line("a", correctness="yes"), "grades.correctness"),
    (line("a", correctness=1), "grades.correctness"),
    (line("a", bonus=True), "grades.bonus"),
    (line("a", judge_score=1.5), "outside 0..1"),
    (line("a", judge_error="x" * 401), "judge_error longer"),
    (line("a", scorer_error="x" * 401), "grades.scorer_error"),
])
def test_parse_grades_refuses(raw: bytes, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        parse_grades(raw, {("a", 0)})


def test_a_scorer_error_makes_the_record_invalid_with_its_reason() -> None:
    grades = parse_grades(line("a", correctness=True) + line("b", scorer_error="raised \x1b[2J"),
                          {("a", 0), ("b", 0)})
    out = apply_grades([rec("a"), rec("b"), rec("c", "infra_invalid")], grades)
    assert [r.status for r in out] == ["ok", "infra_invalid", "infra_invalid"]
    assert out[1].reason is not None and out[1].reason.startswith("scorer_error: raised")
    assert "\x1b" not in out[1].reason
    assert out[1].grades is not None and not out[1].grades.passed()


# -- the evaluator's client for a project scorer (child process) -----------------------------
@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("PYTHONPATH", str(PROJECT_ROOT))
    made: list[evaluator.ProjectScorer] = []

    def make(src: str, timeout_s: float = 5.0) -> evaluator.ProjectScorer:
        f = tmp_path / f"scorer{len(made)}.py"
        f.write_text(src)
        p = evaluator.ProjectScorer(f, timeout_s)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


REF = {"scorer": {"name": "project", "options": {}}, "value": 4, "evidence": ["orders"]}
CFG = {"scoring": {"vocabulary": ["orders", "customers"], "max_extra": 0}, "inputs": {}}


def run(p: evaluator.ProjectScorer, answer: Any = None, case: str = "c") -> dict[str, Any]:
    ans = answer if answer is not None else {"answer": 4, "evidence": ["orders"]}
    return evaluator.grade({"case_id": case, "trial": 0, "answer": ans}, REF, CFG, p)


def test_project_scorer_decides_and_defaults_fill_the_rest(project: Any) -> None:
    p = project("import sys\nprint('noise on stdout')\n"
                "def score(answer, reference, case):\n"
                "    print('more noise')\n"
                "    return {'correctness': answer['answer'] == reference['value']\n"
                "            and case['id'] == 'c'}\n")
    assert run(p) == {"correctness": True, "evidence": True, "refusal": True}
    assert run(p, {"answer": 5, "evidence": ["orders customers"]}) == {
        "correctness": False, "evidence": False, "refusal": True}


@pytest.mark.parametrize(("src", "msg"), [
    ("def score(a, r, c):\n    raise KeyError('unit')\n", "raised KeyError: 'unit'"),
    ("def score(a, r, c):\n    return {'correctness': 'yes'}\n", "expected true, false"),
    ("def score(a, r, c):\n    return {'score': 1.0}\n", "unknown key"),
    ("def score(a, r, c):\n    return [True]\n", "expected a dict"),
    ("def score(a, r, c):\n    return {'correctness': object()}\n", "not JSON"),
    ("import os\ndef score(a, r, c):\n    os._exit(7)\n", "exited (exit code 7)"),
    ("import sys\ndef score(a, r, c):\n    sys.exit(3)\n", "raised SystemExit: 3"),
    ("import time\ndef score(a, r, c):\n    time.sleep(60)\n", "took longer than 1s"),
    ("import os\ndef score(a, r, c):\n    os.write(1, b'x')\n"
     "    return {}\n", ""),
])
def test_project_scorer_failures_are_named_scorer_errors(project: Any, src: str,
                                                         msg: str) -> None:
    g = run(project(src, timeout_s=1.0))
    if msg:
        assert msg in g["scorer_error"], g
        assert g["correctness"] is None
    else:
        assert "scorer_error" not in g  # a print to fd 1 goes to stderr, not the reply


def test_project_scorer_that_fails_to_load_is_given_up_once(project: Any) -> None:
    p = project("import nonexistent_module_xyz\n")
    first, second = run(p), run(p)
    assert "failed to load: ModuleNotFoundError" in first["scorer_error"]
    assert second["scorer_error"] == first["scorer_error"]
    assert p.starts == 1


def test_project_scorer_restarts_after_a_crash_then_gives_up(project: Any) -> None:
    p = project("import os\ndef score(a, r, c):\n"
                "    if a.get('die'):\n        os._exit(1)\n    return {'correctness': True}\n")
    assert run(p, {"die": True})["scorer_error"].startswith("project scorer exited")
    assert run(p)["correctness"] is True  # a fresh process for the next case
    for _ in range(evaluator.MAX_RESTARTS):
        run(p, {"die": True})
    assert "given up after" in run(p)["scorer_error"]


def test_project_scorer_reply_is_bounded(project: Any) -> None:
    p = project("def score(a, r, c):\n    return {'correctness': True, 'x': 'y' * 200000}\n")
    assert "longer than 65536 bytes" in run(p)["scorer_error"]


def test_oversized_answer_is_not_sent(project: Any) -> None:
    p = project(GOOD)
    g = run(p, {"answer": "x" * (evaluator.MAX_REQUEST_BYTES + 1)})
    assert "answer too large" in g["scorer_error"] and p.starts == 0


def test_evaluator_main_end_to_end_with_a_project_scorer(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(PROJECT_ROOT))
    for d in ("in", "ref", "cfg", "out"):
        (tmp_path / d).mkdir()
    (tmp_path / "scorer.py").write_text(
        "def score(answer, reference, case):\n"
        "    return {'correctness': answer.get('answer') == case['input']['want']}\n")
    rows = [{"case_id": "p", "trial": 0, "answer": {"answer": 7, "evidence": ["orders"]}},
            {"case_id": "n", "trial": 0, "answer": {"answer": "7 ", "evidence": ["orders"]}}]
    (tmp_path / "in" / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "ref" / "references.json").write_text(json.dumps({
        "p": REF, "n": {"scorer": {"name": "number", "rel_tol": 0, "abs_tol": 0}, "value": 7,
                        "evidence": ["orders"]}}))
    (tmp_path / "cfg" / "evaluator.json").write_text(json.dumps({
        "judge": None, "questions": {}, "inputs": {"p": {"want": 7}, "n": {}},
        "scoring": {"vocabulary": ["orders"], "max_extra": 0,
                    "project": {"timeout_s": 5}}}))
    assert evaluator.main(tmp_path / "in", tmp_path / "ref", tmp_path / "cfg",
                          tmp_path / "out", tmp_path / "scorer.py") == 0
    got = parse_grades((tmp_path / "out" / "grades.jsonl").read_bytes(), {("p", 0), ("n", 0)})
    assert got[("p", 0)] == Grades(correctness=True, evidence=True, refusal=True)
    assert got[("n", 0)] == Grades(correctness=True, evidence=True, refusal=True)
    assert sys.modules.get("project_scorer") is None  # never imported in this process


def test_the_documented_example_scorer_works(project: Any) -> None:
    """The contract example in docs/scorers.md passes the host checks and scores."""
    from runner.cycle.scoring import check_project_source

    doc = (PROJECT_ROOT / "docs" / "scorers.md").read_text()
    src = next(b.split("```", 1)[0] for b in doc.split("```python\n")[1:]
               if "def score(answer, reference, case)" in b)
    check_project_source(src.encode(), path="docs/scorers.md", field="example")
    p = project(src)
    ref = {"scorer": {"name": "project", "options": {"unit": "km"}}, "value": 42.195,
           "evidence": ["marathon"]}
    for answer, correct in (("42.195 km", True), ("42.3 km", False), ("42.195", False)):
        g = evaluator.grade({"case_id": "u01", "trial": 0,
                             "answer": {"answer": answer, "evidence": ["the marathon"]}},
                            ref, {"scoring": {"vocabulary": [], "max_extra": 0}}, p)
        assert g == {"correctness": correct, "evidence": True, "refusal": True}, answer


# -- manifests by command carry the scoring section ------------------------------------------
def _scenarios_file(tmp_path: Path, refs: list[dict[str, Any]],
                    scoring: dict[str, Any] | None) -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "facts.json").write_text("{}\n")
    doc: dict[str, Any] = {
        "schema": 1, "dataset": "facts", "stores": {"facts": "facts.json"},
        "scenarios": [{"id": f"c{i}", "split": "development", "input": {"question": "q"},
                       "reference": r} for i, r in enumerate(refs)]}
    if scoring is not None:
        doc["scoring"] = scoring
    path = tmp_path / "scenarios.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_manifest_build_carries_scoring_and_check_finds_the_scorer_file(tmp_path: Path) -> None:
    from runner.cycle.manifest import load_manifest
    from runner.project import manifest_tools as mt

    path = _scenarios_file(tmp_path, [{"value": "Lyon"}, {"scorer": "project"}],
                           {"default": "normalized", "project": {"file": "scorer.py"},
                            "evidence_vocabulary": ["facts"]})
    built = mt.build(path, tmp_path / "data").manifest
    assert built.scoring is not None and built.scoring.default is not None
    assert [resolved_reference(s.reference, built)["scorer"]["name"]
            for s in built.scenarios] == ["normalized", "project"]
    out = tmp_path / "manifest.json"
    mt.write_atomic(built, out)
    with pytest.raises(ConfigError, match="does not exist") as info:
        mt.check(out, tmp_path / "data")
    assert info.value.field == "scoring.project.file"
    (tmp_path / "scorer.py").write_text(GOOD)
    assert mt.check(out, tmp_path / "data").scoring == built.scoring
    assert load_manifest(out, tmp_path / "data").scoring == built.scoring
    assert mt.rehash(out, tmp_path / "data") == []  # scoring is not a hash input


def test_manifest_build_names_a_case_without_a_scorer(tmp_path: Path) -> None:
    from runner.project import manifest_tools as mt

    path = _scenarios_file(tmp_path, [{"kind": "refuse"}, {"value": "Lyon"}], None)
    with pytest.raises(ConfigError, match="no scorer") as info:
        mt.build(path, tmp_path / "data")
    assert info.value.field == "scenarios[1].reference"


# -- the judge fields agree with the plan; every expected row is there (helper-44) -----------
@pytest.mark.parametrize(("grades", "threshold", "msg"), [
    ({"correctness": True, "judge_score": 0.9, "judge_pass": True}, None,
     "judge_score given, but the plan has no judge"),
    ({"correctness": True, "judge_error": "x"}, None, "judge_error given, but the plan"),
    ({"correctness": True, "judge_score": 0.0, "judge_pass": True}, 0.5,
     "judge_pass True disagrees with judge_score 0.0"),
    ({"correctness": True, "judge_pass": True}, 0.5, "needs both"),
    ({"correctness": True}, 0.5, "needs both"),
    ({"correctness": True, "judge_score": 0.9, "judge_pass": True, "judge_error": "x"}, 0.5,
     "beside a judge verdict"),
])
def test_judge_fields_that_disagree_with_the_plan_are_refused(
        grades: dict[str, Any], threshold: float | None, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        parse_grades(line("a", **grades), {("a", 0)}, judge_threshold=threshold)


def test_judge_fields_that_agree_with_the_plan_are_read() -> None:
    got = parse_grades(line("a", correctness=True, judge_score=0.5, judge_pass=True)
                       + line("b", correctness=True, judge_error="timeout \x1b]0;x\x07"),
                       {("a", 0), ("b", 0)}, judge_threshold=0.5)
    assert got[("a", 0)].judge_pass is True
    assert got[("b", 0)].judge_error == "timeout \\x1b]0;x\\x07"


def test_a_missing_row_fails_the_stage() -> None:
    with pytest.raises(ValueError, match=r"no grades for 1 expected .*case b, trial 0"):
        parse_grades(line("a", correctness=True), {("a", 0), ("b", 0)})
