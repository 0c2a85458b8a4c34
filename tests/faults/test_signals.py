"""SIGTERM, SIGINT and SIGKILL at each stage of `cyclebox cycle run` (real engine, CLI).

Expect: 0 containers with the run's label (after `cyclebox gc` for SIGKILL), 0 gateway
socket directories and 0 temporary files left (the CLI gets a private TMPDIR; the
state directory is compared before and after), exit within the spec's 10 s, and for
SIGTERM/SIGINT verdict.json says `interrupted`, exit 130 and `receipt verify` passes.

Every signal at every stage (5 x 3). The stages between baseline and candidate take
about a second, so a signal aimed at one may land early in the next; the assertions
hold either way. The candidate's agent sleeps (it sees the edited prompt), so a signal
there always lands mid-stage. A last test sends SIGINT
while a model call hangs on a slow OpenAI-compatible upstream (a local server).
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runner.paths import PROJECT_ROOT, state_dir
from tests.fixtures.cycle_project import (
    EXAMPLE,
    SIGNALS,
    SLOW_KEY_ENV,
    cli_env,
    example_agent,
    project_with_agent,
    run_cli,
    run_containers,
    run_id,
    signal_and_wait,
    stage_started,
    start_cycle,
    upstream_at,
    verdict,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

EXIT_BOUND_S = 10.0  # SPEC bound for a signal to end the controller, not a benchmark

BASE_PROMPT_SHA = hashlib.sha256(
    (EXAMPLE / "project" / "prompts" / "system.md").read_bytes()).hexdigest()
SLOW_CANDIDATE = f'''
import hashlib as _h, time as _t
from pathlib import Path as _P
if _h.sha256(_P("/src/prompts/system.md").read_bytes()).hexdigest() != "{BASE_PROMPT_SHA}":
    _t.sleep(100)  # the candidate: stay in the stage until the signal comes
'''

STAGES = ("baseline", "evaluate-baseline", "propose", "apply", "candidate")
CASES = [(stage, sig) for stage in STAGES for sig in ("SIGTERM", "SIGINT", "SIGKILL")]


def _state_files() -> set[str]:
    root = state_dir()
    return {str(p.relative_to(root)) for p in root.glob("*")} | \
        {str(p.relative_to(root)) for p in (root / "logs").glob("*")}


@pytest.mark.parametrize(("stage", "sig_name"), CASES)
def test_signal_at_stage_leaves_nothing(stage: str, sig_name: str, tmp_path: Path) -> None:
    agent = example_agent().replace("from __future__ import annotations\n",
                                    "from __future__ import annotations\n" + SLOW_CANDIDATE, 1)
    cycle = project_with_agent(tmp_path / "cyc", agent)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = cli_env(tmp)
    run = tmp_path / "run"
    before = _state_files()
    proc = start_cycle(cycle, run, env)
    wait_for(lambda: stage_started(run, stage), proc, f"stage {stage} started")
    rid = run_id(run)
    elapsed, out, err = signal_and_wait(proc, SIGNALS[sig_name])
    detail = f"rc {proc.returncode} after {elapsed:.1f}s\n{out}\n{err}"

    assert elapsed < EXIT_BOUND_S, detail
    if sig_name == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL, detail
        gc = run_cli("gc", env=env)
        assert gc.returncode == 0, gc.stdout + gc.stderr
    else:
        assert proc.returncode == 130, detail
        assert "Traceback" not in err, detail
        assert verdict(run)["verdict"] == "invalid_comparison"
        assert verdict(run)["reasons"] == ["interrupted"], detail
        res = run_cli("receipt", "verify", str(run), env=env)
        assert res.returncode == 0, res.stdout + res.stderr
    assert run_containers(rid) == [], detail
    # the shared staging base (cyclebox-staging-<uid>) may stay, empty; nothing in it
    left = [p for p in tmp.iterdir()
            if not (p.name.startswith("cyclebox-staging-") and not any(p.iterdir()))]
    assert left == [], f"left in TMPDIR: {left} {list(tmp.rglob('*'))[:10]}"
    assert _state_files() == before, "new files in the state directory"
    assert not list(run.rglob("*.gitconfig")) or sig_name == "SIGKILL"
    assert PROJECT_ROOT.exists()


class _SlowModel(BaseHTTPRequestHandler):
    """An OpenAI-compatible upstream that never answers in time."""

    release = threading.Event()
    received = threading.Event()

    def log_message(self, *_args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.received.set()
        self.release.wait(120)
        with contextlib.suppress(OSError):
            self.send_response(503)
            self.end_headers()


def test_sigint_during_slow_model_call_exits_promptly(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowModel)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cyc = project_with_agent(tmp_path / "cyc", example_agent())
        upstream_at(cyc, "target", server.server_port)
        tmp = tmp_path / "tmp"
        tmp.mkdir()
        env = cli_env(tmp, **{SLOW_KEY_ENV: "not-a-real-key"})
        run = tmp_path / "run"
        proc = start_cycle(cyc, run, env)
        # a model call is in flight (the upstream holds it) when the signal comes
        wait_for(_SlowModel.received.is_set, proc, "a model call in flight", timeout=120)
        rid = run_id(run)
        elapsed, out, err = signal_and_wait(proc, signal.SIGINT)
    finally:
        _SlowModel.release.set()
        server.shutdown()
    detail = f"rc {proc.returncode} after {elapsed:.1f}s\n{out}\n{err}"
    assert elapsed < EXIT_BOUND_S, detail
    assert proc.returncode == 130, detail
    assert verdict(run)["reasons"] == ["interrupted"]
    assert run_containers(rid) == []
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("trial", range(3))
def test_a_signal_as_the_run_begins_leaves_a_verdict_or_a_runnable_plan(
        trial: int, tmp_path: Path) -> None:
    """SIGINT the moment the run's first file appears, while the gateway starts: the
    signal landed after stages/ was made and before the path that writes a verdict, and
    left an empty stages/ (no verdict, no receipt, the plan refused as already executed).
    Now the gateway starts first: either the plan can still run, or every way out wrote
    a verdict and a receipt."""
    import os
    import time

    cycle = project_with_agent(tmp_path / "cyc", example_agent())
    run = tmp_path / "run"
    env = cli_env(tmp_path)
    proc = start_cycle(cycle, run, env)
    deadline = time.monotonic() + 120
    while not (run / "gateway").exists() and not (run / "stages").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "never started"
        time.sleep(0.001)
    time.sleep(0.01 * trial)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    detail = f"rc {proc.returncode}\n{out}\n{err}"
    assert proc.returncode in (0, 130), detail
    if (run / "stages").exists():
        assert (run / "stages" / "compare" / "verdict.json").is_file(), detail
        assert (run / "receipt.json").is_file(), detail
    else:  # nothing started: the plan runs
        res = run_cli("cycle", "run", "--plan", str(run / "plan.json"), env=env)
        assert res.returncode == 0, res.stdout + res.stderr


def test_a_second_signal_leaves_a_note_and_no_container_up(tmp_path: Path) -> None:
    """Two signals at once mid-baseline: the controller exits at once (no verdict, no
    receipt: documented), but it says so in the run directory, and the containers it had
    prepared ahead end by themselves (their stdin closes with the controller): one
    stayed up, waiting for a case, until `cyclebox gc`."""
    import os
    import time

    import docker

    cycle = project_with_agent(tmp_path / "cyc", example_agent())
    run = tmp_path / "run"
    env = cli_env(tmp_path)
    proc = start_cycle(cycle, run, env)
    try:
        wait_for(lambda: stage_started(run, "baseline"), proc, "baseline started")
        rid = run_id(run)
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "second signal" in (run / "cut-short.txt").read_text()
    client = docker.from_env()
    deadline = time.monotonic() + 30
    try:
        while True:
            up = [c.name for c in client.containers.list(
                filters={"label": f"io.cyclebox.run_id={rid}"})]  # running only
            if not up:
                break
            assert time.monotonic() < deadline, f"still up: {up}"
            time.sleep(0.5)
    finally:
        real = dict(env)
        assert run_cli("gc", env=real).returncode == 0
    assert run_containers(rid) == []
