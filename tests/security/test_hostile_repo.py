"""A repository the operator points at is hostile input: a huge blob (zeros compress to
almost nothing in git) must not be read whole into host memory (real git, no Docker)."""

from __future__ import annotations

import os
import subprocess
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from runner import gitops
from runner.errors import ConfigError

BIG = 48 * 1024 * 1024
ENV = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | {
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


@pytest.fixture(autouse=True)
def _fresh_readers() -> Iterator[None]:
    gitops.close_readers()
    yield
    gitops.close_readers()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    repo = tmp_path_factory.mktemp("hostile-repo")
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=ENV)
    with open(repo / "requirements.txt", "wb") as f:
        f.truncate(BIG)                       # sparse on disk, a few KiB in git
    (repo / "small.txt").write_text("ok\n")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, env=ENV)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", "big"], check=True, env=ENV)
    (repo / "requirements.txt").unlink()
    tree = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD^{tree}"], check=True,
                          env=ENV, capture_output=True, text=True).stdout.strip()
    return repo, tree


def _peak(fn: Any) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_a_huge_requirements_blob_is_refused_unread(repo: tuple[Path, str]) -> None:
    from runner.cycle.plan import _agent_requirements

    path, tree = repo
    cycle = SimpleNamespace(project=SimpleNamespace(requirements="requirements.txt"),
                            edit=SimpleNamespace(allowlist=("src/*",)))

    def read() -> None:
        with pytest.raises(ConfigError, match=r"requirements\.txt.*bytes"):
            _agent_requirements(cast(Any, cycle), path, tree, "cycle.yaml")
    assert _peak(read) < BIG // 4
    assert gitops.read_blob(path, tree, "small.txt") == b"ok\n"   # the reader is in step


def test_read_blob_caps_every_read(repo: tuple[Path, str]) -> None:
    path, tree = repo
    with pytest.raises(ConfigError, match="at most 1024"):
        gitops.read_blob(path, tree, "requirements.txt", max_bytes=1024)
    assert gitops.read_blob(path, tree, "small.txt") == b"ok\n"   # the reader is in step

    def default() -> None:
        with pytest.raises(ConfigError, match=r"requirements\.txt"):
            gitops.read_blob(path, tree, "requirements.txt")
    assert _peak(default) < BIG // 4


def test_export_streams_and_caps_the_tree(repo: tuple[Path, str], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's tree is exported for its container: a zero blob that is tiny in git
    was a whole ``git archive`` held in host memory, and a tree of any expanded size
    was written out (a disk-filling bomb)."""
    path, tree = repo
    monkeypatch.setattr(gitops, "MAX_EXPORT_BYTES", BIG * 2, raising=False)
    assert _peak(lambda: gitops.export_tree(path, tree, tmp_path / "a")) < BIG // 4
    assert (tmp_path / "a" / "requirements.txt").stat().st_size == BIG
    monkeypatch.setattr(gitops, "MAX_EXPORT_BYTES", BIG - 1, raising=False)
    with pytest.raises(ConfigError, match=r"more than \d+ bytes"):
        gitops.export_tree(path, tree, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_revisions_a_repository_answers_oddly_are_bad_input(tmp_path: Path) -> None:
    """A dangling HEAD read through its reflog (``HEAD@{0}``) raised a gitdb error whose
    str() itself raises (TypeError: exit 10); a revision only ``git rev-parse`` resolves
    (``:/text``) was an IntegrityError. Both are an operator's ref that does not resolve."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, env=ENV)
    (tmp_path / "f").write_text("x\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "f"], check=True, env=ENV)
    subprocess.run(["git", "-C", str(tmp_path), "commit", "-qm", "m"], check=True, env=ENV)
    for ref in (":/m", "HEAD^{/m}"):
        with pytest.raises(ConfigError, match="does not resolve"):
            gitops.head_tree(tmp_path, ref)
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/nowhere\n")
    for ref in ("HEAD@{0}", "HEAD"):
        with pytest.raises(ConfigError, match="does not resolve"):
            gitops.head_tree(tmp_path, ref)
        with pytest.raises(ConfigError, match="does not resolve"):
            gitops.rev(tmp_path, ref)


@pytest.fixture()
def armed(tmp_path: Path) -> tuple[Path, Path]:
    """A repository whose own .git/config names commands (core.fsmonitor, a filter's
    clean and smudge) and whose committed .gitattributes selects that filter: git runs
    them from ``git status`` and ``git archive``. Returns (repo, marker directory)."""
    repo, marks = tmp_path / "repo", tmp_path / "marks"
    marks.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=ENV)
    (repo / "f").write_text("x\n")
    (repo / ".gitattributes").write_text("f filter=x\n")
    (repo / ".gitignore").write_text("ignored.txt\n")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, env=ENV)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", "m"], check=True, env=ENV)
    for key, name in (("core.fsmonitor", "fsmonitor"), ("filter.x.clean", "clean"),
                      ("filter.x.smudge", "smudge"), ("filter.x.process", "process")):
        cmd = f"sh -c 'touch {marks / name}; cat'" if name != "fsmonitor" else \
            f"touch {marks / name}; false"
        subprocess.run(["git", "-C", str(repo), "config", key, cmd], check=True, env=ENV)
    (repo / "f").write_text("y\n")              # modified: status hashes it (clean filter)
    (repo / "new.txt").write_text("n\n")
    (repo / "ignored.txt").write_text("i\n")
    return repo, marks


def test_status_runs_no_command_the_repository_configures(armed: tuple[Path, Path]) -> None:
    repo, marks = armed
    rows = gitops.uncommitted(repo)
    assert sorted(os.listdir(marks)) == [], "git status ran the repository's commands"
    assert ("M", "f") in rows and ("??", "new.txt") in rows
    assert not any(p == "ignored.txt" for _, p in rows)


def test_export_runs_no_command_the_repository_configures(armed: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    repo, marks = armed
    tree = gitops.head_tree(repo)
    gitops.export_tree(repo, tree, tmp_path / "export")
    assert sorted(os.listdir(marks)) == [], "git archive ran the repository's commands"
    assert (tmp_path / "export" / "f").read_text() == "x\n"


def test_check_export_names_a_mode_that_differs(tmp_path: Path) -> None:
    """helper-41 F2: the export check compared blob ids only, so a file exported with
    its executable bit flipped passed: the candidate would not run the tree committed."""
    repo = tmp_path / "r"
    (repo / "p").mkdir(parents=True)
    (repo / "p" / "a.md").write_text("a\n")
    (repo / "p" / "run.sh").write_text("#!/bin/sh\n")
    (repo / "p" / "run.sh").chmod(0o755)
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=ENV)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, env=ENV)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", "m"], check=True, env=ENV)
    tree = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD^{tree}"], check=True,
                          env=ENV, capture_output=True, text=True).stdout.strip()
    out = tmp_path / "export"
    gitops.export_tree(repo, tree, out)
    assert gitops.check_export(repo, tree, out) == []
    (out / "p" / "a.md").chmod(0o755)
    (out / "p" / "run.sh").chmod(0o644)
    assert gitops.check_export(repo, tree, out) == [
        "p/a.md: exported as mode 100755, committed as 100644",
        "p/run.sh: exported as mode 100644, committed as 100755"]
