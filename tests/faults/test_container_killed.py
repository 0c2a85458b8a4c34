"""`docker kill` of a role container right after it starts (real engine).

Someone (an operator, a watchdog) kills the container while the controller is still
setting it up: before or while it seeds the output directory, before the holder's
readiness marker arrives, or just as the role command starts. Expect a run that ended,
named: stop reason ``process_failed``, exit 137 and a detail naming the outside kill
(SIGKILL), within a few seconds, and no container left. Through `cycle run` (the apply
container killed): verdict ``invalid_comparison`` whose reason names the kill, exit 2,
a receipt. Before the fix: SandboxError ("holder did not protect its output stream",
"could not seed the apply output directory") after up to 10 s, exit 6.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import docker
import pytest

from runner.isolation.docker.images import resolve_image
from runner.isolation.launcher import launch, output_dir
from runner.isolation.policy import RolePolicies
from runner.isolation.sandbox import StopReason
from tests.fixtures.cycle_project import (
    cli_env,
    example_agent,
    project_with_agent,
    run_cli,
    run_containers,
    run_id,
    start_cycle,
    verdict,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]
PROMPT_S = 5.0


def _killer(match: Callable[[dict[str, str]], bool], delay: float) -> list[str]:
    """Kill the first running container whose labels match, ``delay`` s after it shows."""
    client = docker.from_env()
    killed: list[str] = []

    def watch() -> None:
        # long enough for a whole cycle to reach its apply stage on a loaded machine (a
        # CI run with the suite beside it took over 300 s to get there: never killed)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not killed:
            for c in client.containers.list(filters={"label": "io.cyclebox.managed"}):
                if match(c.labels):
                    time.sleep(delay)
                    c.kill()
                    killed.append(c.name)
                    return
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    return killed


@pytest.mark.parametrize("seeded", [False, True], ids=["plain", "seeded"])
@pytest.mark.parametrize("delay", [0.0, 0.1, 0.4])
def test_killed_right_after_start_is_a_named_run(seeded: bool, delay: float, backend: object,
                                                 policies: RolePolicies, tmp_path: Path,
                                                 request: pytest.FixtureRequest) -> None:
    policy = policies.roles["analyst"]
    rid = f"test-kill-{request.node.name[-24:]}".replace("[", "-").replace("]", "")
    out = output_dir(policy, tmp_path / "out")
    if seeded:  # the apply stage seeds its output directory like this
        (out / "seeded.txt").write_text("seed")
    killed = _killer(lambda labels: labels.get("io.cyclebox.run_id") == rid, delay)
    t0 = time.monotonic()
    rec = launch(backend, policy, role="analyst", run_id=rid,  # type: ignore[arg-type]
                 image=resolve_image("analyst"), command=["python", "-c",
                                                          "import time; time.sleep(30)"],
                 mounts=[], output_dir=out)
    elapsed = time.monotonic() - t0
    assert killed, "the container was never seen running"
    assert rec.stop_reason is StopReason.PROCESS_FAILED, rec
    assert "killed from outside" in rec.detail and "SIGKILL" in rec.detail, rec.detail
    assert rec.exit_code == 137, rec
    assert elapsed < PROMPT_S + 2, f"{elapsed:.1f}s: {rec}"
    assert rec.cleanup_confirmed
    assert run_containers(rid) == []


def test_apply_container_killed_gives_invalid_comparison(tmp_path: Path) -> None:
    cycle = project_with_agent(tmp_path / "cyc", example_agent())
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = cli_env(tmp)
    run = tmp_path / "run"
    proc = start_cycle(cycle, run, env)
    wait_for((run / "plan.json").is_file, proc, "the plan frozen")
    rid = run_id(run)
    killed = _killer(lambda labels: labels.get("io.cyclebox.run_id") == rid
                     and labels.get("io.cyclebox.role") == "apply", 0.0)
    out, err = proc.communicate(timeout=600)
    detail = f"rc {proc.returncode}\n{out}\n{err}"
    assert killed, detail
    assert proc.returncode == 2, detail
    assert "Traceback" not in err, detail
    v = verdict(run)
    assert v["verdict"] == "invalid_comparison", v
    assert any("killed from outside" in r and "SIGKILL" in r for r in v["reasons"]), v
    res = run_cli("receipt", "verify", str(run), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert run_containers(rid) == []
