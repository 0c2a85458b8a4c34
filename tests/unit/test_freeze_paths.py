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
    doc["judge"] = {"model": "fixture-judge", "threshold": 0.5, "required": False}
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


def _cycle(tmp_path: Path, edit: object = None) -> tuple[Path, dict[str, object]]:
    cycle = project_with_agent(tmp_path / "project", example_agent())
    return cycle, yaml.safe_load(cycle.read_text())


def _refused(tmp_path: Path, doc: dict[str, object], cycle: Path, field: str,
             why: str) -> None:
    from runner.errors import ConfigError

    cycle.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=why) as info:
        freeze(cycle, tmp_path / "run", images=IMAGES)
    assert info.value.field == field
    assert not (tmp_path / "run").exists()


def test_a_brief_that_is_not_utf8_or_too_big_is_refused_at_freeze(tmp_path: Path) -> None:
    """Found only after the whole baseline had run (an unexpected error), or copied into
    the run whole (a 1 GiB sparse brief)."""
    cycle, doc = _cycle(tmp_path)
    (cycle.parent / "bad.md").write_bytes(b"# brief\n\xff\xfe\n")
    doc["brief"] = {"mode": "file", "file": "bad.md"}
    _refused(tmp_path, doc, cycle, "brief.file", "not UTF-8: byte 8")
    with open(cycle.parent / "big.md", "wb") as f:
        f.truncate((1 << 20) + 1)
    doc["brief"] = {"mode": "file", "file": "big.md"}
    _refused(tmp_path, doc, cycle, "brief.file", r"the limit is 1048576")


def test_worker_max_tokens_above_its_upstreams_cap_is_refused(tmp_path: Path) -> None:
    cycle, doc = _cycle(tmp_path)
    cap = doc["upstreams"]["optimizer"]["max_tokens"]  # type: ignore[index]
    doc["worker"] = {**doc["worker"], "max_tokens": cap + 1}  # type: ignore[dict-item]
    _refused(tmp_path, doc, cycle, "worker.max_tokens", f"above the cap .*\\({cap}\\)")


def test_edit_paths_must_be_plain_text_files(tmp_path: Path) -> None:
    from runner import gitops

    cycle, doc = _cycle(tmp_path)
    edit = doc["edit"]
    doc["edit"] = {**edit, "paths": [*edit["paths"], "prompts/x\n.md"]}  # type: ignore[index]
    _refused(tmp_path, doc, cycle, "edit.paths", "control character")
    repo = Path(doc["project"]["repo"])  # type: ignore[index]
    (repo / "prompts" / "bin.md").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    gitops.init_fixed(repo, "binary")
    doc["edit"] = {**edit, "paths": [*edit["paths"], "prompts/bin.md"]}  # type: ignore[index]
    _refused(tmp_path, doc, cycle, "edit.paths", "prompts/bin.md.* is not UTF-8 text")


def test_dream_intent_key_must_name_each_development_case_text(tmp_path: Path) -> None:
    cycle, doc = _cycle(tmp_path)
    doc["dream"] = {"mode": "template", "factor": 1, "intent_key": "questoin"}
    _refused(tmp_path, doc, cycle, "dream.intent_key", "have no text field 'questoin'")


def test_the_scenarios_file_named_as_the_manifest_says_what_to_do(tmp_path: Path) -> None:
    """``scenarios: scenarios.yaml`` (the file `manifest build` reads) got "invalid JSON
    ... Fix: plain JSON", naming neither the field nor the command that makes one."""
    cycle, doc = _cycle(tmp_path)
    (cycle.parent / "scenarios.yaml").write_text("schema: 1\nscenarios: []\n")
    doc["scenarios"] = "scenarios.yaml"
    _refused(tmp_path, doc, cycle, "scenarios", r"is not a scenario manifest .*cyclebox "
                                                r"manifest build")
    (cycle.parent / "broken.json").write_text('{"schema": 1, "x": NaN}')
    doc["scenarios"] = "broken.json"  # a manifest, broken: the JSON error as it was
    cycle.write_text(yaml.safe_dump(doc))
    from runner.errors import ConfigError

    with pytest.raises(ConfigError, match=r"broken\.json: invalid JSON: NaN"):
        freeze(cycle, tmp_path / "run", images=IMAGES)
