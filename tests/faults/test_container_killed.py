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


def _killer(labels: dict[str, str], delay: float, *, event: str = "start",
            remove: bool = False) -> list[str]:
    """Kill the first container with ``labels`` ``delay`` s after the engine reports its
    start. Driven by the engine's event stream, not by listing: a list (one inspect per
    container) on a loaded engine took longer than the apply container lived, and the
    kill never happened (the cycle then ended normally, rc 0)."""
    client = docker.from_env()
    killed: list[str] = []
    flt = {"type": "container", "event": event,
           "label": [f"{k}={v}" for k, v in labels.items()]}
    events = client.events(decode=True, filters=flt,
                           until=time.time() + 900)  # a whole cycle, on a loaded machine

    def watch() -> None:
        for ev in events:
            time.sleep(delay)
            cid = ev.get("id") or ev.get("Actor", {}).get("ID")
            try:
                if remove:
                    client.api.remove_container(cid, force=True)
                else:
                    client.api.kill(cid)
            except docker.errors.APIError:
                continue  # gone already (it ended by itself): wait for the next
            killed.append(ev.get("Actor", {}).get("Attributes", {}).get("name", cid))
            events.close()
            return

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
    killed = _killer({"io.cyclebox.run_id": rid}, delay)
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
    killed = _killer({"io.cyclebox.run_id": rid, "io.cyclebox.role": "apply"}, 0.0)
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


@pytest.mark.parametrize("event", ["create", "start"])
def test_a_container_removed_while_it_is_prepared_is_a_named_run(
        event: str, backend: object, policies: RolePolicies, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """`docker rm -f` as the container is created or started, before its holder is ready:
    the engine's 404 ended the run as "engine could not start the analyst container"
    (SandboxError: the cycle ends engine_error, exit 6). Now a run that ended, named."""
    policy = policies.roles["analyst"]
    rid = f"test-rmp-{request.node.name[-20:]}".replace("[", "-").replace("]", "")
    out = output_dir(policy, tmp_path / "out")
    removed = _killer({"io.cyclebox.run_id": rid}, 0.0, event=event, remove=True)
    time.sleep(0.3)  # the event stream is open
    rec = launch(backend, policy, role="analyst", run_id=rid,  # type: ignore[arg-type]
                 image=resolve_image("analyst"), command=["python", "-c", "print('never')"],
                 mounts=[], output_dir=out)
    assert removed, "the container was never seen"
    assert rec.stop_reason is StopReason.PROCESS_FAILED, rec
    # named as removed, or as the kill `rm -f` begins with when it found it running
    assert "from outside the controller" in rec.detail, rec.detail
    assert run_containers(rid) == []


def test_a_prepared_container_removed_from_outside_is_a_named_run(
        backend: object, policies: RolePolicies, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """`docker rm -f` of a container prepared ahead, before its case is handed over: the
    engine's inspect then answers 404, which escaped the run (the cycle ended exit 6,
    ``engine_error: NotFound``, and the case had no row). Now a run that ended, named."""
    from runner.isolation.roles import role_spec

    policy = policies.roles["analyst"]
    rid = f"test-rm-{request.node.name[-20:]}"
    out = output_dir(policy, tmp_path / "out")
    spec = role_spec(policy, role="analyst", run_id=rid, image=resolve_image("analyst"),
                     command=["python", "-c", "print('never')"], output_dir=out)
    prepared = backend.prepare(spec)  # type: ignore[attr-defined]
    docker.from_env().api.remove_container(prepared.cid, force=True)
    rec = prepared.run()
    assert rec.stop_reason is StopReason.PROCESS_FAILED, rec
    assert "removed from outside the controller" in rec.detail, rec.detail
    assert rec.cleanup_confirmed
    assert run_containers(rid) == []


_ORPHAN = """
import os, sys, threading
from pathlib import Path
from runner.isolation.docker.images import resolve_image
from runner.isolation.launcher import output_dir
from runner.isolation.policy import load_policies
from runner.isolation.registry import get_sandbox
from runner.isolation.roles import role_spec
from runner.paths import default_policies
policy = load_policies(default_policies()).roles["analyst"]
out = output_dir(policy, Path({out!r}))
spec = role_spec(policy, role="analyst", run_id={rid!r}, image=resolve_image("analyst"),
                 command={command!r}, output_dir=out)
prepared = get_sandbox("docker").prepare(spec)
if {hand_over!r}:
    threading.Thread(target=prepared.run, daemon=True).start()
    assert prepared.channel.started.wait(60), "the case never started"
print(prepared.cid, flush=True)
os._exit(0)
"""


def _orphan_ends(tmp_path: Path, rid: str, command: list[str], *, hand_over: bool) -> None:
    """A controller process prepares a container (and with ``hand_over`` starts its
    case), prints its id and dies at once (``os._exit``): the container must end by
    itself within 20 s."""
    import subprocess
    import sys

    script = _ORPHAN.format(out=str(tmp_path / "out"), rid=rid, command=command,
                            hand_over=hand_over)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    cid = res.stdout.strip()
    client = docker.from_env()
    try:
        deadline = time.monotonic() + 20
        while client.api.inspect_container(cid)["State"]["Running"]:
            assert time.monotonic() < deadline, "the orphaned container is still up"
            time.sleep(0.2)
    finally:
        client.api.remove_container(cid, force=True)


def test_a_prepared_container_ends_when_its_controller_dies(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A controller that dies (SIGKILL, a second signal's fast exit) before it hands a
    prepared container its case: the engine closes the holder's stdin when the attach
    ends (``StdinOnce``), and the holder, with no case, ends. It stayed up, waiting for a
    case that never came, until someone ran `cyclebox gc`."""
    _orphan_ends(tmp_path, f"test-orphan-{request.node.name[-12:]}",
                 ["python", "-c", "print('never')"], hand_over=False)


def test_a_running_case_ends_when_its_controller_dies(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A controller that dies (SIGKILL, a second signal's fast exit) after it handed the
    case over: the engine closes the holder's stdin when the attach ends, and the holder
    ends the case (kills every role process) and the container. The command ran on for
    nobody, calling the model for nothing, until its own end or its timeout (this one
    sleeps 300 s; the container stayed up past the 20 s allowed here)."""
    _orphan_ends(tmp_path, f"test-orphan-run-{request.node.name[-8:]}",
                 ["python", "-c", "import time; time.sleep(300)"], hand_over=True)


def test_the_controllers_own_sweep_is_not_called_an_outside_kill(
        backend: object, policies: RolePolicies, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """An interrupted run kills and removes its running containers itself; a case thread
    that saw its container die before it saw the stop named the kill "from outside the
    controller (e.g. docker kill)". With the run stopping, the kill is the run's own."""
    from runner.isolation.roles import role_spec

    policy = policies.roles["analyst"]
    rid = f"test-sweep-{request.node.name[-12:]}"
    out = output_dir(policy, tmp_path / "out")
    spec = role_spec(policy, role="analyst", run_id=rid, image=resolve_image("analyst"),
                     command=["python", "-c", "import time; time.sleep(60)"],
                     output_dir=out)
    prepared = backend.prepare(spec)  # type: ignore[attr-defined]
    stop = threading.Event()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(prepared.run(cancel=stop)))
    t.start()
    time.sleep(1.5)
    client = docker.from_env()
    stop.set()  # the run stops, then sweeps (runner.cycle.run._stop_containers)
    client.api.remove_container(prepared.cid, force=True)
    t.join(60)
    rec = got[0]
    assert "from outside" not in rec.detail, rec  # type: ignore[attr-defined]
    assert run_containers(rid) == []
