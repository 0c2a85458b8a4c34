"""Test-only: run by the coding CLI's own shell tool inside the analyst container, it
looks for the host's canary key in this process's environment, every process's environ
and the files the container can read (the mounted and writable places, /etc and the
CLIs' homes), and names the processes it descends from (the CLI that ran it). The result
goes to /out/canary-scan.json; the e2e test asserts no hit."""

from __future__ import annotations

import json
import os
from pathlib import Path

MARKER = ("cbx" + "canary").encode()
PROBE = ("scan" + "-selftest").encode()  # this file holds it once: the scan must see it
TOPS = ["/run", "/src", "/case", "/data", "/tmp", "/out", "/etc", "/root", "/home"]


def parents() -> list[str]:
    names, pid = [], os.getppid()
    while pid > 1 and len(names) < 16:
        status = Path(f"/proc/{pid}/status").read_text()
        names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        pid = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")))
    return names


def main() -> None:
    hits = [f"env:{k}" for k, v in os.environ.items() if MARKER in (k + v).encode()]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if MARKER in Path(f"/proc/{pid}/environ").read_bytes():
                hits.append(f"environ:{pid}")
        except OSError:
            pass
    scanned, probe = 0, []
    for top in TOPS:
        for root, _dirs, files in os.walk(top):
            for name in files:
                p = os.path.join(root, name)
                try:
                    if os.path.islink(p) or os.path.getsize(p) > 64 << 20:
                        continue
                    data = Path(p).read_bytes()
                except OSError:
                    continue
                scanned += 1
                if MARKER in data:
                    hits.append(f"file:{p}")
                if PROBE in data:
                    probe.append(p)
    Path("/out/canary-scan.json").write_text(json.dumps(
        {"hits": hits, "scanned": scanned, "probe": probe, "parents": parents()}))
    # the count stays in the file: what the CLI's tool prints goes into the model's next
    # request, which a replay must see unchanged
    print(f"canary scan: {len(hits)} hits")


if __name__ == "__main__":
    main()  # scan-selftest
