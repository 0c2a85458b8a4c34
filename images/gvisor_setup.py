#!/usr/bin/env python3
"""Make ``runtime: runsc`` (gVisor) usable by the local Docker engine; ``make gvisor`` runs it.

Idempotent and loud: it prints each thing it did or found already done.

1. Install Debian's ``runsc`` package when the binary is missing (root only).
2. Merge a ``runsc`` runtime into ``/etc/docker/daemon.json`` (other keys and
   runtimes are kept; an unreadable file is refused, never overwritten) with
   ``--network=none`` (roles never get a network stack) and ``--host-uds=open``
   (so the model gateway's unix socket, bind-mounted read-only, can be connected).
3. Reload the engine with SIGHUP, which re-reads runtimes without stopping any
   container, and wait until ``docker info`` lists ``runsc``.

The engine is never stopped or restarted: other users' containers keep running.
Standard library only, so it runs before the virtualenv exists.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

DAEMON_JSON = Path(os.environ.get("CYCLEBOX_DAEMON_JSON", "/etc/docker/daemon.json"))
RUNTIME_ARGS = ["--network=none", "--host-uds=open", "--oci-seccomp"]
WAIT_S = 30


def engine_runtimes() -> dict[str, dict[str, object]] | None:
    """Runtimes the engine has loaded (name -> path, args), or None when no engine answers."""
    try:
        out = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"],
                             capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        loaded = json.loads(out.stdout or "{}")
    except ValueError:
        return None
    return loaded if isinstance(loaded, dict) else None


def loaded_ok(runtimes: dict[str, dict[str, object]] | None) -> bool:
    """The engine has runsc loaded with exactly our arguments."""
    entry = (runtimes or {}).get("runsc")
    return isinstance(entry, dict) and entry.get("runtimeArgs") == RUNTIME_ARGS


def install_runsc() -> str:
    path = shutil.which("runsc")
    if path:
        print(f"runsc: present at {path}")
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit("runsc missing: install gVisor (Debian: apt-get install runsc) as root, "
                 "then run make gvisor again")
    print("runsc: installing Debian's runsc package")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "runsc"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    path = shutil.which("runsc")
    if not path:
        sys.exit("runsc: the package installed but no runsc binary is on PATH")
    return path


def merged_config(current: dict[str, object], runsc: str) -> dict[str, object]:
    """``current`` with the runsc runtime set; every other key kept as it was."""
    runtimes = current.get("runtimes", {})
    if not isinstance(runtimes, dict):
        sys.exit(f"{DAEMON_JSON}: 'runtimes' is not an object; fix it by hand")
    return {**current, "runtimes": {**runtimes,
                                    "runsc": {"path": runsc, "runtimeArgs": RUNTIME_ARGS}}}


def write_config(runsc: str) -> bool:
    """Merge the runtime into daemon.json; True when the file changed."""
    current: dict[str, object] = {}
    if DAEMON_JSON.exists():
        try:
            loaded = json.loads(DAEMON_JSON.read_text() or "{}")
        except ValueError as exc:
            sys.exit(f"{DAEMON_JSON}: not valid JSON ({exc}); fix it by hand, "
                     "nothing was changed")
        if not isinstance(loaded, dict):
            sys.exit(f"{DAEMON_JSON}: not a JSON object; fix it by hand")
        current = loaded
    wanted = merged_config(current, runsc)
    if wanted == current:
        print(f"daemon.json: {DAEMON_JSON} already has the runsc runtime {RUNTIME_ARGS}")
        return False
    if os.geteuid() != 0:
        sys.exit(f"daemon.json: {DAEMON_JSON} needs the runsc runtime; run make gvisor as root")
    DAEMON_JSON.parent.mkdir(parents=True, exist_ok=True)
    if DAEMON_JSON.exists():
        backup = DAEMON_JSON.with_name(f"daemon.json.bak-{int(time.time())}")
        shutil.copy2(DAEMON_JSON, backup)
        print(f"daemon.json: previous file kept as {backup}")
    tmp = DAEMON_JSON.with_name(".daemon.json.cyclebox")
    tmp.write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, DAEMON_JSON)
    print(f"daemon.json: added runtime runsc -> {runsc} {RUNTIME_ARGS} to {DAEMON_JSON}")
    return True


def reload_engine() -> None:
    """SIGHUP the local dockerd (reloads runtimes; containers keep running)."""
    out = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True, check=False)
    pids = [int(p) for p in out.stdout.split()]
    if len(pids) != 1:
        sys.exit(f"engine: expected one local dockerd, found {len(pids)}; reload it yourself "
                 "(kill -HUP <pid>) so it reads the new runtime")
    os.kill(pids[0], signal.SIGHUP)
    print(f"engine: sent SIGHUP to dockerd (pid {pids[0]}) to reload runtimes")


def main() -> int:
    runsc = install_runsc()
    changed = write_config(runsc)
    runtimes = engine_runtimes()
    if runtimes is None:
        sys.exit("engine: no Docker engine answers; run make docker first")
    if loaded_ok(runtimes) and not changed:
        print("engine: runsc runtime already loaded with these arguments")
        return 0
    reload_engine()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        runtimes = engine_runtimes()
        if loaded_ok(runtimes):
            print(f"engine: runtimes now {sorted(runtimes or {})}")
            return 0
        time.sleep(0.5)
    sys.exit(f"engine: runsc with {RUNTIME_ARGS} not listed by docker info {WAIT_S}s after "
             "the reload; see the dockerd log")


if __name__ == "__main__":
    raise SystemExit(main())
