"""A full disk under git's writes (apply's throwaway repository and its bare clone).

git reports the errno only as text, so without care its failure looked like bad input
(ConfigError, exit 3; exit 2 inside a cycle). Expect an EnvironmentFailure (exit 9) that
names the git command and git's own line. A small tmpfs stands in for the full disk.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner import gitops
from runner.errors import EXIT_ENVIRONMENT, EnvironmentFailure
from runner.failures import classify


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mnt)],
                   check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _repo(root: Path, megabytes: int, branch: str = "main") -> Path:
    """A repository with one incompressible file of ``megabytes`` MB, committed."""
    root.mkdir()
    (root / "big.bin").write_bytes(os.urandom(megabytes << 20))
    gitops.init_fixed(root, "base")
    subprocess.run(["git", "-C", str(root), "branch", "-M", branch], check=True)
    return root


def _assert_environment(exc: BaseException, command: str) -> None:
    assert isinstance(exc, EnvironmentFailure), repr(exc)
    assert classify(exc).exit_code == EXIT_ENVIRONMENT
    text = str(exc)
    assert f"git {command}" in text and "No space left on device" in text, text


def test_bare_clone_on_a_full_disk_is_an_environment_failure(tmp_path: Path,
                                                             small_disk: Path) -> None:
    src = _repo(tmp_path / "src", 4, branch="cyclebox/candidate")
    with pytest.raises(Exception) as info:
        gitops.clone_bare_untrusted(src, small_disk / "candidate.git",
                                    branch="cyclebox/candidate")
    _assert_environment(info.value, "-c protocol.file.allow=always clone")


def test_throwaway_repo_on_a_full_disk_is_an_environment_failure(tmp_path: Path,
                                                                 small_disk: Path) -> None:
    # 1.5 MB extracts (the tree fits), then git add needs as much again for its object
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(1536 << 10))
    gitops.init_fixed(src, "base")
    tree = gitops.head_tree(src)
    with pytest.raises(Exception) as info:
        gitops.throwaway_repo(src, tree, small_disk / "repo")
    exc = info.value
    assert classify(exc).exit_code == EXIT_ENVIRONMENT, repr(exc)
    assert "No space left on device" in str(exc), repr(exc)
