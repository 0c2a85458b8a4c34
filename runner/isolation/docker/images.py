"""Role images built offline and tagged by a hash of everything they are built from.

The base image comes from ``images/base/bootstrap.sh`` (debootstrap + docker import,
or ``BASE_IMAGE``). Wheels for each role are downloaded on the host into
``build/wheels/<role>/`` and the image is built with ``--network none`` from an
assembled context. The tag ``cyclebox/<role>:<hash>`` covers the base image id,
the Dockerfile, harden.sh, the requirements, the wheel files and the sandbox
sources, so an unchanged rebuild finds its tag and does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from runner.errors import ConfigError, PrerequisiteError
from runner.hashing import sha256_file
from runner.isolation.policy import ROLES
from runner.paths import images_dir, sandbox_src, state_dir

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
Log = Callable[[str], None]


@dataclass(frozen=True)
class BuiltImage:
    """One role image as recorded in ``build/images.lock.json``."""

    role: str
    tag: str
    id: str
    input_hash: str
    size_bytes: int
    built: bool
    """True when this call built it; False when the tag already existed."""
    seconds: float


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ensure_base(log: Log) -> str:
    """Image reference of the base image, bootstrapping it when missing."""
    script = images_dir() / "base" / "bootstrap.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise PrerequisiteError(f"base image bootstrap failed:\n{proc.stderr.strip()}\n"
                                "Fix: run as root with debootstrap installed, or set "
                                "BASE_IMAGE=python:3.11-slim after pulling it.")
    for line in proc.stderr.splitlines():
        log(line)
    return proc.stdout.strip().splitlines()[-1]


def wheel_dir(role: str) -> Path:
    return state_dir() / "wheels" / role


def ensure_wheels(role: str, log: Log) -> Path:
    """Download the role's wheels once per requirements content; return the directory."""
    req = images_dir() / role / "requirements.txt"
    if not req.is_file():
        raise ConfigError("missing", path=str(req), fix="every role image needs requirements.txt")
    extra = os.environ.get("PIP_DOWNLOAD_ARGS", "")
    stamp_value = _sha(req.read_bytes() + extra.encode())
    wdir = wheel_dir(role)
    stamp = wdir / ".stamp"
    if stamp.is_file() and stamp.read_text().strip() == stamp_value:
        return wdir
    if wdir.exists():
        shutil.rmtree(wdir)
    wdir.mkdir(parents=True)
    reqs = [ln for ln in req.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if reqs:
        cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:",
               "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
               "--abi", "abi3", "--abi", "none", "-q", "-d", str(wdir), "-r", str(req)]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        cmd += extra.split()
        log(f"downloading wheels for {role} into {wdir}")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise PrerequisiteError(f"pip download for the {role} image failed:\n"
                                    f"{proc.stderr.strip()[-2000:]}\nFix: check network access "
                                    "to the package index, or PIP_DOWNLOAD_ARGS.")
    # Digest of the wheel set, computed once here (hashing torch each build is slow).
    digest = hashlib.sha256()
    for whl in sorted(wdir.glob("*.whl")):
        digest.update(whl.name.encode() + b"\0" + sha256_file(whl).encode() + b"\n")
    (wdir / ".digest").write_text(digest.hexdigest())
    stamp.write_text(stamp_value)
    return wdir


def _sandbox_files() -> list[Path]:
    root = sandbox_src()
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def input_hash(role: str, base_id: str, wheels: Path) -> str:
    """Hash of everything the role image is built from."""
    h = hashlib.sha256()
    h.update(f"role={role}\nbase={base_id}\n".encode())
    for f in (images_dir() / role / "Dockerfile", images_dir() / role / "requirements.txt",
              images_dir() / "harden.sh"):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(b"wheels=" + (wheels / ".digest").read_bytes() + b"\n")
    root = sandbox_src()
    for f in _sandbox_files():
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _assemble_context(role: str, wheels: Path) -> Path:
    ctx = state_dir() / "context" / role
    if ctx.exists():
        shutil.rmtree(ctx)
    (ctx / "wheels").mkdir(parents=True)
    shutil.copy2(images_dir() / role / "Dockerfile", ctx / "Dockerfile")
    shutil.copy2(images_dir() / role / "requirements.txt", ctx / "requirements.txt")
    shutil.copy2(images_dir() / "harden.sh", ctx / "harden.sh")
    for whl in wheels.glob("*.whl"):
        try:
            os.link(whl, ctx / "wheels" / whl.name)
        except OSError:
            shutil.copy2(whl, ctx / "wheels" / whl.name)
    root = sandbox_src()
    for f in _sandbox_files():
        dest = ctx / "sandbox" / f.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
    return ctx


def lock_path() -> Path:
    return state_dir() / "images.lock.json"


def read_lock() -> dict[str, BuiltImage]:
    p = lock_path()
    if not p.is_file():
        return {}
    data = json.loads(p.read_text())
    return {role: BuiltImage(**row) for role, row in data.items()}


def _write_lock(rows: dict[str, BuiltImage]) -> None:
    p = lock_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({r: asdict(b) for r, b in sorted(rows.items())}, indent=2))
    tmp.replace(p)


def build_roles(roles: list[str], log: Log, *, force: bool = False,
                nocache: bool = False) -> list[BuiltImage]:
    """Build (or find) each role image; record them in the lock file.

    ``force`` rebuilds even when the tag exists; ``nocache`` ignores the engine's layer
    cache (both for measuring cold builds).
    """
    from runner.isolation.docker.backend import DockerSandbox
    from runner.isolation.registry import get_sandbox

    for r in roles:
        if r not in ROLES:
            raise ConfigError(f"unknown role {r!r}", field="--role", fix=f"one of {ROLES}")
    backend = get_sandbox("docker")
    if not isinstance(backend, DockerSandbox):  # a backend registered over docker's name
        raise PrerequisiteError("role images are built by the docker backend")
    base_ref = ensure_base(log)
    base_id = backend.image_id(base_ref)
    if base_id is None:
        raise PrerequisiteError(f"base image {base_ref} not found after bootstrap")
    lock = read_lock()
    out = []
    for role in roles:
        t0 = time.monotonic()
        wheels = ensure_wheels(role, log)
        ih = input_hash(role, base_id, wheels)
        tag = f"cyclebox/{role}:{ih[:16]}"
        existing = backend.image_id(tag)
        built = existing is None or force
        if built:
            ctx = _assemble_context(role, wheels)
            log(f"building {tag} (network none)")
            for line in backend.build(ctx, tag, nocache=nocache,
                                      buildargs={"BASE_IMAGE": base_ref},
                                      labels={"io.cyclebox.role": role,
                                              "io.cyclebox.input_hash": ih,
                                              "io.cyclebox.base": base_id}):
                log(line)
            shutil.rmtree(ctx, ignore_errors=True)
            existing = backend.image_id(tag)
            if existing is None:
                raise PrerequisiteError(f"build of {tag} reported success but no image exists")
        assert existing is not None  # noqa: S101 - both branches above set it
        row = BuiltImage(role=role, tag=tag, id=existing, input_hash=ih,
                         size_bytes=backend.image_size(tag), built=built,
                         seconds=round(time.monotonic() - t0, 2))
        lock[role] = row
        out.append(row)
    _write_lock(lock)
    return out


def resolve_image(role: str) -> str:
    """Image id for a role from the lock file; PrerequisiteError with the fix if absent."""
    row = read_lock().get(role)
    if row is None:
        raise PrerequisiteError(f"no image built for role {role!r} (no entry in {lock_path()}). "
                                "Fix: cyclebox images build (or make images)")
    return row.id
