"""A whole cycle whose manifest brings its own scorer file, through the CLI.

Two cases of the bundled example are scored by a project scorer that fails on purpose
when it sees the right revenue answer, which only the candidate gives: the baseline is
graded by the file (inside the evaluator container), the candidate's failure ends the
cycle as invalid_comparison with the named reason, and the receipt still verifies.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.cycle.manifest import build_manifest, write_manifest
from runner.cycle.models import Manifest, Reference
from runner.cycle.scorer_specs import ProjectScorerFile, Scoring
from runner.paths import PROJECT_ROOT

pytestmark = [pytest.mark.docker, pytest.mark.slow]
EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
CLI = str(Path(sys.executable).with_name("cyclebox"))
PROJECT_CASES = ("d01-revenue-march", "d04-customers-lyon")

SCORER = '''
import os
import sys


def score(answer, reference, case):
    got = answer.get("answer")
    print(f"project scorer ran: case={case['id']} uid={os.getuid()}", file=sys.stderr)
    close = (isinstance(got, (int, float)) and not isinstance(got, bool)
             and abs(got - reference["value"]) <= reference["scorer"]["options"]["abs_tol"])
    if case["id"] == "d01-revenue-march" and close:
        raise RuntimeError("deliberate failure on the right answer")
    return {"correctness": close}
'''


def _example_with_scorer(dest: Path) -> Path:
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("project"))
    m = Manifest.model_validate(json.loads((dest / "manifest.json").read_text()))
    scen = [s.model_copy(update={"reference": Reference.model_validate({
        "scorer": {"name": "project", "options": {"abs_tol": 0.01}},
        "value": s.reference.value, "evidence": s.reference.evidence})})
        if s.id in PROJECT_CASES else s for s in m.scenarios]
    assert m.scoring is not None
    scoring = Scoring(project=ProjectScorerFile(file="scorer.py", timeout_s=20),
                      evidence_vocabulary=m.scoring.evidence_vocabulary)
    write_manifest(build_manifest(m.dataset, m.split, scen, m.stores, scoring),
                   dest / "manifest.json")
    (dest / "scorer.py").write_text(SCORER)
    cyc = yaml.safe_load((EXAMPLE / "cycle.yaml").read_text())
    cyc["project"]["repo"] = str(PROJECT_ROOT)
    cyc["roles"] = str(PROJECT_ROOT / "policies" / "roles.yaml")
    cyc["upstreams"]["judge"]["script"] = str(PROJECT_ROOT / "policies/scripts/default.yaml")
    (dest / "cycle.yaml").write_text(yaml.safe_dump(cyc))
    return dest / "cycle.yaml"


def test_project_scorer_grades_in_the_cycle_and_its_failure_is_named(tmp_path: Path) -> None:
    cycle = _example_with_scorer(tmp_path / "ex")
    run = tmp_path / "run"
    res = subprocess.run([CLI, "cycle", "run", str(cycle), "--out", str(run), "--json"],
                         capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode == 2, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["verdict"] == "invalid_comparison"
    verdict = json.loads((run / "stages/compare/verdict.json").read_text())
    assert verdict["reasons"] == [
        "candidate: infra_invalid (case d01-revenue-march, trial 0): scorer_error: project "
        "scorer raised RuntimeError: deliberate failure on the right answer"]
    base = {r["case_id"]: r for r in map(json.loads, (run / "stages/baseline/records.jsonl")
                                         .read_text().splitlines())}
    assert base["d01-revenue-march"]["grades"]["correctness"] is False  # wrong, no failure
    assert base["d04-customers-lyon"]["grades"]["correctness"] is True
    assert all(r["status"] == "ok" for r in base.values())
    log = (run / "stages/evaluate-baseline/logs/evaluator.stderr").read_text()
    assert "project scorer ran: case=d04-customers-lyon uid=10001" in log
    assert (run / "inputs/scorer/scorer.py").read_text() == SCORER
    plan = json.loads((run / "plan.json").read_text())["plan"]
    assert plan["policy"]["identities"]["scorer"] == plan["scorer"]
    verify = subprocess.run([CLI, "receipt", "verify", str(run)], capture_output=True,
                            text=True, timeout=300, check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
