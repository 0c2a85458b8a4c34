"""The engine cut mid-baseline: a byte relay in front of the real engine's socket is
given to the CLI as DOCKER_HOST and killed while the baseline runs. The shared engine
is never stopped.

Expect: exit 6, a verdict naming the engine error, a receipt, no traceback; and
`cyclebox gc`, pointed at the real engine, leaves none of the run's containers.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from tests.fixtures.cycle_project import (
    SLOW_KEY_ENV,
    cli_env,
    example_agent,
    project_with_agent,
    run_cli,
    run_containers,
    run_id,
    stage_started,
    start_cycle,
    upstream_at,
    verdict,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]
ENGINE_SOCKET = "/var/run/docker.sock"


class Relay:
    """Unix socket relay: every accepted connection is piped to the engine's socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(64)
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(ENGINE_SOCKET)
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    hung = False
    """Set: the engine hangs (bytes are taken and never passed on; connections stay)."""

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self.hung:
                    dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def hang(self) -> None:
        self.hung = True

    def cut(self) -> None:
        """The engine is gone: refuse new connections, drop every open one."""
        self.listener.close()
        self.path.unlink(missing_ok=True)
        with self.lock:
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()


def test_engine_cut_mid_baseline_ends_with_verdict_receipt_and_exit_6(tmp_path: Path) -> None:
    cycle = project_with_agent(tmp_path / "cyc", example_agent())
    relay_path = tmp_path / "engine.sock"
    relay = Relay(relay_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = tmp_path / "run"
    env = cli_env(tmp, DOCKER_HOST=f"unix://{relay_path}")
    proc = start_cycle(cycle, run, env)
    try:
        wait_for(lambda: stage_started(run, "baseline"), proc, "baseline started")
        rid = run_id(run)
        relay.cut()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    detail = f"rc {proc.returncode}\n{out}\n{err}"
    assert proc.returncode == 6, detail
    assert "Traceback" not in err, detail
    v = verdict(run)
    assert v["verdict"] == "invalid_comparison"
    assert v["reasons"][0].startswith("engine_error"), v["reasons"]
    receipt = (run / "receipt.json")
    assert receipt.is_file(), detail
    assert "engine_error" in receipt.read_text()
    # the real engine still runs the containers the cut controller could not remove;
    # gc (owner gone) removes exactly those
    real = cli_env(tmp)
    real.pop("DOCKER_HOST", None)
    gc = run_cli("gc", env=real)
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert run_containers(rid) == []
    assert list(tmp.iterdir()) == [], list(tmp.iterdir())


def test_a_hung_engine_does_not_hold_an_interrupted_runs_receipt(tmp_path: Path) -> None:
    """The engine stops answering (a relay that swallows every byte, connections kept
    open) and the run gets SIGINT. Every engine request used to wait its 60 s, one after
    another: the verdict and receipt came 240 s after the signal, or never, when a
    supervisor's grace period ended first. Now each waits 5 s once the run stops, and
    none is made after one went unanswered: the receipt is written within seconds."""
    import signal
    import time

    cycle = project_with_agent(tmp_path / "cyc", example_agent())
    relay_path = tmp_path / "engine.sock"
    relay = Relay(relay_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = tmp_path / "run"
    env = cli_env(tmp, DOCKER_HOST=f"unix://{relay_path}")
    proc = start_cycle(cycle, run, env)
    try:
        wait_for(lambda: stage_started(run, "baseline"), proc, "baseline started")
        rid = run_id(run)
        relay.hang()
        time.sleep(1.0)
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
        relay.cut()
    _interrupted_in_time(proc, out, err, run, sent, tmp, rid)  # 240 s before
    doc = (run / "receipt.json").read_text()
    assert "did not answer within 5 s while the run stopped" in doc, doc[:2000]


def _interrupted_in_time(proc: subprocess.Popen[str], out: str, err: str, run: Path,
                         sent: float, tmp: Path, rid: str) -> None:
    """Exit 130, no traceback, a receipt within 45 s of the signal, the verdict
    ``interrupted``; ``cyclebox gc`` on the real engine leaves none of the run's
    containers."""
    detail = f"rc {proc.returncode}\n{out}\n{err}"
    assert proc.returncode == 130, detail
    assert "Traceback" not in err, detail
    receipt = run / "receipt.json"
    assert receipt.is_file(), detail
    assert receipt.stat().st_mtime - sent < 45, detail
    assert verdict(run)["reasons"] == ["interrupted"], detail
    real = cli_env(tmp)
    real.pop("DOCKER_HOST", None)
    assert run_cli("gc", env=real).returncode == 0
    assert run_containers(rid) == []


def test_a_hung_engine_during_a_single_container_stage_does_not_hold_the_receipt(
        tmp_path: Path) -> None:
    """The same in a stage of one container (the coding worker, its model call held by a
    slow optimizer upstream): the first signal shortens the engine's waits before the
    stage unwinds, so the worker's removal waits 5 s, not 60: without that, the receipt
    came 65 s after the signal. The run ends named `interrupted`, exit 130."""
    import signal
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


    received, release = threading.Event(), threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.set()
            release.wait(300)
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cycle = project_with_agent(tmp_path / "cyc", example_agent())
    upstream_at(cycle, "optimizer", server.server_port)
    relay_path = tmp_path / "engine.sock"
    relay = Relay(relay_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = tmp_path / "run"
    env = cli_env(tmp, DOCKER_HOST=f"unix://{relay_path}",
                  **{SLOW_KEY_ENV: "not-a-real-key"})
    proc = start_cycle(cycle, run, env)
    try:
        # the worker's model call is in flight: its container runs, the stage waits
        wait_for(received.is_set, proc, "the worker's model call", timeout=240)
        rid = run_id(run)
        relay.hang()
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
        release.set()
        server.shutdown()
        relay.cut()
    _interrupted_in_time(proc, out, err, run, sent, tmp, rid)
