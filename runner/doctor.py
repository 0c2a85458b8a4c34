"""Prerequisite checks, run before any work (``cyclebox doctor``).

Each check returns a value with the fix in it; nothing here raises for a failed
check. The limits check runs a real probe container and compares what the probe
observed from inside against the role policy.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import CycleboxError
from runner.paths import state_dir
from runner.policy import ROLES

if TYPE_CHECKING:
    from runner.docker_backend import DockerSandbox
    from runner.policy import RolePolicy

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


def run_checks(policies_path: Path, *, probe: bool = True) -> list[Check]:
    from runner.docker_backend import DockerSandbox, connect, engine_info
    from runner.images import read_lock
    from runner.policy import load_policies

    checks: list[Check] = []
    try:
        pols = load_policies(policies_path)
        checks.append(Check("policies", True, f"{policies_path}: {len(pols.roles)} roles valid"))
    except CycleboxError as exc:
        return [Check("policies", False, str(exc), "fix the field named above")]
    try:
        client = connect(timeout=10)
    except CycleboxError as exc:
        return [*checks, Check("engine", False, str(exc), "make docker")]
    info = engine_info(client)
    checks.append(Check("engine", True, f"Docker {info.version} (API {info.api_version}), "
                        f"{info.storage_driver}, cgroup v{info.cgroup_version}"))
    seccomp = any("seccomp" in s for s in info.security_options)
    checks.append(Check("seccomp", seccomp, ", ".join(info.security_options) or "none reported",
                        "use an engine built with seccomp support"))
    backend = DockerSandbox(client)
    lock = read_lock()
    for role in ROLES:
        row = lock.get(role)
        present = row is not None and backend.image_id(row.id) is not None
        detail = (f"{row.tag} {row.id[:19]} {row.size_bytes / 1e6:.0f} MB" if row and present
                  else "not built")
        checks.append(Check(f"image {role}", present, detail, "cyclebox images build"))
    for label, path in (("disk (state dir)", state_dir()), ("disk (engine root)",
                                                            Path(info.docker_root))):
        target = path if path.exists() else path.parent
        try:
            free = shutil.disk_usage(target).free
        except OSError:
            continue
        checks.append(Check(label, free >= MIN_FREE_BYTES, f"{free / 1024**3:.1f} GiB free at "
                            f"{target}", f"free at least {MIN_FREE_BYTES // 1024**3} GiB"))
    if probe and lock.get("analyst") and backend.image_id(lock["analyst"].id):
        checks.append(_probe_limits(backend, pols.roles["analyst"], lock["analyst"].id))
    return checks


def _probe_limits(backend: DockerSandbox, policy: RolePolicy, image: str) -> Check:
    """Run sandbox.probe in the analyst image and compare what it saw with the policy."""
    from runner.roles import role_spec

    spec = role_spec(policy, role="analyst", run_id="doctor", image=image,
                     command=["python", "-m", "sandbox.probe", "--role", "analyst"])
    rec = backend.run(spec)
    if rec.stop_reason.value != "ok":
        return Check("limits enforced", False, f"probe {rec.stop_reason.value}: "
                     f"{rec.detail} {rec.stderr_tail[-300:]}", "see the engine log")
    from runner.collect import loads_strict

    facts = loads_strict(rec.stdout_tail, source="probe container stdout")
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
    return Check("limits enforced", not problems, detail if not problems else
                 "; ".join(problems), "the engine does not enforce cgroup limits; check dockerd")
