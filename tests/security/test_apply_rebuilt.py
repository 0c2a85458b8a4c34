"""The apply container's repository is hostile, and the host never runs git on it: it
commits the proposal itself in its own repository (cloned from the base before the
container starts) and the container's claim must name that very commit. Each attack
below is what a compromised apply container can do to its work repository and its
output (real git, a stand-in for the container, no Docker); each once passed or
crashed the host's re-check of a clone of that repository."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runner import gitops
from runner.cycle.apply import CANDIDATE_GIT_ENV, apply_proposal
from runner.isolation.sandbox import RunRecord, StopReason

ENV = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | gitops.FIXED_ENV
BASE = b"print(1)\n"
NEW = "print(2)\n"


def g(repo: Path, *args: str, data: bytes | None = None) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          env=ENV, input=data).stdout.decode()


def _record() -> RunRecord:
    return RunRecord(run_id="x", role="apply", image_id="sha256:" + "0" * 64,
                     container_name="c", exit_code=0, stop_reason=StopReason.OK, wall_s=0.1,
                     stdout_bytes=0, stderr_bytes=0, stdout_tail="", stderr_tail="",
                     cleanup_confirmed=True)


def _apply(tmp_path: Path, container: Callable[[Path, str], None],
           content: str = NEW, attributes: str | None = None,
           base: bytes = BASE) -> tuple[Any, Path]:
    repo = tmp_path / "op"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "a.py").write_bytes(base)
    (repo / "README").write_text("r\n")
    if attributes is not None:
        (repo / ".gitattributes").write_text(attributes)
    g(repo, "init", "-q", "-b", "main")
    g(repo, "add", "-A")
    g(repo, "commit", "-q", "-m", "base")
    stage = tmp_path / "stage"
    (stage / "in").mkdir(parents=True)
    (stage / "in" / "proposal.json").write_text(json.dumps(
        {"files": [{"path": "src/a.py", "content": content}], "rationale": "why"}))
    (stage / "in" / "invocation.json").write_text(json.dumps(
        {"paths": ["src/a.py"], "allowlist": ["src/*"],
         "base": {"src/a.py": hashlib.sha256(base).hexdigest()}, "max_file_bytes": 1024}))

    def run(work: Path) -> RunRecord:
        r = work / "repo"
        base = g(r, "rev-parse", "HEAD").strip()
        g(r, "checkout", "-q", "-b", "cyclebox/candidate")
        container(r, base)
        env = {**ENV, **CANDIDATE_GIT_ENV}
        subprocess.run(["git", "-C", str(r), "commit", "-q", "--no-verify", "--allow-empty",
                        "-m", "cyclebox candidate\n\nwhy"], check=True, env=env,
                       capture_output=True)
        commit = g(r, "rev-parse", "HEAD").strip()
        (work / "out" / "candidate.patch").write_bytes(subprocess.run(
            ["git", "-C", str(r), "diff", "--binary", "--no-color", "--no-ext-diff", base,
             commit], check=True, capture_output=True, env=ENV).stdout)
        (work / "out" / "result.json").write_text(json.dumps(
            {"status": "applied", "base_commit": "\x1b]0;forged\x07" * 1000,
             "commit": commit, "tree": "0" * 40, "branch": "main\x1b[2J",
             "changed": ["../../etc/passwd"]}))
        if container is _config_that_hangs_git:  # last: git in this repository now hangs
            os.mkfifo(r / ".git" / "fifo")
            with (r / ".git" / "config").open("a") as f:
                f.write("[include]\n\tpath = fifo\n\tpath = /dev/zero\n")
        return _record()

    result = apply_proposal(stage, repo, g(repo, "rev-parse", "HEAD^{tree}").strip(), run=run,
                            uid=os.getuid(), export_to=stage / "candidate-src")
    return result, stage


def _honest(r: Path, _base: str) -> None:
    (r / "src" / "a.py").write_text(NEW)
    g(r, "add", "-A")


@pytest.mark.parametrize("container", [
    pytest.param(_honest, id="honest"),
    pytest.param("config", id="config-that-hangs-git"),
])
def test_the_proposals_commit_is_applied_with_the_hosts_own_fields(
        tmp_path: Path, container: Any) -> None:
    """Its commit is the proposal's; what else it wrote is never read: the claim's own
    base_commit, branch and changed were forged (escapes, 16 KB), and one variant's
    .git/config includes a FIFO and /dev/zero."""
    result, stage = _apply(tmp_path, _honest if container == "honest"
                           else _config_that_hangs_git)
    assert result.status == "applied", result
    assert (stage / "candidate-src" / "src" / "a.py").read_text() == NEW
    # the claim's own base_commit, branch and changed were forged: the host's are kept
    assert result.branch == "cyclebox/candidate" and result.changed == ("src/a.py",)
    assert len(result.base_commit) == 40 and set(result.base_commit) <= set("0123456789abcdef")
    assert json.loads((stage / "result.json").read_text())["base_commit"] == result.base_commit


def _symlink(r: Path, _base: str) -> None:
    (r / "src" / "a.py").unlink()
    os.symlink("/etc/shadow", r / "src" / "a.py")
    g(r, "add", "-A")


def _executable(r: Path, _base: str) -> None:
    (r / "src" / "a.py").write_text(NEW)
    os.chmod(r / "src" / "a.py", 0o755)
    g(r, "add", "-A")


def _alternates_and_a_second_parent(r: Path, _base: str) -> None:
    other = r.parent / "other"
    other.mkdir()
    (other / "creds.txt").write_text("secret\n")
    g(other, "init", "-q")
    g(other, "add", "-A")
    g(other, "commit", "-q", "-m", "o")
    (r / ".git" / "objects" / "info").mkdir(parents=True, exist_ok=True)
    (r / ".git" / "objects" / "info" / "alternates").write_text(
        str(other / ".git" / "objects") + "\n")
    g(r, "update-ref", "MERGE_HEAD", g(other, "rev-parse", "HEAD").strip())
    (r / "src" / "a.py").write_text(NEW)
    g(r, "add", "-A")


def _config_that_hangs_git(r: Path, _base: str) -> None:
    """Its .git/config includes a FIFO and /dev/zero (written after its commit, below):
    git reading that config on the host blocked for ever or grew without bound."""
    (r / "src" / "a.py").write_text(NEW)
    g(r, "add", "-A")


@pytest.mark.parametrize("container", [
    pytest.param(_symlink, id="symlink-to-etc-shadow"),
    pytest.param(_executable, id="made-executable"),
    pytest.param(_alternates_and_a_second_parent, id="alternates-and-second-parent"),
])
def test_a_candidate_other_than_the_proposals_is_refused_unread(
        tmp_path: Path, container: Callable[[Path, str], None]) -> None:
    tracemalloc.start()
    try:
        result, stage = _apply(tmp_path, container)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.status == "refused", result
    assert result.reason == "host_verification_failed"
    assert "is not the commit the proposal makes" in result.message
    assert not (stage / "candidate-src").exists()
    assert not list((stage / "candidate.git").rglob("alternates"))
    assert peak < 64 * 1024 * 1024


def test_an_honest_edit_under_a_diff_driver_attribute_is_applied(tmp_path: Path) -> None:
    """*.py diff=python changes the hunk headers of the container's diff (its work tree
    reads .gitattributes) but not the host's (a bare repository): the container's patch
    was compared with the host's and the honest edit refused. The host keeps its own."""
    body = "class A:\n    def method(self):\n" + "".join(f"        x{i} = {i}\n"
                                                       for i in range(12))
    edited = body.replace("x10 = 10", "x10 = 11")

    def honest(r: Path, _base: str) -> None:
        (r / "src" / "a.py").write_text(edited)
        g(r, "add", "-A")

    result, stage = _apply(tmp_path, honest, content=edited, base=body.encode(),
                           attributes="*.py diff=python\n")
    assert result.status == "applied", result
    assert b"+        x10 = 11" in (stage / "candidate.patch").read_bytes()
