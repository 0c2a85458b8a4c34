"""Bring your own agent, as a new user does it, through the CLI only: `cyclebox init` into
an empty directory, commit, `cyclebox manifest build`, `cyclebox cycle run` -> a verdict.
Nothing here imports runner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CLI = [str(Path(sys.executable).with_name("cyclebox"))]
if not Path(CLI[0]).exists():  # pragma: no cover - fallback when not installed as a script
    CLI = [sys.executable, "-m", "runner.cli"]
GIT_ID = ["-c", "user.name=new user", "-c", "user.email=user@example.invalid"]


def cyclebox(*args: str, cwd: Path | None = None,
             timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, cwd=cwd)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *GIT_ID, *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout


def test_init_commit_build_run_gives_a_verdict(tmp_path: Path) -> None:
    proj = tmp_path / "my-agent"
    res = cyclebox("init", str(proj))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "git init" in res.stdout  # the next step is printed

    again = cyclebox("init", str(proj))
    assert again.returncode == 3 and "not empty" in again.stderr

    git(proj, "init", "-q")
    git(proj, "add", "-A")
    git(proj, "commit", "-q", "-m", "base")

    res = cyclebox("manifest", "build", "--scenarios", "scenarios.yaml", "--data", "data",
                   "--out", "manifest.json", cwd=proj)
    assert res.returncode == 0, res.stdout + res.stderr
    assert git(proj, "status", "--porcelain") == ""  # the build is deterministic
    res = cyclebox("manifest", "check", "manifest.json", cwd=proj)
    assert res.returncode == 0, res.stdout + res.stderr

    run = tmp_path / "run"
    res = cyclebox("cycle", "run", str(proj / "cycle.yaml"), "--out", str(run), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(res.stdout)
    assert result["verdict"] == "accept_for_review", result["reasons"]
    verdict = json.loads((run / "stages/compare/verdict.json").read_text())
    assert {c["case_id"] for c in verdict["improvements"]} == {
        "d01-leave-days", "d02-remote-days", "a01-training-budget", "a02-notice-period",
        "a03-probation"}
    assert verdict["regressions"] == []
    # the agent was told its model and case (it exits 2 without CYCLEBOX_MODEL)
    answer = json.loads(next((run / "stages/candidate/cases").glob("d01-*"))
                        .joinpath("out/answer.json").read_text())
    assert answer["answer"] == 25 and answer["evidence"] == ["leave_days"]
    res = cyclebox("receipt", "verify", str(run))
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_broken_manifest_is_named_and_repaired_by_command(tmp_path: Path) -> None:
    proj = tmp_path / "p"
    assert cyclebox("init", str(proj)).returncode == 0
    facts = proj / "data" / "facts.json"
    facts.write_text(facts.read_text().replace("25 days", "26 days"))
    res = cyclebox("manifest", "check", str(proj / "manifest.json"))
    assert res.returncode == 4
    assert "stores.facts.sha256" in res.stderr and "manifest rehash" in res.stderr
    res = cyclebox("manifest", "rehash", str(proj / "manifest.json"))
    assert res.returncode == 0 and "stores.facts.sha256" in res.stdout
    assert cyclebox("manifest", "check", str(proj / "manifest.json")).returncode == 0
    res = cyclebox("schema", "scenarios")
    assert res.returncode == 0 and json.loads(res.stdout)["properties"]["scenarios"]
