"""Turn a role policy plus a task into a :class:`RunSpec`; pure apart from reading ids."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from runner.errors import ConfigError
from runner.failures import is_environment_error
from runner.isolation.policy import (
    ENGINE_TARGETS,
    RolePolicy,
    mount_violation,
    normal_target,
    target_clash,
    target_problems,
)
from runner.isolation.sandbox import Mount, Resources, RunSpec
from runner.isolation.seccomp import load_profile
from runner.loading import show


def resolve_user(policy_user: str, *, host_uid: int, host_gid: int) -> str:
    """The uid:gid a role runs as.

    As root on the host, the policy's unprivileged uid (the controller chowns the
    output directory to it). As an ordinary user, that user's own uid, so that the
    files a role writes belong to the operator who must later read and delete them.
    """
    if host_uid == 0:
        return policy_user
    return f"{host_uid}:{host_gid}"


def parse_mount_flag(flag: str) -> Mount:
    """``SRC:DST[:ro|rw]`` from the CLI into a checked :class:`Mount` (default ro)."""
    parts = flag.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        raise ConfigError(f"expected SRC:DST[:ro|rw], got {flag!r}", field="--mount",
                          fix="e.g. --mount ./data:/data:ro")
    mode = parts[2] if len(parts) == 3 else "ro"
    if mode not in ("ro", "rw"):
        raise ConfigError(f"mode must be ro or rw, got {show(mode)}", field="--mount",
                          fix="end the flag with :ro (the default) or :rw")
    try:
        src = Path(parts[0]).expanduser().resolve()
        exists = src.exists()
    except (RuntimeError, OSError) as exc:  # ~nosuchuser, a name past NAME_MAX, a loop
        raise ConfigError(f"{show(parts[0])} is not a usable host path ({exc})",
                          field="--mount", fix="give an existing host directory") from None
    if not exists:
        raise ConfigError(f"{src} does not exist", field="--mount",
                          fix="bind mounts never create host paths; create it first")
    if not parts[1].startswith("/"):
        raise ConfigError(f"container path must be absolute, got {show(parts[1])}",
                          field="--mount", fix="e.g. --mount ./data:/data:ro")
    why = target_clash(parts[1], ENGINE_TARGETS)
    if why:
        raise ConfigError(show(why, 300), field="--mount", fix=MOUNT_FLAG_FIX)
    read_only = mode == "ro"
    # A writable mount is allowed only onto an empty directory: each stage writes to
    # a fresh place, so nothing already recorded can be altered.
    if not read_only and (not src.is_dir() or any(src.iterdir())):
        raise ConfigError(f"{src} is not an empty directory; writable mounts must be fresh",
                          field="--mount", fix="mount inputs :ro, or give an empty directory")
    why = mount_violation(str(src), read_only=read_only, allow_writable=not read_only)
    if why:
        raise ConfigError(why, field="--mount", fix="mount only data directories")
    return Mount(source=src, target=parts[1], read_only=read_only)


MOUNT_FLAG_FIX = "mount it elsewhere, e.g. --mount ./data:/data:ro or SRC:/mnt/NAME"


def check_mount_flags(policy: RolePolicy, mounts: Sequence[Mount], *,
                      output_target: str = "/out") -> None:
    """Refuse (ConfigError naming ``--mount``) a ``--mount`` whose container path is at,
    under or above the output target or one of the role's tmpfs paths, or the same as
    another ``--mount``'s or a policy mount's (:func:`parse_mount_flag` has refused the
    paths every container has already). Before any container exists: the engine would
    refuse a duplicate (rc 6), and a tmpfs would silently hide a bind under it."""
    reserved = {normal_target(output_target): "the role's output directory"}
    reserved.update({normal_target(t): f"the role's tmpfs {t}" for t in policy.tmpfs})
    taken = {normal_target(m.target): f"the policy's mount of {m.source}"
             for m in policy.mounts}
    for m in mounts:
        why = target_clash(m.target, reserved)
        if why:
            raise ConfigError(show(why, 300), field="--mount", fix=MOUNT_FLAG_FIX)
        norm = normal_target(m.target)
        if norm in taken:
            raise ConfigError(f"target {show(m.target)} is already the target of "
                              f"{show(taken[norm])}", field="--mount",
                              fix="give each mount its own container path")
        taken[norm] = f"--mount {m.source}:{m.target}"


def role_spec(policy: RolePolicy, *, role: str, run_id: str, image: str,
              command: Sequence[str], mounts: Sequence[Mount] = (),
              output_dir: Path | None = None, env: dict[str, str] | None = None,
              labels: dict[str, str] | None = None) -> RunSpec:
    """A run spec under the role's policy, running as the resolved non-root user.

    The role's seccomp profile is read and checked here (ConfigError naming
    ``roles.<role>.seccomp`` when it is missing, corrupt or allows io_uring)."""
    problems = target_problems(role, policy)
    if problems:  # a policy frozen before these checks existed
        field, reason, fix = problems[0]
        raise ConfigError(reason, field=field, fix=fix)
    all_mounts = [Mount(source=Path(m.source), target=m.target, read_only=True)
                  for m in policy.mounts] + list(mounts)
    seen = {normal_target(t): f"tmpfs {t}" for t in policy.tmpfs}
    for m in all_mounts:
        norm = normal_target(m.target)
        if norm in seen:
            raise ConfigError(f"two mounts at {m.target}: {seen[norm]} and "
                              f"{m.source}", field=f"roles.{role}.mounts",
                              fix="give each mount its own container path")
        seen[norm] = str(m.source)
    merged_env = dict(policy.env)
    merged_env.update(env or {})
    return RunSpec(
        run_id=run_id, role=role, image=image, command=tuple(command),
        user=resolve_user(policy.user, host_uid=os.getuid(), host_gid=os.getgid()),
        mounts=tuple(all_mounts), output_dir=output_dir,
        tmpfs=tuple(sorted(policy.tmpfs.items())),
        resources=Resources(memory_bytes=policy.memory, cpus=policy.cpus, pids=policy.pids,
                            nofile=policy.nofile, file_size_bytes=policy.file_size),
        timeout_s=policy.timeout_s, stdout_cap_bytes=policy.stdout_cap,
        output_cap_bytes=policy.output_cap, env=tuple(sorted(merged_env.items())),
        runtime=policy.runtime,
        seccomp=load_profile(Path(policy.seccomp) if policy.seccomp else None,
                             field=f"roles.{role}.seccomp").text,
        labels=tuple(sorted((labels or {}).items())),
    )


def fresh_output_dir(path: Path, *, uid: int | None = None) -> Path:
    """Create an empty output directory (0700, the operator's); refuse an existing one.

    The role never writes it: its output is a tmpfs inside the container that the host
    copies here (see :mod:`runner.isolation.copyout`), so it stays the operator's and ``uid`` (the
    role user, kept for callers) is not given it."""
    del uid
    if path.is_symlink() or path.exists():  # a dangling link too: never made through
        raise ConfigError(f"{path} already exists; evidence is never overwritten",
                          field="output directory", fix="choose a new directory")
    try:
        path.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        raise ConfigError(f"{path} already exists; evidence is never overwritten",
                          field="output directory", fix="choose a new directory") from None
    except OSError as exc:
        if is_environment_error(exc):
            raise
        raise ConfigError(f"cannot make {path}: {exc.strerror or exc}",
                          field="output directory",
                          fix="choose a new directory in a place you can write") from None
    return path
