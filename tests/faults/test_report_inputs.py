"""`cyclebox report` over a run directory whose files are valid JSON of the wrong kind.

The report is still written (exit 0) and says ``incomplete``, and a problem line names
the file that is not what cyclebox wrote, on the terminal, in --json and in Markdown.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.faults.test_bad_inputs import run_cli


def _run_dir(root: Path, verdict: str) -> Path:
    run = root / "run"
    (run / "stages" / "compare").mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"plan": {"name": "x"}}))
    (run / "stages" / "compare" / "verdict.json").write_text(verdict)
    return run


@pytest.mark.parametrize("doc", ["[1, 2]", '"accept_for_review"', "7", "null"])
def test_verdict_that_is_not_an_object_is_named(doc: str, tmp_path: Path) -> None:
    run = _run_dir(tmp_path, doc)
    md = tmp_path / "r.md"
    code, out, err = run_cli(["report", str(run), "--json", "--markdown", str(md)], {})
    assert code == 0, err
    report = json.loads(out)
    assert report["verdict"] == "incomplete"
    named = [p for p in report["problems"] if p.startswith("stages/compare/verdict.json")]
    assert named and "expected a JSON object" in named[0], report["problems"]
    assert "stages/compare/verdict.json" in md.read_text()


def test_unknown_verdict_is_named(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, '{"verdict": "accept_everything"}')
    code, out, err = run_cli(["report", str(run), "--json"], {})
    assert code == 0, err
    report = json.loads(out)
    assert report["verdict"] == "incomplete"
    assert any("accept_everything" in p for p in report["problems"]), report["problems"]


def test_plan_that_is_not_an_object_is_named(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, '{"verdict": "reject"}')
    (run / "plan.json").write_text("[]")
    code, out, err = run_cli(["report", str(run), "--json"], {})
    assert code == 0, err
    assert any(p.startswith("plan.json: expected a JSON object")
               for p in json.loads(out)["problems"])
