"""Every path a cycle file names is read against the cycle file's directory and frozen
absolute, the credential file too: read against the working directory, freeze from
another directory failed (naming no field) and a plan run from elsewhere read whatever
file of that name was there."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from runner.cycle.plan import freeze
from runner.errors import PrerequisiteError
from tests.fixtures.cycle_project import example_agent, project_with_agent

IMAGES = {r: "sha256:" + hashlib.sha256(r.encode()).hexdigest()
          for r in ("analyst", "worker", "evaluator", "apply")}


def _with_judge_key_file(tmp_path: Path, key_file: str) -> Path:
    cycle = project_with_agent(tmp_path / "project", example_agent())
    doc = yaml.safe_load(cycle.read_text())
    doc["upstreams"]["judge"] = {"provider": "openai", "base_url": "https://j.invalid/v1",
                                 "credential": {"file": key_file}, "models": ["fixture-judge"]}
    doc["judge"] = {"model": "fixture-judge", "threshold": 0.5}
    cycle.write_text(yaml.safe_dump(doc))
    return cycle


def test_a_relative_credential_file_is_read_beside_the_cycle_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cycle = _with_judge_key_file(tmp_path, "keys/judge.txt")
    (cycle.parent / "keys").mkdir()
    (cycle.parent / "keys" / "judge.txt").write_text("sk-judge\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    freeze(cycle, tmp_path / "run", images=IMAGES)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())["plan"]
    assert plan["upstreams"]["judge"]["credential"] == {
        "env": None, "file": str(cycle.parent / "keys" / "judge.txt")}


def test_a_missing_credential_file_names_its_field(tmp_path: Path) -> None:
    cycle = _with_judge_key_file(tmp_path, "nokey.txt")
    with pytest.raises(PrerequisiteError, match=r"upstreams.judge.credential.file.*"
                                                r"nokey.txt does not exist"):
        freeze(cycle, tmp_path / "run", images=IMAGES)
