"""A project's scorer file runs inside the real evaluator container, under its policy.

The scorer checks its own surroundings (read-only mount, no network, not root, no
credential in its environment) and reports the result as a grade, so a pass shows the
file really ran there; failures of the file (raise, garbage, hang, load error) come back
as named scorer errors in otherwise complete grades.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runner.cycle.scoring import parse_grades
from runner.isolation.sandbox import Mount, StopReason
from tests.conftest import RunFn

pytestmark = pytest.mark.docker

SCORER = '''
import os, socket, sys

def _isolated():
    facts = {}
    try:
        open("/scorer/written", "w").close()
        facts["scorer_mount_read_only"] = False
    except OSError:
        facts["scorer_mount_read_only"] = True
    try:
        socket.create_connection(("1.1.1.1", 53), timeout=2).close()
        facts["no_network"] = False
    except OSError:
        facts["no_network"] = True
    facts["not_root"] = os.getuid() != 0
    facts["no_credentials"] = not any("KEY" in k or "TOKEN" in k for k in os.environ)
    print("project scorer facts", facts, file=sys.stderr)
    return all(facts.values())

def score(answer, reference, case):
    mode = case["input"]["mode"]
    if mode == "isolated":
        return {"correctness": _isolated() and answer["answer"] == reference["value"]}
    if mode == "raise":
        raise ValueError("unit missing in " + case["id"])
    if mode == "garbage":
        return {"correctness": "probably"}
    if mode == "hang":
        while True:
            pass
    return {"correctness": answer["answer"] == reference["value"],
            "evidence": reference["scorer"]["options"]["trust_evidence"]}
'''

CASES = {"iso": "isolated", "boom": "raise", "junk": "garbage", "loop": "hang", "ok": "plain"}


def _stage(tmp_path: Path, scorer: str) -> list[Mount]:
    d = {name: tmp_path / name for name in ("in", "ref", "cfg", "scorer")}
    for p in d.values():
        p.mkdir()
        p.chmod(0o755)
    (d["scorer"] / "scorer.py").write_text(scorer)
    rows = [{"case_id": c, "trial": 0, "answer": {"answer": 7, "evidence": ["orders"],
                                                   "refused": False}} for c in CASES]
    (d["in"] / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref = {"scorer": {"name": "project", "options": {"trust_evidence": False}}, "value": 7,
           "evidence": ["orders"]}
    (d["ref"] / "references.json").write_text(json.dumps({c: ref for c in CASES}))
    (d["cfg"] / "evaluator.json").write_text(json.dumps({
        "judge": None, "questions": {}, "inputs": {c: {"mode": m} for c, m in CASES.items()},
        "scoring": {"vocabulary": ["orders", "customers"], "max_extra": 0,
                    "project": {"timeout_s": 3}}}))
    for p in d.values():
        for f in p.iterdir():
            f.chmod(0o644)
    return [Mount(source=p, target=f"/{name}") for name, p in d.items()]


def _grades(rec: Any) -> dict[str, dict[str, Any]]:
    raw = (rec.__dict__["output_dir"] / "grades.jsonl").read_bytes()
    got = parse_grades(raw, {(c, 0) for c in CASES})
    return {c: g.model_dump(exclude_none=True) for (c, _t), g in got.items()}


def test_project_scorer_runs_in_the_evaluator_container(run_role: RunFn,
                                                        tmp_path: Path) -> None:
    rec = run_role(["python", "-m", "sandbox.evaluator"], role="evaluator",
                   mounts=_stage(tmp_path, SCORER))
    assert rec.stop_reason is StopReason.OK, (rec, rec.stderr_tail)
    g = _grades(rec)
    assert g["iso"] == {"correctness": True, "evidence": True, "refusal": True}, \
        rec.stderr_tail
    assert g["ok"] == {"correctness": True, "evidence": False, "refusal": True}
    assert g["boom"]["scorer_error"] == "project scorer raised ValueError: unit missing in boom"
    assert "expected true, false or null" in g["junk"]["scorer_error"]
    assert g["loop"]["scorer_error"] == "project scorer took longer than 3s"
    assert "project scorer facts" in rec.stderr_tail
    assert not (tmp_path / "scorer" / "written").exists()


def test_a_scorer_that_does_not_load_grades_every_case_with_the_reason(
        run_role: RunFn, tmp_path: Path) -> None:
    rec = run_role(["python", "-m", "sandbox.evaluator"], role="evaluator",
                   mounts=_stage(tmp_path, "import numpy_is_not_here\n"))
    assert rec.stop_reason is StopReason.OK, (rec, rec.stderr_tail)
    g = _grades(rec)
    assert {c: v["scorer_error"] for c, v in g.items()} == {
        c: "project scorer failed to load: ModuleNotFoundError: No module named "
           "'numpy_is_not_here'" for c in CASES}
