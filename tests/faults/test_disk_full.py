"""Disk full under the run directory: a small tmpfs mounted as `--out`'s parent.

The tmpfs holds the frozen plan and inputs and a little more, so the disk fills while
the baseline writes its cases. Expect: exit 9 naming `environment_failure`, no
traceback, and nothing that claims success: `cyclebox receipt verify` fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.cycle_project import cli_env, example_agent, project_with_agent, run_cli

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _du(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*"))


@pytest.fixture
def small_disk(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_baseline_exits_9_and_never_verifies(tmp_path: Path,
                                                              small_disk: Path) -> None:
    cycle = project_with_agent(tmp_path / "cyc", example_agent())
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = cli_env(tmp)
    probe = tmp_path / "probe"
    res = run_cli("cycle", "run", str(cycle), "--out", str(probe), "--prepare-only", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    frozen = _du(probe)
    shutil.rmtree(probe)
    # the frozen plan fits, with room for a few cases; tmpfs counts whole pages
    size_kb = (frozen // 1024) + 64
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k,mode=0755", "tmpfs",
                    str(small_disk)], check=True)
    run = small_disk / "run"
    res = run_cli("cycle", "run", str(cycle), "--out", str(run), env=env)
    detail = f"rc {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert res.returncode == 9, detail
    assert "environment_failure" in res.stderr, detail
    assert "Traceback" not in res.stderr, detail
    assert not (run / "receipt.json").exists(), detail
    ver = run_cli("receipt", "verify", str(run), env=env)
    assert ver.returncode != 0, ver.stdout + ver.stderr
