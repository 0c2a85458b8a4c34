"""The sandbox seam holds: the cycle and training see only the Sandbox protocol."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from runner.paths import PROJECT_ROOT

BEHIND_THE_SEAM = ("runner/cycle", "runner/train")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_cycle_and_training_never_import_a_backend() -> None:
    offenders = {str(p.relative_to(PROJECT_ROOT)): sorted(
        n for n in _imports(p) if n == "docker" or n.startswith(("docker.",
                                                                  "runner.isolation.docker")))
        for d in BEHIND_THE_SEAM for p in sorted((PROJECT_ROOT / d).rglob("*.py"))}
    assert {p: n for p, n in offenders.items() if n} == {}


def test_pure_modules_load_no_docker() -> None:
    code = ("import sys, runner.cycle.receipt, runner.cycle.run, runner.train.host, "
            "runner.isolation.registry, runner.isolation.launcher; "
            "print([m for m in sys.modules if m == 'docker' or m.startswith('docker.') "
            "or m.startswith('runner.isolation.docker')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PROJECT_ROOT, timeout=60).stdout
    assert out.strip() == "[]"
