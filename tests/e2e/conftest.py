"""One accepted demo run for the whole e2e session: tests/e2e/test_cycle.py and
tests/e2e/test_attest.py read it (a cycle takes about a minute on this machine); a test
that must change it works on a copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runner.paths import PROJECT_ROOT

CLI = str(Path(sys.executable).with_name("cyclebox"))


@pytest.fixture(scope="session")
def shop_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    run = tmp_path_factory.mktemp("demo") / "run"
    res = subprocess.run([CLI, "cycle", "run",
                          str(PROJECT_ROOT / "examples" / "shop-analyst" / "cycle.yaml"),
                          "--out", str(run), "--json"], capture_output=True, text=True,
                         timeout=600, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    return run, json.loads(res.stdout)
