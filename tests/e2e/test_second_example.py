"""The second bundled example (examples/unit-convert, made with `cyclebox init`) runs its
cycle offline to accept_for_review through the CLI, and its committed manifest is current."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "unit-convert"
CLI = [str(Path(sys.executable).with_name("cyclebox"))]
if not Path(CLI[0]).exists():  # pragma: no cover - fallback when not installed as a script
    CLI = [sys.executable, "-m", "runner.cli"]


def cyclebox(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_the_committed_manifest_matches_its_scenarios_and_data() -> None:
    res = cyclebox("manifest", "check", str(EXAMPLE / "manifest.json"))
    assert res.returncode == 0, res.stdout + res.stderr


def test_unit_convert_cycle_accepts_the_us_units_edit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = cyclebox("cycle", "run", str(EXAMPLE / "cycle.yaml"), "--out", str(run), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(res.stdout)
    assert result["verdict"] == "accept_for_review", result["reasons"]
    verdict = json.loads((run / "stages/compare/verdict.json").read_text())
    assert {c["case_id"] for c in verdict["improvements"]} == {
        "d01-gallons-to-litres", "d02-pints-to-ml", "a01-gallons-to-ml",
        "a02-fluid-ounces-to-ml"}
    assert verdict["regressions"] == []
    patch = (run / "stages/apply/candidate.patch").read_text()
    assert "skills/units.md" in patch and "US units" in patch
    records = [json.loads(line) for line in
               (run / "stages/candidate/records.jsonl").read_text().splitlines()]
    by_id = {r["case_id"]: r for r in records}
    assert by_id["d05-metres-to-kg"]["answer"]["refused"] is True  # refused by the agent
    assert by_id["a01-gallons-to-ml"]["answer"]["evidence"] == ["gal_us", "ml"]
