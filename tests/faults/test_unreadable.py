"""Inputs the operator cannot read, through the installed ``cyclebox`` executable.

Root reads any file whatever its mode, so each command runs without the capabilities
that let it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH dropped from the bounding set by
``setpriv``): a file of mode 000 is then unreadable, as for any other user. Expect exit 3,
a first line naming the file and the field, no traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.paths import PROJECT_ROOT

CLI = str(Path(sys.executable).with_name("cyclebox"))
TEMPLATE = PROJECT_ROOT / "runner" / "project" / "template"


def _as_unprivileged(*args: str) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.fail("needs root and setpriv (util-linux) to drop the file-reading capabilities")
    return subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                           CLI, *args], capture_output=True, text=True, timeout=120,
                          check=False)


def test_manifest_build_with_an_unreadable_store_names_it(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    shutil.copytree(TEMPLATE / "data", proj / "data")
    (proj / "scenarios.yaml").write_text(
        (TEMPLATE / "scenarios.yaml").read_text().replace("__NAME__", "proj"))
    stores = [p for p in (proj / "data").iterdir() if p.is_file()]
    assert stores
    for p in stores:
        p.chmod(0)
    out = tmp_path / "manifest.json"
    res = _as_unprivileged("manifest", "build", "--scenarios", str(proj / "scenarios.yaml"),
                           "--data", str(proj / "data"), "--out", str(out))
    detail = f"rc {res.returncode}\n{res.stderr}"
    assert res.returncode == 3, detail
    assert "Traceback" not in res.stderr, detail
    first = res.stderr.splitlines()[0]
    assert "scenarios.yaml" in first and "stores." in first, first
    assert "cannot be read" in first and "Permission denied" in first, first
    assert not out.exists()


def test_manifest_check_with_an_unreadable_store_names_it(tmp_path: Path) -> None:
    m = tmp_path / "m"
    (m / "data").mkdir(parents=True)
    ex = PROJECT_ROOT / "examples" / "shop-analyst"
    shutil.copy2(ex / "manifest.json", m / "manifest.json")
    shutil.copy2(ex / "data" / "shop.sqlite", m / "data" / "shop.sqlite")
    (m / "data" / "shop.sqlite").chmod(0)
    res = _as_unprivileged("manifest", "check", str(m / "manifest.json"))
    detail = f"rc {res.returncode}\n{res.stderr}"
    assert res.returncode == 3, detail
    assert "Traceback" not in res.stderr, detail
    first = res.stderr.splitlines()[0]
    assert "stores.shop.path" in first and "shop.sqlite" in first, first
