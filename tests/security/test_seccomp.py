"""The seccomp profile (policies/seccomp.json): io_uring refused, moby's other refusals kept.

Attacks are attempted from inside real role containers (raw syscalls through
ctypes in ``sandbox.probe``). The engine's own default profile allows
``io_uring_setup`` on this kernel, so the io_uring test fails whenever a container
runs without our profile. Profile checks and doctor lines are tested on files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from runner.cycle.plan import load_plan
from runner.errors import ConfigError, IntegrityError
from runner.isolation.docker.doctor import seccomp_problems, seccomp_profile_check
from runner.isolation.policy import load_policies
from runner.isolation.sandbox import RunRecord, StopReason
from runner.isolation.seccomp import FORBIDDEN, PROFILE_PATH, check_profile, load_profile
from runner.paths import PROJECT_ROOT
from tests.conftest import RunFn

CLI = str(Path(sys.executable).with_name("cyclebox"))
DENIED = ("EPERM", "ENOSYS")


def _syscalls(run_role: RunFn, **overrides: Any) -> dict[str, str]:
    rec = run_role(["python", "-m", "sandbox.probe"], **overrides)
    assert rec.stop_reason is StopReason.OK, rec
    calls: dict[str, str] = json.loads(rec.stdout_tail)["syscalls"]
    return calls


def _roles_with(tmp_path: Path, profile: str | None, *, role: str = "analyst") -> Path:
    """A copy of policies/roles.yaml whose ``role`` names ``profile`` as its seccomp file."""
    import yaml

    doc = yaml.safe_load((PROJECT_ROOT / "policies" / "roles.yaml").read_text())
    if profile is not None:
        doc["roles"][role]["seccomp"] = profile
    path = tmp_path / "roles.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# -- inside a role container (real engine) --------------------------------------------


@pytest.mark.docker
def test_io_uring_setup_refused_in_every_cycle_role(run_role: RunFn) -> None:
    for role in ("analyst", "worker", "evaluator", "apply"):
        calls = _syscalls(run_role, role=role)
        assert calls["io_uring_setup"] in DENIED, (role, calls)


@pytest.mark.docker
def test_default_profile_protections_still_hold(run_role: RunFn) -> None:
    calls = _syscalls(run_role)
    # moby's default: keyctl is not allowed at all; unshare needs CAP_SYS_ADMIN.
    assert calls["keyctl"] == "EPERM", calls
    assert calls["unshare_newuser"] == "EPERM", calls
    assert calls["clone3_newuser"] == "ENOSYS", calls  # glibc falls back to clone


@pytest.mark.docker
def test_engine_received_exactly_our_profile(run_role: RunFn, backend: Any) -> None:
    """docker inspect, while the container runs, shows SecurityOpt seccomp=<our profile>."""
    seen: list[list[str]] = []
    box: list[RunRecord] = []
    t = threading.Thread(target=lambda: box.append(run_role(["sleep", "20"], timeout_s=8)))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            for cid, name, _labels in backend.managed_containers():
                if name.startswith("cyclebox-test-test_engine_received"):
                    seen.append(backend.client.api.inspect_container(cid)["HostConfig"]
                                ["SecurityOpt"])
            time.sleep(0.2)
    finally:
        t.join()
    assert seen, "the container was never seen running"
    opts = seen[0]
    assert "no-new-privileges:true" in opts
    sec = [o for o in opts if o.startswith("seccomp=")]
    assert len(sec) == 1
    assert json.loads(sec[0].removeprefix("seccomp=")) == json.loads(load_profile().text)
    assert not any(n in sec[0] for n in FORBIDDEN)
    assert box and box[0].stop_reason is StopReason.TIMEOUT


@pytest.mark.docker
def test_role_profile_from_policy_is_the_one_applied(run_role: RunFn, tmp_path: Path) -> None:
    """A policy's own profile reaches the container: one that also refuses mkdir shows."""
    doc = json.loads(PROFILE_PATH.read_text())
    for rule in doc["syscalls"]:
        rule["names"] = [n for n in rule["names"] if n not in ("mkdir", "mkdirat")]
    custom = tmp_path / "strict.json"
    custom.write_text(json.dumps(doc))
    code = ["python", "-c", "import os; os.mkdir('/tmp/d'); print('made')"]
    rec = run_role(code, seccomp=str(custom))
    assert rec.stop_reason is StopReason.PROCESS_FAILED, rec
    assert "Operation not permitted" in rec.stderr_tail
    rec = run_role(code)
    assert rec.stop_reason is StopReason.OK and rec.stdout_tail == "made\n"


LIMITS = r"""
import os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))  # its own: setrlimit, prlimit64(0)
print("own", resource.getrlimit(resource.RLIMIT_NOFILE))
print("pid 1 read", resource.prlimit(1, resource.RLIMIT_SIGPENDING) != (0, 0))
for pid in (1, os.getpid()):
    try:
        resource.prlimit(pid, resource.RLIMIT_SIGPENDING, (0, 0))
        print("changed", pid == 1 and "pid 1" or "self by pid")
    except (OSError, ValueError) as exc:
        print("refused", pid == 1 and "pid 1" or "self by pid", type(exc).__name__)
"""


def test_a_role_cannot_change_another_processes_limits(run_role: RunFn) -> None:
    """A role shares the holder's uid, so prlimit(2) let it lower PID 1's
    RLIMIT_SIGPENDING to 0 (the route to a SIGUSR1 delivered without its details,
    :mod:`tests.security.test_holder_channel`). The profile allows prlimit64 on the
    caller itself (pid 0) or without a new limit; anything else is EPERM."""
    rec = run_role(["python", "-c", LIMITS])
    assert rec.stop_reason is StopReason.OK, rec
    assert rec.stdout_tail.splitlines() == [
        "own (512, 512)", "pid 1 read True", "refused pid 1 PermissionError",
        "refused self by pid PermissionError"], rec.stdout_tail


# -- the profile file ------------------------------------------------------------------


def test_shipped_profile_is_moby_default_without_io_uring_and_others_limits() -> None:
    doc = json.loads(PROFILE_PATH.read_text())
    assert doc["defaultAction"] == "SCMP_ACT_ERRNO"
    names = {n for r in doc["syscalls"] for n in r["names"]}
    assert not names & set(FORBIDDEN)
    assert "keyctl" not in names and "add_key" not in names  # moby 20.10 never allows them
    unshare = [r for r in doc["syscalls"] if "unshare" in r["names"]]
    assert [r["includes"] for r in unshare] == [{"caps": ["CAP_SYS_ADMIN"]}]
    prlimit = [r["args"] for r in doc["syscalls"] if "prlimit64" in r["names"]]
    assert prlimit == [[{"index": 0, "value": 0, "op": "SCMP_CMP_EQ"}],
                       [{"index": 2, "value": 0, "op": "SCMP_CMP_EQ"}]]
    # Pinned: moby v20.10.24's file (sha256 ce3585b8...) minus the three io_uring lines,
    # prlimit64 moved from the allow list to the two rules above (own limits; any read).
    # A change here must be a deliberate, reviewed change of the sandbox boundary.
    prof = load_profile()
    assert prof.rules == 29
    assert prof.sha256 == "92f7ca339a5e3a008dcd2ee2549a99b63a121f186609ea1569670c0cbc727f0b"


@pytest.mark.parametrize(("content", "reason"), [
    (b"", "not valid JSON"),
    (b"{\"defaultAction\": \"SCMP_ACT_ERRNO\", \"syscalls\": [", "not valid JSON"),
    (b"[]", "JSON object"),
    (b'{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["read"], '
     b'"action": "SCMP_ACT_ALLOW"}]}', "defaultAction must refuse"),
    (b'{"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read", '
     b'"io_uring_enter"], "action": "SCMP_ACT_ALLOW"}]}', "io_uring must stay refused"),
    (b'{"defaultAction": "SCMP_ACT_ERRNO", "defaultAction": "SCMP_ACT_ERRNO", '
     b'"syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}]}', "duplicate"),
    (b" " * (300 * 1024), "more than"),
], ids=["empty", "truncated", "array", "allow_by_default", "io_uring_allowed", "duplicate_key",
        "oversize"])
def test_bad_profiles_refused_by_name(content: bytes, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as info:
        check_profile(content, path="p.json", field="roles.analyst.seccomp")
    assert "roles.analyst.seccomp" in str(info.value) and "Fix:" in str(info.value)


def test_upstream_moby_profile_is_refused_because_it_allows_io_uring(tmp_path: Path) -> None:
    doc = json.loads(PROFILE_PATH.read_text())
    doc["syscalls"][0]["names"].append("io_uring_setup")  # what moby v20.10.24 ships
    with pytest.raises(ConfigError, match=r"allows \['io_uring_setup'\]"):
        check_profile(json.dumps(doc).encode(), path="moby.json")


def test_policy_naming_a_bad_profile_refused_at_load(tmp_path: Path) -> None:
    (tmp_path / "corrupt.json").write_text("{ not json")
    for name, reason in (("missing.json", "does not exist"), ("corrupt.json", "not valid JSON"),
                         ("unconfined", "does not exist")):
        with pytest.raises(ConfigError, match=reason) as info:
            load_policies(_roles_with(tmp_path, name))
        assert "roles.analyst.seccomp" in str(info.value)


def test_doctor_check_on_missing_and_corrupt_default(tmp_path: Path) -> None:
    ok = seccomp_profile_check()
    assert ok.ok and "io_uring_setup" in ok.detail
    missing = seccomp_profile_check(tmp_path / "nope.json")
    corrupt = tmp_path / "bad.json"
    corrupt.write_text('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}')
    for check in (missing, seccomp_profile_check(corrupt)):
        assert not check.ok
        assert check.fix == "restore the shipped profile: git checkout -- policies/seccomp.json"


def test_doctor_cli_fails_with_fix_line_for_bad_profile(tmp_path: Path) -> None:
    (tmp_path / "corrupt.json").write_text('{"defaultAction": "SCMP_ACT_ERRNO"')
    res = subprocess.run([CLI, "doctor", "--policies", str(_roles_with(tmp_path, "corrupt.json")),
                          "--no-probe", "--json"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 5, res.stdout + res.stderr
    rows = {c["name"]: c for c in json.loads(res.stdout)}
    assert not rows["policies"]["ok"]
    assert "roles.analyst.seccomp" in rows["policies"]["detail"]
    assert "git checkout -- policies/seccomp.json" in rows["policies"]["detail"]


def test_probe_verdicts() -> None:
    good = {"syscalls": {"io_uring_setup": "EPERM", "unshare_newuser": "EPERM",
                         "keyctl": "EACCES"}}
    assert seccomp_problems(good) == []
    assert seccomp_problems({"syscalls": {**good["syscalls"], "io_uring_setup": "allowed"}}) \
        == ["io_uring_setup allowed"]
    assert seccomp_problems({}) == ["probe reported no syscall results"]
    # under runsc the profile lets clone3 through: gVisor must answer it (a runtime named
    # runsc that is not gVisor would make the namespace)
    assert seccomp_problems({"syscalls": {**good["syscalls"], "clone3_newuser": "ENOSYS"}}
                            ) == []
    assert seccomp_problems({"syscalls": {**good["syscalls"], "clone3_newuser": "allowed"}}
                            ) == ["clone3_newuser allowed"]


# -- bound into the plan ---------------------------------------------------------------


@pytest.mark.docker
def test_profile_frozen_into_plan_and_tampering_refused(tmp_path: Path) -> None:
    d = tmp_path / "prepared"
    res = subprocess.run([CLI, "cycle", "run", str(PROJECT_ROOT / "examples" / "shop-analyst" /
                                                   "cycle.yaml"), "--out", str(d),
                          "--prepare-only"], capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr
    plan, _ = load_plan(d / "plan.json")
    frozen = {plan.roles[r].seccomp for r in plan.roles}
    assert len(frozen) == 1
    rel = frozen.pop() or ""
    assert not Path(rel).is_absolute()  # same role hash in a recorded and a replayed run
    copy = d / rel
    assert copy.parent == d / "inputs" / "seccomp"
    assert copy.read_bytes() == PROFILE_PATH.read_bytes()
    assert plan.inputs[f"seccomp/{copy.name}"] == load_profile().sha256
    copy.write_bytes(copy.read_bytes().replace(b'"read",', b'"read","io_uring_setup",', 1))
    with pytest.raises(IntegrityError, match="seccomp"):
        load_plan(d / "plan.json")


@pytest.mark.docker
def test_doctor_reports_profile_and_probe() -> None:
    res = subprocess.run([CLI, "doctor", "--json"], capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {c["name"]: c for c in json.loads(res.stdout)}
    assert rows["seccomp profile"]["ok"] and "io_uring_setup" in rows["seccomp profile"]["detail"]
    probe = rows["seccomp enforced (default runtime)"]
    assert probe["ok"]
    assert probe["detail"] == ("clone3_newuser ENOSYS, io_uring_setup EPERM, keyctl EPERM, "
                               "unshare_newuser EPERM")
