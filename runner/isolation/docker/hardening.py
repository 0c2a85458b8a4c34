"""Translate a :class:`RunSpec` into Docker create arguments; pure and tested directly.

Every role container meets the CIS Docker Benchmark v1.6 §5 (container runtime)
recommendations that apply to a short-lived batch container:

=====  =========================================  =======================================
CIS    recommendation                             how
=====  =========================================  =======================================
5.1/2  AppArmor / SELinux profile                 engine default profile (not disabled)
5.3    restrict capabilities                      ``cap_drop=[ALL]``, nothing added
5.4    no privileged containers                   ``privileged=False``
5.5    no sensitive host dirs mounted             :func:`runner.isolation.policy.mount_violation`
5.6    no sshd                                    images run one command, no daemons
5.7/8  no (privileged) ports mapped               no ports at all
5.9    no host network namespace                  ``network_mode=none``
5.10   memory limited                             ``mem_limit`` = ``memswap_limit``
5.11   CPU priority                               ``nano_cpus`` quota
5.12   read-only root filesystem                  ``read_only=True`` + capped tmpfs
5.14   restart policy                             ``no`` (a batch run is never restarted)
5.15   no host PID namespace                      ``pid_mode`` unset
5.16   no host IPC namespace                      ``ipc_mode=private``, capped /dev/shm
5.17   no host devices                            no devices, no device cgroup rules
5.18   override default ulimits                   ``nofile``, ``fsize`` set explicitly
5.19   no shared mount propagation                binds are ``rprivate``
5.20   no host UTS namespace                      ``uts_mode`` unset
5.21   default seccomp not disabled               moby's default minus io_uring, always
5.25   no new privileges                          ``no-new-privileges:true``
5.28   PIDs cgroup limit                          ``pids_limit``
5.29   not on the default bridge                  ``network_mode=none``
5.30   no host user namespace                     ``userns_mode`` unset
5.31   no Docker socket mounted                   no unix socket but the gateway's, by type
5.22/3 exec not privileged, not as root      no exec at all: the holder starts the role
=====  =========================================  =======================================

The role command is started by the holder (PID 1) as its child, so it runs as the
container's own non-root user under the container's seccomp filter, capability set and
no-new-privileges (see :mod:`sandbox.holder`); nothing is ever ``docker exec``'d.

Not applicable: 5.13 (no ports), 5.24 (default cgroup parent), 5.26 (health checks
are for services), 5.27 (images are pinned by id and never pulled on purpose).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from runner.errors import PolicyViolation
from runner.isolation.owner import Owner
from runner.isolation.policy import HOLDER_MOUNT, mount_violation
from runner.isolation.policy import target_within as _within
from runner.isolation.sandbox import GATEWAY_SOCKET, LABEL_PREFIX, MANAGED_LABEL, RunSpec
from runner.isolation.seccomp import for_runtime, load_profile
from sandbox import holder

SHM_BYTES = 16 * 1024 * 1024


def container_name(spec: RunSpec, nonce: str) -> str:
    """Engine-visible name: carries the run id and role so ``docker ps`` is readable."""
    return f"cyclebox-{spec.run_id}-{spec.role}-{nonce}"


def labels_for(spec: RunSpec, owner: Owner) -> dict[str, str]:
    """Labels that let ``cyclebox gc`` find the container and judge its owner."""
    labels = {k: v for k, v in spec.labels}
    labels.update({
        MANAGED_LABEL: "1",
        f"{LABEL_PREFIX}.run_id": spec.run_id,
        f"{LABEL_PREFIX}.role": spec.role,
        f"{LABEL_PREFIX}.owner_pid": str(owner.pid),
        f"{LABEL_PREFIX}.owner_start": str(owner.start),
        f"{LABEL_PREFIX}.owner_boot": owner.boot_id,
        f"{LABEL_PREFIX}.owner_host": owner.host,
    })
    return labels


def _tmpfs_opts(size: int) -> str:
    return f"rw,nosuid,nodev,noexec,size={size},mode=1777"


def create_kwargs(spec: RunSpec, owner: Owner, nonce: str, *,
                  holder_dir: Path) -> dict[str, Any]:
    """Keyword arguments for ``docker.containers.create``; raises on a forbidden mount.
    ``holder_dir``: this container's copy of :func:`holder_files` on the host, mounted
    read-only at :data:`HOLDER_MOUNT`."""
    mounts: list[dict[str, Any]] = [_bind(str(holder_dir), HOLDER_MOUNT, read_only=True)]
    for where, target in [*((f"mount {m.source}:{m.target}", m.target) for m in spec.mounts),
                          *((f"tmpfs {t}", t) for t, _ in spec.tmpfs),
                          *([("output_target", spec.output_target)]
                            if spec.output_dir is not None else [])]:
        if _within(target, HOLDER_MOUNT):
            raise PolicyViolation(f"{target} is or lies under {HOLDER_MOUNT}, where the "
                                  "holder's code is mounted", field=where,
                                  fix="mount it elsewhere")
    for m in spec.mounts:
        why = mount_violation(str(m.source), read_only=m.read_only, allow_socket=m.gateway)
        if why:
            raise PolicyViolation(why, field=f"mount {m.source}:{m.target}",
                                  fix="mount data directories read-only")
        mounts.append(_bind(str(m.source), m.target, read_only=m.read_only))
    tmpfs = {path: _tmpfs_opts(size) for path, size in spec.tmpfs}
    if spec.output_dir is not None:
        # Not a mount of the host directory: the output is a tmpfs capped by the kernel
        # in bytes and inodes, copied out by runner.isolation.copyout (see sandbox/holder.py).
        why = mount_violation(str(spec.output_dir), read_only=False, allow_writable=True)
        if why:
            raise PolicyViolation(why, field="output_dir", fix="use a fresh run directory")
        if spec.output_target in tmpfs or any(m.target == spec.output_target
                                              for m in spec.mounts):
            raise PolicyViolation(f"output target {spec.output_target} is also mounted",
                                  field="output_target", fix="use a distinct path")
        tmpfs[spec.output_target] = output_tmpfs_opts(spec)
    r = spec.resources
    kwargs: dict[str, Any] = {
        "image": spec.image,
        # PID 1 is the holder; it starts the role command itself when handed the case.
        "entrypoint": holder_argv(),
        "command": hold_args(spec),
        "name": container_name(spec, nonce),
        "user": spec.user,
        "working_dir": spec.workdir,
        # The environment is exactly what the spec says: nothing from the host.
        "environment": {k: v for k, v in spec.env},
        "labels": labels_for(spec, owner),
        "network_mode": "none",
        "read_only": True,
        "tmpfs": tmpfs,
        "mounts": mounts,
        "cap_drop": ["ALL"],
        # Never the engine default (it allows io_uring); see runner/isolation/seccomp.py.
        "security_opt": ["no-new-privileges:true",
                         "seccomp=" + for_runtime(spec.seccomp or load_profile().text,
                                                  spec.runtime)],
        "privileged": False,
        "ipc_mode": "private",
        "shm_size": SHM_BYTES,
        "pids_limit": r.pids,
        "mem_limit": r.memory_bytes,
        "memswap_limit": r.memory_bytes,
        "nano_cpus": int(r.cpus * 1e9),
        "ulimits": [
            {"Name": "nofile", "Soft": r.nofile, "Hard": r.nofile},
            {"Name": "fsize", "Soft": r.file_size_bytes, "Hard": r.file_size_bytes},
            {"Name": "core", "Soft": 0, "Hard": 0},
        ],
        "restart_policy": {"Name": "no"},
        # No engine-side log copy: output is streamed, counted and capped by the
        # controller, and nothing a role prints lands in the engine's log files.
        "log_config": {"Type": "none", "Config": {}},
        # the holder's stdin: the case hand-over (attached by the host before start;
        # the role command's own stdin is /dev/null). The engine closes it when the
        # host's attach ends (``StdinOnce``, set at create: see
        # runner.isolation.docker.prepared): a container prepared ahead then ends instead
        # of waiting, up, for a case that never comes (the host's process gone).
        "stdin_open": True,
        "tty": False,
        "detach": True,
        "hostname": "cyclebox",
    }
    if spec.runtime:
        kwargs["runtime"] = spec.runtime
    return kwargs


def hold_args(spec: RunSpec) -> list[str]:
    """The holder's arguments: the output directory (``-``: none) and, for a container
    given a gateway socket, that socket's path inside, to relay loopback TCP to it."""
    args = ["hold", spec.output_target if spec.output_dir is not None else "-"]
    gateways = [m for m in spec.mounts if m.gateway]
    if len(gateways) > 1:
        raise PolicyViolation("more than one gateway socket mounted", field="mounts",
                              fix="a container reaches exactly one binding")
    if gateways:
        args.append(f"{gateways[0].target.rstrip('/')}/{GATEWAY_SOCKET}")
    return args


def output_tmpfs_opts(spec: RunSpec) -> str:
    """The output tmpfs: ``output_cap_bytes`` of pages and ``output_max_entries`` files
    (plus its root), owned by the role user and private to it."""
    return (f"rw,nosuid,nodev,noexec,size={spec.output_cap_bytes},"
            f"nr_inodes={spec.output_max_entries + 1},mode=0700,uid={spec.uid},gid={spec.gid}")


# HOLDER_MOUNT (defined in runner.isolation.policy, with every other container path the
# controller owns, so that a role policy's mount there is refused when the file loads):
# where a container finds the holder's code, a read-only bind of a directory the host
# wrote for that one container (:func:`write_holder_files`, in its staging copy).


@functools.cache
def _holder_source() -> bytes:
    return Path(holder.__file__).read_bytes()


@functools.cache
def holder_files() -> dict[str, bytes]:
    """The files of the holder's directory: its source, and the host's compile of it
    (marshal) under this host's bytecode magic number, which the boot program prefers
    when the image's Python has the same one."""
    import importlib.util
    import marshal

    code = compile(_holder_source(), "<holder>", "exec")
    return {"holder.py": _holder_source(),
            f"{importlib.util.MAGIC_NUMBER.hex()}.code": marshal.dumps(code)}


def write_holder_files(dest: Path) -> Path:
    """Write :func:`holder_files` into the new directory ``dest`` (mode 0755, files 0444,
    never through a symlink or over an existing file); returns ``dest``."""
    dest.mkdir(mode=0o755)
    os.chmod(dest, 0o755)  # noqa: S103 - read (never written) by the role uid
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for name, data in holder_files().items():
        fd = os.open(dest / name, flags, 0o444)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(fd, 0o444)  # whatever the umask: the role uid reads it
    return dest


HOLDER_BOOT = """import _frozen_importlib_external as e
d = {where!r}
c = None
try:
    import marshal
    with open(d + "/" + e.MAGIC_NUMBER.hex() + ".code", "rb") as f:
        c = marshal.loads(f.read())
except Exception:
    c = None
if c is None:
    with open(d + "/holder.py", "rb") as f:
        c = compile(f.read(), "<holder>", "exec")
del d, e
exec(c)
"""
"""The holder's ``-c`` program: the code the host compiled from ``sandbox/holder.py``
(marshal, when the image's Python reads this host's bytecode: the file named by its
magic number exists), else that source compiled in the container. Compiling ~1200 lines
is ~half of the holder's start before READY (~7-12 ms per container); the bytecode is
the host's, like the source, never the image's. Both come from a directory mounted
read-only (:data:`HOLDER_MOUNT`), not from the container's arguments: ~100 KB of
arguments in every container's configuration cost the engine ~15 ms per container
(create, start, inspect and remove all carry it; ``bench/overhead.py``)."""


def holder_argv(*args: str, where: str = HOLDER_MOUNT) -> list[str]:
    """``python3 -I -S -c <boot> ARGS``: host-supplied code (:data:`HOLDER_BOOT`, reading
    the holder from ``where``), isolated from the image's packages and from anything the
    role wrote; inside, ``sys.argv`` is ``["-c", *ARGS]`` as when the source ran itself."""
    return ["python3", "-I", "-S", "-c", HOLDER_BOOT.format(where=where), *args]


def _bind(source: str, target: str, *, read_only: bool) -> dict[str, Any]:
    # Mount API rather than -v binds: a missing source is an error, never created.
    return {
        "Type": "bind",
        "Source": source,
        "Target": target,
        "ReadOnly": read_only,
        "BindOptions": {"Propagation": "rprivate"},
    }
