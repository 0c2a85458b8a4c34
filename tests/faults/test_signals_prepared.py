"""SIGINT mid-baseline while the next cases' containers are prepared ahead (real engine, CLI).

The example cycle at ``concurrency: 1`` with a baseline agent that sleeps: while one case
runs, the look-ahead holds the next one prepared. After SIGINT the controller exits 130
with an ``interrupted`` verdict and the engine knows no container labelled with the run
id (``docker ps -a --filter label=io.cyclebox.run_id=RUN``): neither the running one nor
the prepared ones. A second run at ``concurrency: auto`` checks the same.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fixtures.cycle_project import (
    cli_env,
    example_agent,
    project_with_agent,
    run_id,
    signal_and_wait,
    start_cycle,
    verdict,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

SLOW_AGENT = '''
import time as _t
_t.sleep(3)  # every case: long enough that the next one waits prepared
'''


def labelled(rid: str) -> list[str]:
    """``docker ps -a`` for the run's label, as an operator would ask the engine."""
    out = subprocess.run(["docker", "ps", "-a", "--format", "{{.Names}}",
                          "--filter", f"label=io.cyclebox.run_id={rid}"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return out.split()


def cases_begun(run: Path) -> int:
    d = run / "stages" / "baseline" / "cases"
    return len(list(d.iterdir())) if d.is_dir() else 0


@pytest.mark.parametrize("concurrency", [1, "auto"])
def test_sigint_mid_stage_leaves_no_container(tmp_path: Path, concurrency: int | str) -> None:
    agent = example_agent().replace("from __future__ import annotations\n",
                                    "from __future__ import annotations\n" + SLOW_AGENT, 1)
    cycle = project_with_agent(tmp_path / "cyc", agent)
    doc = yaml.safe_load(cycle.read_text())
    doc["concurrency"] = concurrency
    cycle.write_text(yaml.safe_dump(doc))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = cli_env(tmp)
    run = tmp_path / "run"
    proc = start_cycle(cycle, run, env)
    # a case directory is made when its container is prepared: two or more means one runs
    # while the next waits (or was just handed over)
    wait_for(lambda: cases_begun(run) >= 3, proc, "the third baseline case prepared")
    rid = run_id(run)
    elapsed, out, err = signal_and_wait(proc, signal.SIGINT)
    detail = f"rc {proc.returncode} after {elapsed:.1f}s\n{out}\n{err}"
    assert proc.returncode == 130, detail
    assert verdict(run)["reasons"] == ["interrupted"], detail
    assert labelled(rid) == [], detail
    rows = [json.loads(x) for x in (run / "containers.jsonl").read_text().splitlines()]
    assert len({r["container_name"] for r in rows}) == len(rows)  # none ran twice
    assert all(r["cleanup_confirmed"] for r in rows), rows
