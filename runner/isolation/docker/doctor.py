"""Prerequisite checks, run before any work (``cyclebox doctor``).

Each check returns a value with the fix in it; nothing here raises for a failed
check. The limits check runs a real probe container and compares what the probe
observed from inside against the role policy.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import CycleboxError
from runner.isolation.policy import ROLES
from runner.paths import state_dir

if TYPE_CHECKING:
    from runner.isolation.docker.images import BuiltImage
    from runner.isolation.policy import RolePolicies, RolePolicy
    from runner.isolation.sandbox import RunRecord, Sandbox

MIN_FREE_BYTES = 5 * 1024**3


@dataclass(frozen=True)
class Check:
    """One doctor line."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def run_checks(policies_path: Path, *, sandbox: Callable[[], Sandbox],
               probe: bool = True) -> list[Check]:
    """Every check, in order; ``sandbox`` opens the sandbox to check (an engine it cannot
    reach is reported as the failed ``engine`` check, not raised). The engine facts and
    the runtime checks are Docker's; image presence and the probes go through the
    sandbox."""
    from runner.isolation.docker.images import read_lock

    checks, pols = policy_check(policies_path)
    if pols is None:
        return checks
    try:
        backend = sandbox()
    except CycleboxError as exc:
        return [*checks, Check("engine", False, str(exc), "make docker")]
    return [*checks, *engine_checks(pols, read_lock(), backend, probe=probe,
                                    disks=[("disk (state dir)", state_dir())])]


def policy_check(policies_path: Path) -> tuple[list[Check], RolePolicies | None]:
    """The ``policies`` line, and the policies when they are valid."""
    from runner.isolation.policy import load_policies

    try:
        pols = load_policies(policies_path)
    except CycleboxError as exc:
        return [Check("policies", False, str(exc), "fix the field named above")], None
    return [Check("policies", True, f"{policies_path}: {len(pols.roles)} roles valid")], pols


def engine_checks(pols: RolePolicies, lock: Mapping[str, BuiltImage], backend: Sandbox, *,
                  probe: bool, disks: Sequence[tuple[str, Path]]) -> list[Check]:
    """The checks of one engine (this machine's, or a Ray node's): its facts, the seccomp
    profile, runtimes, the images of ``lock``, free disk at ``disks`` and the engine root,
    and (with ``probe``) the limits and seccomp seen from inside a probe container."""
    from runner.isolation.docker.backend import DockerSandbox, engine_info

    checks: list[Check] = []
    info = engine_info(backend.client) if isinstance(backend, DockerSandbox) else None
    if info is None:
        checks.append(Check("engine", True, f"sandbox backend {backend.name} (no Docker "
                            "engine facts to check)"))
    else:
        checks.append(Check("engine", True, f"Docker {info.version} (API {info.api_version}), "
                            f"{info.storage_driver}, cgroup v{info.cgroup_version}"))
        seccomp = any("seccomp" in s for s in info.security_options)
        checks.append(Check("seccomp", seccomp, ", ".join(info.security_options)
                            or "none reported", "use an engine built with seccomp support"))
    checks.append(seccomp_profile_check())
    if info is not None:
        checks.extend(runtime_checks(pols, info.runtimes))
    for role in ROLES:
        row = lock.get(role)
        present = row is not None and backend.image_id(row.id) is not None
        detail = (f"{row.tag} {row.id[:19]} {row.size_bytes / 1e6:.0f} MB" if row and present
                  else "not built")
        checks.append(Check(f"image {role}", present, detail, "cyclebox images build"))
    paths = list(disks)
    if info is not None:
        paths.append(("disk (engine root)", Path(info.docker_root)))
    for label, path in paths:
        target = path if path.exists() else path.parent
        try:
            free = shutil.disk_usage(target).free
        except OSError:
            continue
        checks.append(Check(label, free >= MIN_FREE_BYTES, f"{free / 1024**3:.1f} GiB free at "
                            f"{target}", f"free at least {MIN_FREE_BYTES // 1024**3} GiB"))
    if probe and lock.get("analyst") and backend.image_id(lock["analyst"].id):
        # Cgroup limits are read from inside, which only the default runtime shows
        # (gVisor emulates /proc and /sys); each runtime a policy names gets its own
        # seccomp probe, and the gVisor tests check its limits by behaviour.
        analyst = pols.roles["analyst"].model_copy(update={"runtime": None})
        checks.extend(_probe_limits(backend, analyst, lock["analyst"].id))
        for runtime in sorted(wanted_runtimes(pols)):
            if info is not None and runtime in info.runtimes:
                checks.append(_probe_seccomp(backend, analyst.model_copy(
                    update={"runtime": runtime}), lock["analyst"].id))
    return checks


def seccomp_profile_check(path: Path | None = None) -> Check:
    """The shipped profile (or ``path``) exists, parses, refuses by default and refuses io_uring."""
    from runner.isolation.seccomp import FORBIDDEN, load_profile

    try:
        prof = load_profile(path)
    except CycleboxError as exc:
        fix = getattr(exc, "fix", None) or "git checkout -- policies/seccomp.json"
        return Check("seccomp profile", False, str(exc).split(" Fix: ")[0], fix)
    return Check("seccomp profile", True, f"{prof.path}: sha256 {prof.sha256[:16]}, "
                 f"{prof.rules} rules, {', '.join(FORBIDDEN)} refused")


def wanted_runtimes(pols: RolePolicies) -> set[str]:
    return {p.runtime for p in pols.roles.values() if p.runtime}


def runtime_checks(pols: RolePolicies, available: tuple[str, ...]) -> list[Check]:
    """runsc availability always; a failing line (with the fix) for any runtime a policy
    names that the engine does not have."""
    wanted = wanted_runtimes(pols)
    users = {rt: sorted(r for r, p in pols.roles.items() if p.runtime == rt) for rt in wanted}
    out = []
    for rt in sorted(wanted | {"runsc"}):
        fix = "make gvisor" if rt == "runsc" else f"register runtime {rt} in daemon.json"
        if rt in available:
            out.append(Check(f"runtime {rt}", True, "available" + (
                f"; used by {', '.join(users[rt])}" if rt in users else "; no policy uses it")))
        elif rt in users:
            out.append(Check(f"runtime {rt}", False, f"not registered with the engine "
                             f"(has {', '.join(available)}) but roles {', '.join(users[rt])} "
                             "ask for it", fix))
        else:
            out.append(Check(f"runtime {rt}", True, f"not available (optional; no policy "
                             f"asks for it; {fix} adds it)"))
    return out


def seccomp_problems(facts: dict[str, object]) -> list[str]:
    """What the probe's syscall attempts show the profile let through."""
    calls = facts.get("syscalls")
    if not isinstance(calls, dict):
        return ["probe reported no syscall results"]
    problems = []
    if calls.get("io_uring_setup") not in ("EPERM", "ENOSYS"):
        problems.append(f"io_uring_setup {calls.get('io_uring_setup')}")
    for name in ("unshare_newuser", "keyctl"):
        if calls.get(name) not in ("EPERM", "EACCES", "ENOSYS", "EINVAL"):
            problems.append(f"{name} {calls.get(name)}")
    # ENOSYS, so glibc falls back to the clone whose flags the profile checks; under runsc
    # the profile lets clone3 through and gVisor's sentry must say it (a runtime named
    # runsc that is not gVisor, or a gVisor that implements clone3, would not)
    if "clone3_newuser" in calls and calls.get("clone3_newuser") not in ("ENOSYS", "EPERM"):
        problems.append(f"clone3_newuser {calls.get('clone3_newuser')}")
    return problems


def _probe_seccomp(backend: Sandbox, policy: RolePolicy, image: str) -> Check:
    name = f"seccomp enforced ({policy.runtime or 'default runtime'})"
    rec, facts = _run_probe(backend, policy, image)
    if facts is None:
        return Check(name, False, f"probe {rec.stop_reason.value}: {rec.detail} "
                     f"{rec.stderr_tail[-300:]}", "see the engine log; for runsc: make gvisor")
    problems = seccomp_problems(facts)
    return Check(name, not problems, "; ".join(problems) or ", ".join(
        f"{k} {v}" for k, v in sorted(dict(facts["syscalls"]).items())),
        "the container did not get policies/seccomp.json; for runsc the runtime needs "
        "--oci-seccomp: make gvisor")


def _run_probe(backend: Sandbox, policy: RolePolicy,
               image: str) -> tuple[RunRecord, dict[str, Any] | None]:
    from runner.isolation.launcher import launch

    rec = launch(backend, policy, role="analyst", run_id="doctor", image=image,
                 command=["python", "-m", "sandbox.probe", "--role", "analyst"])
    if rec.stop_reason.value != "ok":
        return rec, None
    from runner.errors import OutputRejected
    from runner.isolation.collect import loads_strict

    try:
        facts = loads_strict(rec.stdout_tail, source="probe container stdout")
    except OutputRejected:
        return rec, None
    return rec, facts if isinstance(facts, dict) else None


def _probe_limits(backend: Sandbox, policy: RolePolicy, image: str) -> list[Check]:
    """Run sandbox.probe in the analyst image and compare what it saw with the policy."""
    rec, facts = _run_probe(backend, policy, image)
    if facts is None:
        return [Check("limits enforced", False, f"probe {rec.stop_reason.value}: "
                      f"{rec.detail} {rec.stderr_tail[-300:]}", "see the engine log")]
    problems = []
    if facts["uid"] == 0:
        problems.append("uid 0")
    if facts["cap_eff"] != "0000000000000000":
        problems.append(f"CapEff {facts['cap_eff']}")
    if facts["no_new_privs"] != "1":
        problems.append("NoNewPrivs not set")
    if facts["interfaces"] != ["lo"]:
        problems.append(f"interfaces {facts['interfaces']}")
    if facts["rootfs_writable"]:
        problems.append("root filesystem writable")
    if facts["memory_limit"] != policy.memory:
        problems.append(f"memory limit {facts['memory_limit']} != {policy.memory}")
    if facts["pids_limit"] != policy.pids:
        problems.append(f"pids limit {facts['pids_limit']} != {policy.pids}")
    if not rec.cleanup_confirmed:
        problems.append("probe container not removed")
    detail = (f"uid {facts['uid']}, CapEff {facts['cap_eff']}, NoNewPrivs "
              f"{facts['no_new_privs']}, net {facts['interfaces']}, mem {facts['memory_limit']},"
              f" pids {facts['pids_limit']}, {rec.wall_s:.2f}s")
    sec = seccomp_problems(facts)
    return [Check("limits enforced", not problems, detail if not problems else
                  "; ".join(problems), "the engine does not enforce cgroup limits; check dockerd"),
            Check(f"seccomp enforced ({policy.runtime or 'default runtime'})", not sec,
                  "; ".join(sec) or ", ".join(f"{k} {v}" for k, v in
                                              sorted(facts["syscalls"].items())),
                  "the container did not get policies/seccomp.json; "
                  "check runner/isolation/docker/hardening.py")]
