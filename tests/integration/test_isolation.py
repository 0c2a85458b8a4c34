"""Every SPEC §2 control, observed from inside a real role container.

Each test fails if its control is missing: they attempt the forbidden thing and
check that it did not happen, rather than reading configuration back.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.isolation.sandbox import Mount, StopReason
from tests.conftest import RunFn

pytestmark = pytest.mark.docker


def _py(code: str) -> list[str]:
    return ["python", "-c", code]


def _facts(run_role: RunFn, *extra: str) -> dict[str, object]:
    rec = run_role(["python", "-m", "sandbox.probe", *extra])
    assert rec.stop_reason is StopReason.OK, rec
    return json.loads(rec.stdout_tail)  # type: ignore[no-any-return]


@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP server on every host address; records whether anyone connected."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen()
    srv.settimeout(0.2)
    hits: list[object] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, addr = srv.accept()
            except OSError:
                continue
            hits.append(addr)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    # sanity: the server is reachable from the host itself, so a refusal below means isolation
    with socket.create_connection(("127.0.0.1", srv.getsockname()[1]), timeout=2):
        pass
    time.sleep(0.3)
    assert len(hits) == 1
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    srv.close()
    assert len(hits) == 1, f"a container reached the host server: {hits}"


def _host_address() -> str:
    """A non-loopback address of this host (docker0's, when it exists)."""
    import subprocess

    rows = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    addrs = {r.split()[1]: r.split()[3].split("/")[0] for r in rows}
    addrs.pop("lo", None)
    assert addrs, "host has no non-loopback IPv4 address to test against"
    return addrs.get("docker0") or next(iter(addrs.values()))


def test_no_network(run_role: RunFn, host_server: int) -> None:
    gw = _host_address()
    facts = _facts(run_role, "--tcp", f"127.0.0.1:{host_server}", "--tcp", f"{gw}:{host_server}")
    assert facts["interfaces"] == ["lo"]
    assert facts["tcp"] == {f"127.0.0.1:{host_server}": "ECONNREFUSED",
                            f"{gw}:{host_server}": "ENETUNREACH"}


def test_identity_and_privileges(run_role: RunFn) -> None:
    facts = _facts(run_role)
    assert facts["uid"] != 0 and facts["gid"] != 0
    assert facts["cap_eff"] == "0000000000000000"
    assert facts["no_new_privs"] == "1"
    assert facts["seccomp"] == "2"  # filter mode: the default profile is on
    assert facts["unix_sockets"] == []  # no engine socket, by any name


def test_root_filesystem_read_only(run_role: RunFn) -> None:
    rec = run_role(_py("open('/etc/cyclebox-x', 'w')"))
    assert rec.stop_reason is StopReason.PROCESS_FAILED
    assert "Read-only file system" in rec.stderr_tail


def test_read_only_mount_unwritable(run_role: RunFn, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "keep.txt").write_text("original")
    os.chmod(data, 0o777)
    os.chmod(data / "keep.txt", 0o666)  # writable by mode: only the mount can stop it
    rec = run_role(_py(
        "import os\n"
        "for op in (lambda: open('/data/keep.txt','w').write('x'),"
        "           lambda: open('/data/new.txt','w'),"
        "           lambda: os.unlink('/data/keep.txt')):\n"
        "    try: op(); print('WROTE')\n"
        "    except OSError as e: print(e.strerror)\n"),
        mounts=[Mount(source=data, target="/data")])
    assert rec.stop_reason is StopReason.OK
    assert rec.stdout_tail.split("\n")[:3] == ["Read-only file system"] * 3
    assert (data / "keep.txt").read_text() == "original"
    assert sorted(p.name for p in data.iterdir()) == ["keep.txt"]


def test_tmpfs_cap_enforced(run_role: RunFn) -> None:
    rec = run_role(_py(
        "n=0\n"
        "try:\n"
        "    with open('/tmp/fill','wb') as f:\n"
        "        for _ in range(64):\n"
        "            f.write(b'x'*(1<<20)); f.flush(); n+=1\n"
        "except OSError as e: print('ERR', e.strerror, n)\n"), tmpfs={"/tmp": "8m"})
    assert rec.stop_reason is StopReason.OK
    out = rec.stdout_tail.split()
    assert out[:4] == ["ERR", "No", "space", "left"]
    assert int(out[-1]) <= 8


def test_pids_limit(run_role: RunFn) -> None:
    rec = run_role(_py(
        "import os, time\n"
        "n=0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork()==0: time.sleep(30); os._exit(0)\n"
        "        n+=1\n"
        "except OSError as e: print('ERR', e.strerror, n)\n"), pids=32, timeout_s=30)
    assert rec.stop_reason is StopReason.OK, rec
    words = rec.stdout_tail.split()
    assert words[0] == "ERR"
    assert int(words[-1]) < 32


def test_memory_limit_is_oom(run_role: RunFn) -> None:
    rec = run_role(_py("x=[]\nwhile True: x.append(bytearray(16<<20))"), memory="128m")
    assert rec.stop_reason is StopReason.OOM, rec
    assert rec.exit_code == 137
    assert rec.cleanup_confirmed


def test_timeout_kills_and_removes(run_role: RunFn, backend: object) -> None:
    t0 = time.monotonic()
    rec = run_role(["sleep", "60"], timeout_s=2)
    elapsed = time.monotonic() - t0
    assert rec.stop_reason is StopReason.TIMEOUT
    assert elapsed < 2 + 5, f"container took {elapsed:.1f}s to be gone"
    assert rec.cleanup_confirmed
    names = [n for _, n, _ in backend.managed_containers()]  # type: ignore[attr-defined]
    assert rec.container_name not in names


def test_stdout_flood_capped(run_role: RunFn) -> None:
    rec = run_role(["yes", "flood"], stdout_cap="256k", timeout_s=30)
    assert rec.stop_reason is StopReason.OUTPUT_LIMIT, rec
    assert rec.stdout_bytes > 256 * 1024
    assert len(rec.stdout_tail.encode()) <= 64 * 1024
    assert rec.wall_s < 10


def test_output_dir_cap(run_role: RunFn) -> None:
    """The output directory is a kernel-capped tmpfs: the writer gets ENOSPC at the cap,
    the run ends output_limit, and the host holds at most the cap."""
    rec = run_role(_py(
        "import time\n"
        "try:\n"
        "    with open('/out/big','wb') as f:\n"
        "        for _ in range(256):\n"
        "            f.write(b'x'*(1<<20)); f.flush()\n"
        "except OSError as e: print('ERR', e.strerror)\n"), output_cap="8m",
        timeout_s=60)
    assert rec.stop_reason is StopReason.OUTPUT_LIMIT, rec
    assert "output tmpfs full" in rec.detail
    assert "No space left on device" in rec.stdout_tail
    out = rec.__dict__["output_dir"]
    assert sum(p.stat().st_size for p in out.rglob("*")) <= 8 << 20


def test_host_environment_not_visible(run_role: RunFn, monkeypatch: pytest.MonkeyPatch) -> None:
    canary = "cbx-canary-" + os.urandom(8).hex()
    monkeypatch.setenv("CYCLEBOX_TEST_CANARY", canary)
    rec = run_role(_py("import os,glob\n"
                       "blob=repr(dict(os.environ))\n"
                       "for p in glob.glob('/proc/[0-9]*/environ'):\n"
                       "    try: blob+=open(p,'rb').read().decode(errors='replace')\n"
                       "    except OSError: pass\n"
                       "print(blob)"))
    assert rec.stop_reason is StopReason.OK
    assert canary not in rec.stdout_tail
    assert "CYCLEBOX_TEST_CANARY" not in rec.stdout_tail


def test_planted_symlink_refused_host_target_untouched(run_role: RunFn, tmp_path: Path) -> None:
    target = tmp_path / "host-file"
    target.write_text("host data")
    before = target.stat()
    rec = run_role(_py(f"import os\nos.symlink({str(target)!r}, '/out/evil')\n"
                       "open('/out/ok.json','w').write('{}')"))
    # The copy-out refuses the link by name: the run is invalid, never ok.
    assert rec.stop_reason is StopReason.INVALID_OUTPUT, rec
    assert "'evil': symlink refused" in rec.detail
    out = rec.__dict__["output_dir"]
    assert not any(p.is_symlink() for p in out.rglob("*"))
    assert not os.path.lexists(out / "evil")
    assert target.read_text() == "host data"
    assert target.stat().st_mtime_ns == before.st_mtime_ns


def test_exit_code_and_record(run_role: RunFn) -> None:
    rec = run_role(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert rec.stop_reason is StopReason.PROCESS_FAILED
    assert rec.exit_code == 3
    assert rec.stdout_tail == "out\n" and rec.stderr_tail == "err\n"
    assert rec.image_id.startswith("sha256:")
    assert rec.labels["io.cyclebox.role"] == "analyst"
    assert rec.cleanup_confirmed
