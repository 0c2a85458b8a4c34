"""Less to learn from inside: no operator path in the mount table, no owner record in
any mounted directory, no setuid or world-writable file carried back to the host.

Each test fails when the leak is there: the mount-table test finds the real host
paths (the test's run, input and output directories, the checkout, home and cwd) in
``/proc/self/mountinfo`` as read inside a real role container.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from runner.gateway.server import OWNER_NAME, Gateway
from runner.isolation.sandbox import Mount, StopReason
from tests.conftest import RunFn

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]


def test_mount_table_shows_no_operator_path(run_role: RunFn, tmp_path: Path) -> None:
    run_dir = tmp_path / "operator-run"
    data = run_dir / "stages" / "baseline" / "src"
    data.mkdir(parents=True)
    (data / "app.py").write_text("print('hi')\n")
    (data / "sub").mkdir()
    (data / "sub" / "x.txt").write_text("x")
    single = run_dir / "inputs" / "case.json"
    single.parent.mkdir()
    single.write_text("{}")
    rec = run_role(["cat", "/proc/self/mountinfo", "/src/app.py", "/src/sub/x.txt",
                    "/case.json"],
                   mounts=[Mount(source=data, target="/src"),
                           Mount(source=single, target="/case.json")])
    assert rec.stop_reason is StopReason.OK, rec
    table = rec.stdout_tail
    assert "print('hi')" in table and table.rstrip().endswith("{}")  # inputs still readable
    out = rec.__dict__["output_dir"]
    needles = {str(tmp_path), str(run_dir), str(data), str(single), str(out), str(REPO),
               str(Path.home()), str(Path.cwd()), "pytest-of", "operator-run"}
    found = sorted(n for n in needles if n in table)
    assert not found, f"host paths visible in the container's mount table: {found}\n{table}"
    # and the inputs still appear, from the neutral staging paths
    assert " /src " in table and " /case.json " in table


def test_mount_table_names_nothing_about_the_controller(run_role: RunFn,
                                                        tmp_path: Path) -> None:
    """The staging directory a role sees in /proc/self/mountinfo names neither the
    controller's pid, nor its start time, nor the host uid (it did:
    ``cyclebox-staging-<uid>/<pid>-<start>-...``)."""
    from runner.isolation.owner import current_owner

    data = tmp_path / "data"
    data.mkdir()
    (data / "x.txt").write_text("x")
    rec = run_role(["cat", "/proc/self/mountinfo"],
                   mounts=[Mount(source=data, target="/data")])
    assert rec.stop_reason is StopReason.OK, rec
    table = rec.stdout_tail
    line = next(ln for ln in table.splitlines() if " /data " in ln)
    source = line.split()[3]  # the mount's root within its file system: the staged path
    me = current_owner()
    parts = [p for seg in source.split("/") for p in seg.split("-")]
    assert str(me.pid) not in parts and str(me.start) not in parts, source
    assert f"cyclebox-staging-{os.getuid()}" not in table, source
    assert f"{me.pid}-{me.start}" not in table, table
    name = source.rstrip("/").split("/")[-2]  # <base>/<cbx-in-random>/m0
    assert name.startswith("cbx-in-") and len(name) == len("cbx-in-") + 32, source


def test_gateway_mount_holds_no_owner_record(tmp_path: Path, run_role: RunFn,
                                             policies: object) -> None:
    from runner.gateway.config import parse_upstream

    script = REPO / "policies" / "scripts" / "default.yaml"
    up = parse_upstream({"provider": "scripted", "script": str(script),
                                        "models": ["m"]})
    with Gateway(tmp_path / "gw", "leak", {"target": up}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=10001) as b:
        assert (b.directory.parent / OWNER_NAME).exists()  # gc still finds its owner
        rec = run_role(["python", "-c",
                        "import os, json\n"
                        "d='/run/cyclebox/gateway'\n"
                        "names=sorted(os.listdir(d))\n"
                        "print(json.dumps({'names': names, 'blob': ''.join("
                        "open(os.path.join(d, n), errors='replace').read() "
                        "for n in names if n != 'gateway.sock')}))"],
                       mounts=[b.mount()])
        assert rec.stop_reason is StopReason.OK, rec
        seen = json.loads(rec.stdout_tail)
        assert OWNER_NAME not in seen["names"], seen["names"]
        assert seen["names"] == ["gateway.sock", "token"]
        assert str(os.getpid()) not in seen["blob"]
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        assert boot not in seen["blob"]


def test_no_setuid_or_world_writable_on_host(run_role: RunFn) -> None:
    rec = run_role(["sh", "-c",
                    "cd /out && printf x > suid && chmod 6755 suid && "
                    "printf y > ww && chmod 0666 ww && mkdir wwdir && chmod 1777 wwdir && "
                    "printf z > wwdir/f && chmod 0777 wwdir/f && mkdir sgid && "
                    "chmod 2775 sgid && ls -l /out | grep -c ^-rwsr-s"])
    assert rec.stop_reason is StopReason.OK, rec
    assert rec.stdout_tail.strip() == "1"  # the bits were really set inside
    out = rec.__dict__["output_dir"]
    seen = 0
    for p in [out, *out.rglob("*")]:
        st = os.lstat(p)
        mode = stat.S_IMODE(st.st_mode)
        assert not mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX), (p, oct(mode))
        assert not mode & (stat.S_IWOTH | stat.S_IWGRP), (p, oct(mode))
        assert st.st_uid == os.getuid(), p  # owned by the operator
        seen += 1
    assert seen == 6
    assert (out / "suid").read_bytes() == b"x"


@pytest.mark.parametrize("source", ["/etc", "/root", "/var/run"])
def test_staging_checks_the_callers_source_not_the_staged_copy(source: str,
                                                               tmp_path: Path) -> None:
    """The staged copy always lies in a harmless place; the mount rules must judge what
    the caller named (a `--base-model ~` must not be staged and mounted)."""
    from runner.errors import PolicyViolation
    from runner.isolation.docker.backend import _Staging
    from runner.isolation.sandbox import Mount, Resources, RunSpec

    spec = RunSpec(run_id="t", role="analyst", image="img", command=("true",),
                   user="10001:10001", mounts=(Mount(source=Path(source), target="/in"),),
                   resources=Resources(memory_bytes=1 << 28, cpus=1, pids=64), timeout_s=5)
    with pytest.raises(PolicyViolation, match="host system directory"):
        _Staging(spec)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(PolicyViolation, match="symlink"):
        _Staging(spec.model_copy(update={"mounts": (Mount(source=link, target="/in"),)}))
