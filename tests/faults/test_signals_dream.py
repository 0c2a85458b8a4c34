"""SIGINT and SIGTERM during `cyclebox dream compare` (real engine, CLI).

The compare runs two arms (dream off, then on) under one --out. A signal in either arm
must end the command with exit 130 within the spec's 10 s: the interrupted arm keeps its
verdict (`interrupted`) and a receipt that verifies, the other arm never starts (or is
the one interrupted), no dream receipt is written, and no container, gateway socket
directory or temporary file is left. Before the fix the off arm ended interrupted and
the on arm then ran in full: exit 0 with a dream receipt.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.cycle_project import (
    EXAMPLE,
    cli_env,
    example_agent,
    project_with_agent,
    run_cli,
    run_containers,
    run_id,
    signal_and_wait,
    stage_started,
    verdict,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

EXIT_BOUND_S = 10.0
CLI = str(Path(sys.executable).with_name("cyclebox"))
# the example's baseline agent, slowed so that a signal lands mid-stage
SLOW = "import time as _t\n_t.sleep(100)\n"


def _dream_cycle(root: Path) -> Path:
    agent = example_agent().replace("from __future__ import annotations\n",
                                    "from __future__ import annotations\n" + SLOW, 1)
    cyc = project_with_agent(root, agent)
    doc = yaml.safe_load(cyc.read_text())
    dream = yaml.safe_load((EXAMPLE / "cycle-dream.yaml").read_text())
    doc["dream"] = dream["dream"]
    doc["upstreams"]["optimizer"]["script"] = str(EXAMPLE / "scripts" / "optimizer.yaml")
    cyc.write_text(yaml.safe_dump(doc))
    return cyc


@pytest.mark.parametrize("sig_name", ["SIGINT", "SIGTERM"])
def test_signal_in_the_off_arm_ends_the_compare(sig_name: str, tmp_path: Path) -> None:
    cyc = _dream_cycle(tmp_path / "cyc")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = cli_env(tmp)
    out = tmp_path / "paired"
    proc = subprocess.Popen([CLI, "dream", "compare", str(cyc), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    off = out / "off"
    wait_for(lambda: stage_started(off, "baseline"), proc, "the off arm's baseline started")
    rid = run_id(off)
    elapsed, stdout, err = signal_and_wait(proc, getattr(signal, sig_name))
    detail = f"rc {proc.returncode} after {elapsed:.1f}s\n{stdout}\n{err}"

    assert elapsed < EXIT_BOUND_S, detail
    assert proc.returncode == 130, detail
    assert "Traceback" not in err, detail
    assert not (out / "dream-receipt.json").exists(), detail
    assert not (out / "on").exists(), detail  # the on arm never started
    assert verdict(off)["reasons"] == ["interrupted"], detail
    res = run_cli("receipt", "verify", str(off), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert run_containers(rid) == [], detail
    left = [p for p in tmp.iterdir()
            if not (p.name.startswith("cyclebox-staging-") and not any(p.iterdir()))]
    assert left == [], f"left in TMPDIR: {left}"
