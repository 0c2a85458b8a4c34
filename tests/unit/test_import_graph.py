"""The host's import graph has no circle (grimp, the graph import-linter is built on)."""

from __future__ import annotations

import subprocess
import sys

import grimp


def test_no_module_imports_itself_through_another() -> None:
    graph = grimp.build_graph("runner", "sandbox")
    circles = sorted((m, i) for m in graph.modules
                     for i in graph.find_modules_directly_imported_by(m)
                     if graph.chain_exists(importer=i, imported=m))
    assert circles == []


def test_the_pure_receipt_code_loads_no_engine_or_gateway() -> None:
    """``import runner.cycle.receipt`` (verify, compare) loads neither Docker's client,
    nor the gateway server, nor the stage runner: checked in a fresh interpreter."""
    code = ("import sys, runner.cycle.receipt\n"
            "print(' '.join(m for m in ('docker', 'git', 'runner.gateway.server', "
            "'runner.cycle.run', 'runner.isolation.docker.backend') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ""
