"""The cyclebox CLI end to end, as an operator runs it, on a real engine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.docker

CLI = [str(Path(sys.executable).with_name("cyclebox"))]
if not Path(CLI[0]).exists():  # pragma: no cover - fallback when not installed as a script
    CLI = [sys.executable, "-m", "runner.cli"]


def cyclebox(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def _containers_of(pid: int) -> list[str]:
    import docker

    return [c.name for c in docker.from_env().containers.list(
        all=True, filters={"label": f"io.cyclebox.owner_pid={pid}"})]


def test_doctor_passes_and_reports_limits() -> None:
    res = cyclebox("doctor", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    checks = {c["name"]: c for c in json.loads(res.stdout)}
    assert checks["limits enforced"]["ok"] is True
    assert "CapEff 0000000000000000" in checks["limits enforced"]["detail"]
    assert all(checks[f"image {r}"]["ok"] for r in
               ("analyst", "worker", "evaluator", "apply", "trainer"))


def test_exec_streams_and_exits_with_command_code(tmp_path: Path) -> None:
    res = cyclebox("sandbox", "exec", "--role", "worker", "--out", str(tmp_path / "o"), "--",
                   "sh", "-c", "echo hello; echo oops >&2; exit 7")
    assert res.returncode == 7
    assert res.stdout == "hello\n"
    assert "oops" in res.stderr


def test_exec_json_record_and_mounts(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "in.txt").write_text("payload")
    os.chmod(data, 0o755)
    os.chmod(data / "in.txt", 0o644)
    res = cyclebox("sandbox", "exec", "--role", "evaluator", "--json", "--mount",
                   f"{data}:/data", "--out", str(tmp_path / "o"), "--",
                   "sh", "-c", "cat /data/in.txt > /out/copy.txt")
    assert res.returncode == 0, res.stderr
    rec = json.loads(res.stdout)
    assert rec["stop_reason"] == "ok" and rec["cleanup_confirmed"] is True
    assert rec["role"] == "evaluator"
    assert (tmp_path / "o" / "copy.txt").read_text() == "payload"


def test_exec_refuses_forbidden_mount_and_existing_out(tmp_path: Path) -> None:
    res = cyclebox("sandbox", "exec", "--role", "analyst", "--mount", "/var/run:/x", "--",
                   "true")
    assert res.returncode == 3
    assert "--mount" in res.stderr and "/run" in res.stderr
    (tmp_path / "o").mkdir()
    res = cyclebox("sandbox", "exec", "--role", "analyst", "--out", str(tmp_path / "o"), "--",
                   "true")
    assert res.returncode == 3 and "never overwritten" in res.stderr


def test_bad_policy_file_names_field(tmp_path: Path) -> None:
    bad = tmp_path / "roles.yaml"
    bad.write_text("schema: 1\nroles:\n  analyst: {image: analyst, memory: 1g, cpus: 1, "
                   "pids: 10, timeout_s: 5, network: host}\n")
    res = cyclebox("sandbox", "exec", "--role", "analyst", "--policies", str(bad), "--", "true")
    assert res.returncode == 3
    assert str(bad) in res.stderr and "roles.analyst.network" in res.stderr


def test_timeout_exit_code(tmp_path: Path) -> None:
    pol = tmp_path / "roles.yaml"
    pol.write_text("schema: 1\nroles:\n  analyst: {image: analyst, memory: 256m, cpus: 1, "
                   "pids: 16, timeout_s: 1}\n")
    res = cyclebox("sandbox", "exec", "--role", "analyst", "--policies", str(pol), "--",
                   "sleep", "30")
    assert res.returncode == 124
    assert "timeout" in res.stderr


def test_sigkilled_controller_leaves_container_that_gc_removes() -> None:
    proc = subprocess.Popen([*CLI, "sandbox", "exec", "--role", "analyst", "--",
                             "sleep", "120"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        names: list[str] = []
        while time.monotonic() < deadline and not names:
            names = _containers_of(proc.pid)
            time.sleep(0.2)
        assert names, "controller never started its container"
        # a live owner's container is kept by gc
        res = cyclebox("gc")
        assert res.returncode == 0
        assert f"kept {names[0]}" in res.stdout
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert _containers_of(proc.pid) == names, "container should outlive a SIGKILLed owner"
        res = cyclebox("gc")
        assert res.returncode == 0, res.stderr
        assert f"removed {names[0]}" in res.stdout
        assert "is gone" in res.stdout
        assert _containers_of(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_controller_cleans_up_itself() -> None:
    proc = subprocess.Popen([*CLI, "sandbox", "exec", "--role", "analyst", "--",
                             "sleep", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _containers_of(proc.pid):
        time.sleep(0.2)
    assert _containers_of(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert _containers_of(proc.pid) == []


def test_images_list_matches_engine() -> None:
    res = cyclebox("images", "list", "--json")
    assert res.returncode == 0
    rows = json.loads(res.stdout)
    assert {r["role"] for r in rows} == {"analyst", "worker", "evaluator", "apply", "trainer"}
    assert shutil.which("docker")
    for r in rows:
        # a derived image whose tag moved to a rebuild (or a racing build) is listed as
        # <untagged> so that gc can find it; it is checked by its id then
        ref = r["id"] if r["tag"] == "<untagged>" else r["tag"]
        got = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", ref],
                             capture_output=True, text=True, check=True).stdout.strip()
        assert got == r["id"]
