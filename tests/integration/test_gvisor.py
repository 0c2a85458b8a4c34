"""The key isolation behaviours again, with ``runtime: runsc`` (gVisor) in the role policy.

Inside gVisor /proc and /sys belong to an emulated kernel, so limits are tested by
what happens (a fork loop ends, a memory hog is killed, a tmpfs fills up), never by
reading cgroup files. The runtime must be registered (``make gvisor``, which ``make
test`` runs first): every test here fails, never skips, when it is not.

What differs from runc, and is pinned here so a change is noticed:
- a fork loop is stopped by the host pids cgroup around the whole sandbox; gVisor's
  own threads count against it, so the sandbox dies (exit 2 from the Go runtime)
  rather than ``fork`` returning EAGAIN — contained, recorded as process_failed;
- ``NoNewPrivs`` is not shown in the emulated /proc/self/status;
- the seccomp profile is enforced inside the sandbox only because the runtime is
  registered with ``--oci-seccomp``; without it runsc ignores the profile and
  io_uring_setup succeeds (against gVisor's own io_uring, not the host kernel's);
- runsc applies that profile to the container's first process (the holder) only; the
  role command is the holder's child and inherits it (a ``docker exec``'d command did
  not).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from runner.gateway.calllog import CallLog
from runner.gateway.config import CredentialSource
from runner.gateway.server import Gateway
from runner.isolation.docker.images import resolve_image
from runner.isolation.launcher import launch
from runner.isolation.policy import RolePolicies
from runner.isolation.sandbox import RunRecord, StopReason
from tests.conftest import RunFn
from tests.integration.test_isolation import _host_address, host_server  # noqa: F401

pytestmark = pytest.mark.docker
RUNSC_ARGS = ["--network=none", "--host-uds=open", "--oci-seccomp"]


@pytest.fixture(scope="module", autouse=True)
def runsc_registered(backend: Any) -> None:
    runtimes = backend.client.info().get("Runtimes") or {}
    assert "runsc" in runtimes, f"engine has {sorted(runtimes)}, no runsc: run `make gvisor`"
    assert runtimes["runsc"].get("runtimeArgs") == RUNSC_ARGS, (
        f"runsc registered with {runtimes['runsc']}; run `make gvisor` to set {RUNSC_ARGS}")


@pytest.fixture
def gv(run_role: RunFn) -> RunFn:
    """run_role with the role policy's runtime set to runsc."""
    def run(command: list[str], **kw: Any) -> RunRecord:
        return run_role(command, runtime="runsc", **kw)
    return run


def _py(code: str) -> list[str]:
    return ["python", "-c", code]


def _facts(gv: RunFn, *extra: str) -> dict[str, Any]:
    rec = gv(["python", "-m", "sandbox.probe", *extra])
    assert rec.stop_reason is StopReason.OK, rec
    return json.loads(rec.stdout_tail)  # type: ignore[no-any-return]


def test_really_runs_in_gvisor(gv: RunFn, run_role: RunFn) -> None:
    """The emulated kernel answers, not the host's: the policy's runtime was honoured."""
    code = _py("print(open('/proc/version').read().strip())")
    inside, plain = gv(code), run_role(code)
    assert inside.stop_reason is StopReason.OK and plain.stop_reason is StopReason.OK
    host = Path("/proc/version").read_text().strip()
    assert plain.stdout_tail.strip() == host
    assert inside.stdout_tail.strip() != host


def test_no_network_but_lo(gv: RunFn, host_server: int) -> None:  # noqa: F811
    addr = _host_address()
    facts = _facts(gv, "--tcp", f"127.0.0.1:{host_server}", "--tcp", f"{addr}:{host_server}")
    assert facts["interfaces"] == ["lo"]
    assert facts["tcp"][f"127.0.0.1:{host_server}"] == "ECONNREFUSED"
    assert facts["tcp"][f"{addr}:{host_server}"] in ("ENETUNREACH", "EHOSTUNREACH")


def test_identity_and_privileges(gv: RunFn) -> None:
    facts = _facts(gv)
    assert facts["uid"] == 10001 or facts["uid"] == os.getuid()
    assert facts["uid"] != 0 and facts["gid"] != 0
    assert facts["cap_eff"] == "0000000000000000"
    assert facts["unix_sockets"] == []


def test_seccomp_profile_applies_to_the_role_command(gv: RunFn) -> None:
    """runsc applies the OCI profile to the container's first process only: the holder,
    which starts the role command as its child, so the command inherits the filter (it
    did not when it ran through ``docker exec``)."""
    facts = _facts(gv)
    assert facts["seccomp"] == "2"
    assert facts["syscalls"]["io_uring_setup"] in ("EPERM", "ENOSYS"), facts["syscalls"]
    assert facts["syscalls"]["keyctl"] == "EPERM"
    assert facts["syscalls"]["unshare_newuser"] == "EPERM"
    assert facts["syscalls"]["clone3_newuser"] == "ENOSYS"  # the sentry's own answer


THREADS = """
import ctypes, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(435, 0, 0)  # clone3: ENOSYS, from gVisor's sentry
print(ctypes.get_errno())
t = threading.Thread(target=print, args=("thread ran",))
t.start()
t.join()
"""


def test_a_role_command_can_start_threads(gv: RunFn) -> None:
    """The profile answers clone3 with ENOSYS so glibc falls back to the clone whose
    flags it checks; this runsc ignores a rule's errno and said EPERM, on which glibc
    gives up: no Python thread could start under gVisor. Under runsc the rule is an
    allow (runner.isolation.seccomp.for_runtime) and the sentry says ENOSYS itself."""
    rec = gv(["python", "-c", THREADS])
    assert rec.stop_reason is StopReason.OK, rec
    assert rec.stdout_tail.split() == ["38", "thread", "ran"], rec


def test_root_filesystem_read_only(gv: RunFn) -> None:
    # /var/tmp is world-writable in the image: only the read-only rootfs refuses this
    # (gVisor checks permissions first, so a root-owned path would say EACCES instead).
    rec = gv(_py("open('/var/tmp/cyclebox-x', 'w')"))
    assert rec.stop_reason is StopReason.PROCESS_FAILED
    assert "Read-only file system" in rec.stderr_tail


def test_tmpfs_cap_enforced(gv: RunFn) -> None:
    rec = gv(_py(
        "n=0\n"
        "try:\n"
        "    with open('/tmp/fill','wb') as f:\n"
        "        for _ in range(64):\n"
        "            f.write(b'x'*(1<<20)); f.flush(); n+=1\n"
        "except OSError as e: print('ERR', e.strerror, n)\n"), tmpfs={"/tmp": "8m"})
    assert rec.stop_reason is StopReason.OK, rec
    out = rec.stdout_tail.split()
    assert out[:4] == ["ERR", "No", "space", "left"]
    assert int(out[-1]) <= 8


def test_fork_loop_is_contained(gv: RunFn) -> None:
    """Unbounded, the loop would finish and print 'forks 1281'; the limit stops it first."""
    rec = gv(_py(
        "import os, time\n"
        "n=0\n"
        "try:\n"
        "    while n <= 1280:\n"
        "        if os.fork()==0: time.sleep(30); os._exit(0)\n"
        "        n+=1\n"
        "except OSError as e: print('ERR', e.strerror, n)\n"
        "print('forks', n, flush=True)\n"), pids=128, timeout_s=60)
    assert "forks 1281" not in rec.stdout_tail, rec
    assert rec.stop_reason in (StopReason.PROCESS_FAILED, StopReason.OK), rec
    if rec.stop_reason is StopReason.OK:  # fork refused inside the sandbox
        assert rec.stdout_tail.startswith("ERR")
    assert rec.cleanup_confirmed


def test_memory_hog_is_oom_killed(gv: RunFn) -> None:
    rec = gv(_py("x=[]\nwhile True: x.append(bytearray(16<<20))"), memory="128m", timeout_s=60)
    assert rec.stop_reason is StopReason.OOM, rec  # the engine sets OOMKilled for runsc too
    # the whole sandbox goes (exec and all), so the command's own code may be unknown
    assert rec.exit_code in (137, 128, None)  # runsc reports 128 for a killed exec
    assert rec.cleanup_confirmed


def test_timeout_kills_and_removes(gv: RunFn, backend: Any) -> None:
    rec = gv(["sleep", "60"], timeout_s=3)
    assert rec.stop_reason is StopReason.TIMEOUT
    assert rec.cleanup_confirmed
    assert rec.container_name not in [n for _, n, _ in backend.managed_containers()]


SDK_AND_SCAN = """
import glob, json, os
from sandbox.gateway_client import client
c = client()
reply = c.chat.completions.create(model="fixture-target",
    messages=[{"role": "user", "content": "ping"}]).choices[0].message.content
marker = "cbx" + "gvcanary"
hits = [k for k, v in os.environ.items() if marker in k or marker in v]
for p in glob.glob("/proc/[0-9]*/environ"):
    try:
        if marker.encode() in open(p, "rb").read(): hits.append(p)
    except OSError: pass
for root, dirs, files in os.walk("/"):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
    for f in files:
        p = os.path.join(root, f)
        try:
            if os.path.islink(p) or os.path.getsize(p) > 64 << 20: continue
            if marker.encode() in open(p, "rb").read(): hits.append(p)
        except OSError: pass
print(json.dumps({"reply": reply, "hits": hits}))
"""


def test_gateway_via_openai_sdk_and_no_credential_visible(
        tmp_path: Path, policies: RolePolicies, upstreams: dict[str, Any], backend: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real openai SDK reaches the gateway socket through gVisor (--host-uds=open);
    a canary credential on the host (env var and key file) is nowhere inside."""
    canary = "sk-cbxgvcanary-" + os.urandom(8).hex()
    monkeypatch.setenv("CBX_GV_CANARY", canary)
    keyfile = tmp_path / "keys" / "judge.key"
    keyfile.parent.mkdir()
    keyfile.write_text(canary + "\n")
    ups = dict(upstreams)
    ups["judge"] = ups["judge"].model_copy(update={
        "credential": CredentialSource(file=str(keyfile))})
    policy = policies.roles["analyst"].model_copy(update={"runtime": "runsc"})
    with Gateway(tmp_path, "gvtest", ups, {"analyst": "target", "evaluator": "judge"}) as gw:
        rec = launch(backend, policy, role="analyst", run_id="gvtest",
                     image=resolve_image("analyst"), command=["python", "-c", SDK_AND_SCAN],
                     gateway=gw, stage="test", case="c1", trial=0)
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    out = json.loads(rec.stdout_tail)
    assert out == {"reply": "pong", "hits": []}
    assert canary not in rec.stdout_tail + rec.stderr_tail
    recs = CallLog(tmp_path / "gateway").records()
    assert [(r.role, r.upstream) for r in recs] == [("analyst", "target")]


LOOPBACK = """
import json, socket
import openai
out = {"reply": openai.OpenAI().chat.completions.create(model="fixture-target",
    messages=[{"role": "user", "content": "ping"}]).choices[0].message.content}
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
try:
    s.bind(("127.0.0.1", 40080)); out["steal"] = "bound"
except OSError as e:
    out["steal"] = e.errno
print(json.dumps(out))
"""


def test_loopback_endpoint_under_runsc(tmp_path: Path, policies: RolePolicies,
                                       upstreams: dict[str, Any], backend: Any) -> None:
    """gVisor's --network=none keeps a loopback: the holder's relay listens there, an
    unmodified SDK reaches the gateway through it, and the port cannot be shared."""
    import errno

    policy = policies.roles["analyst"].model_copy(update={"runtime": "runsc"})
    with Gateway(tmp_path, "gvtest", dict(upstreams), {"analyst": "target"}) as gw:
        rec = launch(backend, policy, role="analyst", run_id="gvtest",
                     image=resolve_image("analyst"), command=["python", "-c", LOOPBACK],
                     gateway=gw, stage="test", case="c1", trial=0)
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    assert json.loads(rec.stdout_tail) == {"reply": "pong", "steal": errno.EADDRINUSE}
    recs = CallLog(tmp_path / "gateway").records()
    assert [(r.role, r.case, r.status) for r in recs] == [("analyst", "c1", "ok")]


def test_doctor_probes_seccomp_under_runsc_when_a_policy_asks(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    from runner.paths import PROJECT_ROOT

    doc = yaml.safe_load((PROJECT_ROOT / "policies" / "roles.yaml").read_text())
    doc["roles"]["analyst"]["runtime"] = "runsc"
    roles = tmp_path / "roles.yaml"
    roles.write_text(yaml.safe_dump(doc))
    cli = str(Path(sys.executable).with_name("cyclebox"))
    res = subprocess.run([cli, "doctor", "--policies", str(roles), "--json"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {c["name"]: c for c in json.loads(res.stdout)}
    assert rows["runtime runsc"]["detail"] == "available; used by analyst"
    assert rows["seccomp enforced (runsc)"]["ok"]
    assert "io_uring_setup EPERM" in rows["seccomp enforced (runsc)"]["detail"]
    assert rows["limits enforced"]["ok"]  # cgroup facts read under the default runtime
