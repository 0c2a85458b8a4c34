"""Role hardening as data: ``policies/roles.yaml`` loaded into frozen models.

Loading refuses, naming the field and the reason, anything the isolation contract
(SPEC §2) forbids: privileged, any network but none, added capabilities, host
namespaces, devices, the Docker socket or host system directories as mounts,
writable input mounts, a mount or tmpfs at, under or above a container path the
controller or the engine mounts itself (:data:`CONTROLLER_TARGETS`), and limits outside
what the engine can set (:data:`NOFILE_MAX`, :data:`ROLE_SIZE_MAX`). The checks are pure
functions over values.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from runner.errors import ConfigError, PolicyViolation
from runner.isolation.sandbox import Frozen
from runner.isolation.seccomp import load_profile
from runner.loading import check_schema, load_data, show, validate

SCHEMA_VERSION = 1
ROLES = ("analyst", "worker", "evaluator", "apply", "trainer")
ROLE_UPSTREAM = {"analyst": "target", "worker": "optimizer", "evaluator": "judge"}
"""The only upstream each model-using role may name: the worker spends optimizer
credentials only, the analyst target credentials only, the judge its own. The upstreams
themselves (provider, models, prices, credential names) are defined in the cycle file
only; this file says which role may reach which of them."""

# CIS Docker Benchmark 5.5 lists these; the engine's own state and sockets join them.
SENSITIVE_HOST_PATHS = (
    "/", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/sys", "/usr", "/bin", "/sbin",
    "/run", "/var/run", "/var/lib/docker", "/var/lib/containerd", "/root",
)
SOCKET_SCAN_LIMIT = 50_000
"""Entries scanned under a mounted directory looking for unix sockets (fail closed above)."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


MAX_SIZE = 1 << 50
"""Largest size accepted (1 PiB): anything above is a typo, not a limit."""

ROLE_SIZE_MAX = 1 << 40
"""Largest size a role policy may give (1 TiB) to ``memory``, ``file_size``,
``stdout_cap``, ``output_cap`` and each tmpfs: generous for any host, small enough that
a typo is refused when the file loads rather than by the engine at run time."""
NOFILE_MAX = 1 << 20
"""Largest ``nofile`` (1048576, the kernel's default ``fs.nr_open``): above it the
runtime cannot set the rlimit and every container fails to start."""
ID_MAX = 2**32 - 2
"""Largest uid/gid (``(uid_t)-1`` is "no id")."""


def _size_range(field: str, n: int) -> int:
    if n > ROLE_SIZE_MAX:
        raise ValueError(f"{field} {n} bytes is above the 1 TiB cap; allowed range: "
                         f"1 byte to 1t ({ROLE_SIZE_MAX} bytes)")
    return n


def parse_size(value: object) -> int:
    """Bytes (> 0) from an int or a string like ``512m``, ``1.5g``, ``64MiB``."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        # ValueError, not TypeError: pydantic turns only ValueError into a field error
        raise ValueError(f"not a size: {str(value)[:40]!r} (use bytes or a suffix k, m, g, "  # noqa: TRY004
                         "e.g. '512m')")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(value[:64])
        if not m or len(value) > 64:
            raise ValueError(f"not a size: {value[:40]!r} (use bytes or a suffix k, m, g, "
                             "e.g. '512m')")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"size must be positive, got {str(value)[:40]!r}")
    if n > MAX_SIZE:
        raise ValueError(f"size {str(value)[:40]!r} is larger than {MAX_SIZE} bytes")
    return n


_USER = re.compile(r"^([0-9]+):([0-9]+)$")


def _id_pair(user: str) -> tuple[int, int]:
    """(uid, gid) from a numeric ``uid:gid``; ValueError naming the value otherwise."""
    m = _USER.match(user)
    if m is None:
        raise ValueError(f"user must be a numeric uid:gid, got {user[:40]!r}")
    return int(m.group(1)), int(m.group(2))


class PolicyMount(Frozen):
    """A fixed input mount a role always gets (e.g. a shared data directory)."""

    source: str
    """Absolute host path."""
    target: str
    """Absolute path inside the container."""
    mode: str = "ro"
    """Must be ``ro``: inputs are read-only; outputs go to the stage's own directory."""


class RolePolicy(Frozen):
    """Hardening and resource defaults for one role."""

    image: str
    """Role image name under ``images/`` (e.g. ``analyst``)."""
    user: str = "10001:10001"
    """Non-root ``uid:gid`` the role runs as."""
    memory: int
    """Memory limit in bytes (strings like ``512m`` accepted)."""
    cpus: float = Field(gt=0, le=64, allow_inf_nan=False)
    """CPU quota in cores."""
    pids: int = Field(gt=0, le=32768)
    """Process/thread limit."""
    nofile: int = Field(default=1024, gt=0)
    """Open-file limit (at most :data:`NOFILE_MAX`)."""
    file_size: int = 256 * 1024 * 1024
    """Largest single file a process may write."""
    tmpfs: dict[str, int] = Field(default_factory=lambda: {"/tmp": 64 * 1024 * 1024})  # noqa: S108
    """Scratch mounts: container path -> size cap."""
    timeout_s: float = Field(gt=0, le=7 * 86400, allow_inf_nan=False)
    """Wall-clock limit per container (at most a week)."""
    stdout_cap: int = 1024 * 1024
    """stdout+stderr cap in bytes."""
    output_cap: int = 64 * 1024 * 1024
    """Output directory cap in bytes."""
    runtime: str | None = None
    """OCI runtime, e.g. ``runsc``; engine default when unset."""
    seccomp: str | None = None
    """Seccomp profile (JSON file, relative to this file); unset: the shipped
    ``policies/seccomp.json``. It must refuse by default and refuse io_uring."""
    env: dict[str, str] = Field(default_factory=dict)
    """Non-secret environment for the role."""
    mounts: tuple[PolicyMount, ...] = ()
    """Fixed read-only input mounts."""
    upstream: str | None = None
    """Model upstream this role may reach through the gateway (see ROLE_UPSTREAM); none: no
    model access. Its definition comes from the cycle file's ``upstreams``; a cycle that
    does not use it (e.g. no ``judge:``) mounts no gateway socket into the role."""
    # Fields below exist so that a policy asking for them is refused by name
    # rather than silently ignored.
    network: str = "none"
    """Must be ``none``; model traffic goes through the gateway socket."""
    privileged: bool = False
    """Must be false."""
    cap_add: tuple[str, ...] = ()
    """Must be empty; every capability is dropped."""
    pid_mode: str | None = None
    """Must be unset (never ``host``)."""
    ipc_mode: str | None = None
    """Must be unset or ``private``/``none``."""
    uts_mode: str | None = None
    """Must be unset."""
    userns_mode: str | None = None
    """Must be unset."""
    devices: tuple[str, ...] = ()
    """Must be empty."""

    @property
    def uid(self) -> int:
        """The numeric user id of :attr:`user` (checked non-root when the file loads)."""
        return _id_pair(self.user)[0]

    @property
    def gid(self) -> int:
        """The numeric group id of :attr:`user`."""
        return _id_pair(self.user)[1]

    @field_validator("memory", "file_size", "stdout_cap", "output_cap", mode="before")
    @classmethod
    def _size(cls, v: Any, info: ValidationInfo) -> int:
        return _size_range(str(info.field_name), parse_size(v))

    @field_validator("nofile")
    @classmethod
    def _nofile(cls, v: int) -> int:
        if v > NOFILE_MAX:
            raise ValueError(f"nofile {v} is above {NOFILE_MAX} (the kernel's default "
                             "fs.nr_open: the runtime cannot set more); allowed range: "
                             f"1 to {NOFILE_MAX}")
        return v

    @field_validator("tmpfs", mode="before")
    @classmethod
    def _tmpfs(cls, v: Any) -> dict[str, int]:
        if not isinstance(v, dict):
            raise ValueError(  # noqa: TRY004 - pydantic reports only ValueError by field
                "tmpfs must map a container path to a size, e.g. {/tmp: 64m}")
        for k in v:
            if not isinstance(k, str) or not k.startswith("/"):
                raise ValueError(f"tmpfs path {str(k)[:60]!r} must be an absolute container "
                                 "path")
        return {k: _size_range(f"tmpfs {k}", parse_size(s)) for k, s in v.items()}


class RolePolicies(Frozen):
    """The whole ``roles.yaml``: hardening and resources per role, nothing else."""

    schema_: int = Field(alias="schema")
    """File format version; this code reads version 1."""
    roles: dict[str, RolePolicy]
    """Role name -> policy."""


def _is_within(path: PurePosixPath, parent: PurePosixPath) -> bool:
    return path == parent or parent in path.parents


HOLDER_MOUNT = "/.cyclebox-holder"
"""Where a container finds the holder's code (:mod:`runner.isolation.docker.hardening`)."""
GATEWAY_ROOT = "/run/cyclebox"
"""Parent of the gateway socket's directory (``runner.gateway.server.CONTAINER_DIR``)."""

ENGINE_TARGETS: dict[str, str] = {
    "/": "the container's root filesystem",
    "/proc": "the container's proc filesystem",
    "/sys": "the container's sysfs",
    "/dev": "the container's devices and /dev/shm",
    GATEWAY_ROOT: "where the gateway socket is mounted (/run/cyclebox/gateway)",
    # the images' /var/run is a link to /run: a mount there lands on /run/cyclebox
    "/var" + GATEWAY_ROOT: "where the gateway socket is mounted (/var/run is /run)",
    HOLDER_MOUNT: "the holder's code",
}
"""Container paths every role container has, whatever runs it (a cycle stage,
``sandbox exec``, training): no extra mount may be at, under or above one."""
STAGE_TARGETS: dict[str, str] = {
    "/src": "the frozen project tree (analyst)",
    "/case": "the case input (analyst)",
    "/data": "the frozen data directory (analyst)",
    "/in": "the stage's inputs",
    "/ref": "the reference answers (evaluator)",
    "/cfg": "the evaluator's configuration",
    "/scorer": "the project's frozen scorer (evaluator)",
    "/out": "the role's output",
    "/work": "the apply stage's output",
    "/model": "the base model (trainer)",
    "/adapter": "the trained adapter (trainer)",
    "/corpus": "the training corpus (trainer)",
}
"""Container paths the controller mounts itself in the stages of a cycle
(``runner/cycle/run.py``, ``runner/cycle/apply.py``, ``runner/train/host.py``; each
output target is a tmpfs). A role policy's ``mounts`` apply in every stage its role runs
in, so none may be at, under or above any of these either: it would shadow frozen input
with an unhashed host directory, or collide with the controller's own mount."""
CONTROLLER_TARGETS: dict[str, str] = {**ENGINE_TARGETS, **STAGE_TARGETS}
"""Every container path no role policy mount or tmpfs may touch."""
TARGET_FIX = "mount it elsewhere, e.g. under /mnt (/mnt/NAME)"


def normal_target(target: str) -> str:
    """A container path as the engine resolves it (``//``, ``/./``, ``..``, a trailing
    slash)."""
    return "/" + posixpath.normpath("/" + target).lstrip("/")


def target_within(target: str, root: str) -> bool:
    """``target`` is ``root`` or lies under it, however spelled: the engine resolves the
    path the same way (``root`` is normal already)."""
    p = normal_target(target)
    return p == root or p.startswith(root.rstrip("/") + "/")


def target_clash(target: str, reserved: dict[str, str]) -> str | None:
    """Why container path ``target`` may not be mounted, given ``reserved`` (normal
    path -> what is there): it is, lies under or contains one of them; None if free."""
    p = normal_target(target)
    for root, what in reserved.items():
        if p == root:
            return f"target {target} is {root}, {what}"
        if root != "/" and target_within(p, root):
            return f"target {target} lies under {root}, {what}"
        if target_within(root, p):
            return f"target {target} contains {root}, {what}, and would hide it"
    return None


def target_problems(role: str, p: RolePolicy) -> list[tuple[str, str, str]]:
    """(field, reason, fix) for every policy mount or tmpfs at, under or above a path
    the controller or the engine mounts itself (:data:`CONTROLLER_TARGETS`), every extra
    mount at, under or above one of the role's tmpfs paths, and any two at one path.
    Pure: it reads nothing on the host."""
    out: list[tuple[str, str, str]] = []
    f = f"roles.{role}"
    tmpfs: dict[str, str] = {}
    for path in p.tmpfs:
        norm = normal_target(path)
        why = target_clash(path, CONTROLLER_TARGETS)
        if why:
            out.append((f"{f}.tmpfs", f"tmpfs {why}", "use a scratch path such as /tmp"))
        elif norm in tmpfs:
            out.append((f"{f}.tmpfs", f"tmpfs {path} and {tmpfs[norm]} are the same path",
                        "list each tmpfs path once"))
        tmpfs.setdefault(norm, path)
    reserved = {**CONTROLLER_TARGETS,
                **{norm: f"the role's tmpfs {path}" for norm, path in tmpfs.items()}}
    seen: dict[str, int] = {}
    for i, m in enumerate(p.mounts):
        if not m.target.startswith("/"):
            continue  # refused by policy_violations
        field = f"{f}.mounts[{i}].target"
        why = target_clash(m.target, reserved)
        if why:
            out.append((field, why, TARGET_FIX))
        norm = normal_target(m.target)
        if norm in seen:
            out.append((field, f"target {m.target} is also the target of "
                        f"{f}.mounts[{seen[norm]}]", "give each mount its own target"))
        seen.setdefault(norm, i)
    return out


def find_socket(root: str, limit: int = SOCKET_SCAN_LIMIT) -> str | None:
    """A unix socket at or under ``root`` (never following links), or a reason it could
    not be ruled out. Sockets are found by type, not by name: an engine's API socket
    hard-linked or renamed into a data directory is still a socket."""
    try:
        st = os.stat(root)  # follows a symlinked root on purpose: that is what binds
    except OSError:
        return None
    if stat.S_ISSOCK(st.st_mode):
        return root
    if not stat.S_ISDIR(st.st_mode):
        return None
    from runner import fswalk

    try:
        # by directory descriptor: a socket past PATH_MAX, or behind a directory that
        # cannot be read, is never missed silently
        for e in fswalk.walk(root, max_depth=4096, max_entries=limit):
            if stat.S_ISSOCK(e.st.st_mode):
                return f"{root}/{fswalk.shown(e.rel)}"
    except fswalk.WalkError as exc:
        return f"{root}/{exc} (could not rule out a socket)"
    return None


def mount_violation(source: str, *, read_only: bool, allow_writable: bool = False,
                    allow_socket: bool = False) -> str | None:
    """Why this host path may not be mounted, or None when it may.

    Both the path as written and its resolved form are checked, so a symlink to
    ``/etc`` is caught too. No unix socket may be mounted (a container engine's API
    socket gives root on the host), except the gateway socket the controller binds
    itself (``allow_socket``).
    """
    if not source.startswith("/"):
        return f"mount source must be an absolute host path, got {source!r}"
    candidates = {PurePosixPath(os.path.normpath(source)),
                  PurePosixPath(os.path.realpath(source))}
    for cand in candidates:
        for sens in SENSITIVE_HOST_PATHS:
            s = PurePosixPath(sens)
            if _is_within(cand, s) and not (sens == "/" and cand != s):
                return f"{source} is or lies under the host system directory {sens}"
            if sens != "/" and _is_within(s, cand):
                return f"{source} contains the host system directory {sens}"
    if not read_only and not allow_writable:
        return f"{source} is mounted writable; inputs must be read-only"
    if not allow_socket:
        sock = find_socket(source)
        if sock:
            return f"{source}: unix socket {sock}; sockets are never mounted into a role"
    return None


def policy_violations(role: str, p: RolePolicy) -> list[tuple[str, str, str]]:
    """(field, reason, fix) for every forbidden setting in one role policy."""
    out: list[tuple[str, str, str]] = []
    f = f"roles.{role}"
    if p.privileged:
        out.append((f"{f}.privileged", "privileged containers are forbidden", "remove the key"))
    if p.network != "none":
        out.append((f"{f}.network", f"network must be 'none', got {p.network!r}",
                    "set network: none; model calls go through the gateway socket"))
    if p.cap_add:
        out.append((f"{f}.cap_add", f"capabilities may not be added: {list(p.cap_add)}",
                    "remove cap_add; every capability is dropped"))
    for ns in ("pid_mode", "uts_mode", "userns_mode"):
        if getattr(p, ns) is not None:
            out.append((f"{f}.{ns}", f"host or shared namespaces are forbidden "
                        f"({ns}={getattr(p, ns)!r})", f"remove {ns}"))
    if p.ipc_mode not in (None, "private", "none"):
        out.append((f"{f}.ipc_mode", f"ipc_mode {p.ipc_mode!r} shares an IPC namespace",
                    "remove ipc_mode or use private"))
    if p.devices:
        out.append((f"{f}.devices", f"host devices may not be exposed: {list(p.devices)}",
                    "remove devices"))
    if not re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", p.user):
        out.append((f"{f}.user", f"user must be a non-root numeric uid:gid, got {p.user!r}",
                    "use e.g. 10001:10001"))
    elif max(_id_pair(p.user)) > ID_MAX:
        out.append((f"{f}.user", f"uid and gid must be between 1 and {ID_MAX}, got "
                    f"{p.user[:40]!r}", "use e.g. 10001:10001"))
    for i, m in enumerate(p.mounts):
        if m.mode not in ("ro", "rw"):
            out.append((f"{f}.mounts[{i}].mode", f"mode must be ro, got {m.mode!r}", "use ro"))
            continue
        why = mount_violation(m.source, read_only=m.mode == "ro")
        if why:
            out.append((f"{f}.mounts[{i}]", why, "mount only data directories, read-only"))
        if not m.target.startswith("/"):
            out.append((f"{f}.mounts[{i}].target", "target must be absolute",
                        "e.g. /mnt/data"))
    for path in p.tmpfs:
        if not path.startswith("/"):
            out.append((f"{f}.tmpfs", f"tmpfs path {path!r} must be absolute", "e.g. /tmp"))
    out.extend(target_problems(role, p))
    need = memory_needed(p)
    if p.memory < need:
        out.append((f"{f}.memory", f"memory {p.memory} leaves no room for the tmpfs mounts: "
                    f"tmpfs {sum(p.tmpfs.values())} + output_cap {p.output_cap} + /dev/shm "
                    f"{SHM_BYTES} are charged to the memory limit, plus {MEMORY_HEADROOM} "
                    "for the processes", f"raise memory to at least {need} or lower "
                    "output_cap/tmpfs"))
    return out


POLICIES_FIX = "see policies/roles.yaml for the accepted keys"


SHM_BYTES = 16 * 1024 * 1024
"""Size of /dev/shm in every role container (``runner.isolation.docker.hardening.SHM_BYTES``)."""
MEMORY_HEADROOM = 64 * 1024 * 1024
"""Least memory left for a role's processes when every tmpfs is full."""


def memory_needed(p: RolePolicy) -> int:
    """Smallest memory limit for a role: tmpfs pages (``/tmp``, the output tmpfs of
    ``output_cap`` bytes, ``/dev/shm``) are charged to the container's memory cgroup and
    cannot be swapped (swap is off), so a role that fills them all must still have
    ``MEMORY_HEADROOM`` to run in; otherwise filling its output would end ``oom``."""
    return sum(p.tmpfs.values()) + p.output_cap + SHM_BYTES + MEMORY_HEADROOM


UPSTREAMS_MOVED = ("model upstreams are defined in the cycle file, not the role policy "
                   "file (which carries hardening only)")
UPSTREAMS_MOVED_FIX = ("move this upstreams: mapping into cycle.yaml (same keys; script "
                       "paths then resolve against the cycle file) and delete it here")


def parse_policies(data: Any, *, path: str) -> RolePolicies:
    """Validate parsed YAML into policies, refusing forbidden settings by field."""
    check_schema(data, SCHEMA_VERSION, path=path)
    if isinstance(data, dict) and "upstreams" in data:
        raise ConfigError(UPSTREAMS_MOVED, path=path, field="upstreams",
                          fix=UPSTREAMS_MOVED_FIX)
    pols = validate(RolePolicies, data, path=path, fix=POLICIES_FIX)
    for role, pol in pols.roles.items():
        if pol.upstream is not None:
            allowed = ROLE_UPSTREAM.get(role)
            if pol.upstream != allowed:
                raise PolicyViolation(
                    f"role {role} may not use upstream {pol.upstream!r}"
                    + (f"; only {allowed!r}" if allowed else "; it has no model access"),
                    path=path, field=f"roles.{role}.upstream",
                    fix=f"set upstream: {allowed}" if allowed else "remove upstream")
        problems = policy_violations(role, pol)
        if problems:
            field, reason, fix = problems[0]
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            raise PolicyViolation(reason + more, path=path, field=field, fix=fix)
    return pols


def load_policies(path: Path, *, ref: tuple[str, str] | None = None) -> RolePolicies:
    """Read and validate a roles file; a relative seccomp path resolves against it."""
    data = load_data(path, fmt="yaml", what="role policy file", ref=ref,
                     fix="pass an existing roles.yaml (default policies/roles.yaml)")
    pols = parse_policies(data, path=show(str(path)))
    base = path.resolve().parent
    roles = dict(pols.roles)
    for name, pol in pols.roles.items():
        if pol.seccomp:
            # Checked now so a bad profile is refused by field before any work starts.
            seccomp = Path(pol.seccomp).expanduser()
            prof = load_profile(seccomp if seccomp.is_absolute() else (base / seccomp).resolve(),
                                field=f"roles.{name}.seccomp")
            roles[name] = pol.model_copy(update={"seccomp": prof.path})
    return pols.model_copy(update={"roles": roles})
