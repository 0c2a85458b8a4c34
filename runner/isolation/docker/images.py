"""Role images built offline from one Dockerfile and tagged by a hash of what each copies in.

The base image comes from ``images/base/bootstrap.sh`` (debootstrap + docker import,
or ``BASE_IMAGE``). Every role builds from ``images/Dockerfile`` with ``--build-arg
ROLE=<role>``; ``images/roles.yaml`` says what each role copies in (its requirements
file and which sandbox files). Wheels are downloaded on the host into
``build/wheels/<role>/`` and the image is built with ``--network none`` from a context
assembled for that role alone.

Invariant: the tag ``cyclebox/<role>:<hash>`` covers exactly what the role's build reads
(the base image id, the Dockerfile, harden.sh, the role's roles.yaml entry, its
requirements, its wheel files and its own sandbox files) and nothing else, so an
unchanged rebuild finds its tag and does nothing, and an edit under ``sandbox/train``
rebuilds the trainer only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import Field, RootModel

from runner.errors import ConfigError, PrerequisiteError
from runner.hashing import canonical_bytes, sha256_file
from runner.isolation.policy import ROLES
from runner.isolation.sandbox import Frozen
from runner.loading import load_model, relative_inside, show
from runner.paths import images_dir, sandbox_src, state_dir

PIP_WHEELS_ONLY = """\
import json
import sys
from pip._internal.distributions.sdist import SourceDistribution
from pip._internal.exceptions import InstallationError
from pip._internal.resolution.resolvelib.factory import Factory

MARK = "CYCLEBOX-REFUSED "


def refuse(self, *args, **kwargs):
    raise InstallationError(
        f"refusing to build {self.req} on the host: only wheels are downloaded (a source "
        "distribution, direct URL or local path would run its build code here)")


def _source(ireq):
    parent = getattr(ireq, "comes_from", None)
    link = getattr(parent, "link", None)
    if link is not None:
        return link.filename
    return str(parent or "the requirements file")


def _no_direct_urls(make):
    def checked(self, ireq, *args, **kwargs):
        url = getattr(getattr(ireq, "req", None), "url", None)
        if ireq.link is not None or url:
            sys.stderr.write(MARK + json.dumps({"requirement": str(ireq.req or ireq.link),
                                                "source": _source(ireq)}) + "\\n")
            raise InstallationError(
                f"refusing the direct URL or path requirement {ireq.req or ireq.link} "
                f"(from {_source(ireq)}): only index wheels are downloaded")
        return make(self, ireq, *args, **kwargs)
    return checked


# Fail closed: a pip without these hooks is not run at all.
for owner, name in ((SourceDistribution, "prepare_distribution_metadata"),
                    (Factory, "_make_requirements_from_install_req")):
    if not callable(getattr(owner, name, None)):
        sys.stderr.write(f"ERROR: this pip has no {owner.__name__}.{name}; cyclebox cannot "
                         "guard its downloads\\n")
        sys.exit(2)
SourceDistribution.prepare_distribution_metadata = refuse
Factory._make_requirements_from_install_req = _no_direct_urls(
    Factory._make_requirements_from_install_req)
from pip._internal.cli.main import main
sys.exit(main(["download", *sys.argv[1:]]))
"""
"""``pip download`` with every source build and every direct URL or path requirement
refused. ``--only-binary=:all:`` covers index candidates only: a wheel's direct-URL
dependency (``Requires-Dist: x @ https://...`` or ``@ file:///...``) would be fetched (or
a host file copied) and an sdist built (its code run) to read its metadata. The
resolver's one funnel from a requirement to candidates refuses any requirement that
carries a link before anything behind it is touched, and writes one ``CYCLEBOX-REFUSED``
JSON line on stderr naming it and the wheel that asked. Run isolated (``-I``: no working
directory on sys.path, no PYTHON* variables)."""
REFUSED_MARK = "CYCLEBOX-REFUSED "
NETWORK_SIGNS = ("NewConnectionError", "Max retries exceeded", "ConnectionError",
                 "Temporary failure in name resolution", "Name or service not known",
                 "ProxyError", "SSLError", "ConnectTimeout", "ReadTimeout",
                 "Network is unreachable", "Connection refused", "Could not fetch URL",
                 "timed out")
"""Words in pip's output that mean the index could not be reached (a prerequisite), not
that the requirements cannot be satisfied (bad input)."""
MAX_REASON_CHARS = 1500

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
SCHEMA_VERSION = 1
ROLES_FIX = "see the comment at the top of images/roles.yaml"
Log = Callable[[str], None]


class RoleInputs(Frozen):
    """What one role's image copies in besides the shared Dockerfile and harden.sh."""

    requirements: str
    """Pip requirements file, relative to ``images/``."""
    sandbox: tuple[str, ...] = Field(min_length=1)
    """Glob patterns relative to ``sandbox/`` (pathlib rules); each must match a file."""


class ImageInputs(Frozen):
    """The whole ``images/roles.yaml``."""

    schema_: int = Field(alias="schema")
    """File format version; this code reads version 1."""
    host_only: tuple[str, ...] = ()
    """Files under ``sandbox/`` that no image copies (the host passes them in itself)."""
    roles: dict[str, RoleInputs]
    """Role name -> its inputs; exactly the roles of :data:`runner.isolation.policy.ROLES`."""


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


def load_inputs(images: Path | None = None) -> ImageInputs:
    """``images/roles.yaml``, checked: every role present, paths relative and inside."""
    path = (images or images_dir()) / "roles.yaml"
    inputs = load_model(path, ImageInputs, fix=ROLES_FIX, schema=SCHEMA_VERSION)
    where = show(str(path))
    if set(inputs.roles) != set(ROLES):
        missing = sorted(set(ROLES) - set(inputs.roles))
        extra = sorted(set(inputs.roles) - set(ROLES))
        raise ConfigError(f"roles must be exactly {list(ROLES)}; missing {missing}, unknown "
                          f"{extra}", path=where, field="roles", fix=ROLES_FIX)
    for i, name in enumerate(inputs.host_only):
        relative_inside(name, path=where, field=f"host_only[{i}]", fix=ROLES_FIX)
    for role, spec in inputs.roles.items():
        relative_inside(spec.requirements, path=where, field=f"roles.{role}.requirements",
                        fix=ROLES_FIX)
        for i, pattern in enumerate(spec.sandbox):
            relative_inside(pattern, path=where, field=f"roles.{role}.sandbox[{i}]",
                            fix=ROLES_FIX)
    return inputs


def requirements_file(role: str, inputs: ImageInputs, images: Path | None = None) -> Path:
    """The role's requirements file; ConfigError naming the roles.yaml field when absent."""
    root = images or images_dir()
    req = root / inputs.roles[role].requirements
    if not req.is_file():
        raise ConfigError(f"{req} does not exist", path=str(root / "roles.yaml"),
                          field=f"roles.{role}.requirements",
                          fix="every role image needs a requirements file (comments only "
                              "when it needs nothing beyond the base image)")
    return req


def role_files(role: str, inputs: ImageInputs, sandbox: Path | None = None) -> list[Path]:
    """The sandbox files the role copies in (regular files only, sorted, no bytecode).

    ConfigError naming ``roles.<role>.sandbox[i]`` when a pattern matches nothing, so a
    typo cannot silently leave a module out of an image."""
    root = sandbox or sandbox_src()
    skip = {root / name for name in inputs.host_only}
    files: set[Path] = set()
    for i, pattern in enumerate(inputs.roles[role].sandbox):
        hits = {p for p in root.glob(pattern)
                if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts
                and p.suffix != ".pyc" and p not in skip}
        if not hits:
            raise ConfigError(f"pattern {pattern!r} matches no file under {root}",
                              path=str(images_dir() / "roles.yaml"),
                              field=f"roles.{role}.sandbox[{i}]", fix=ROLES_FIX)
        files |= hits
    return sorted(files)


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


def ensure_wheels(role: str, log: Log, inputs: ImageInputs | None = None) -> Path:
    """Download the role's wheels once per requirements content; return the directory."""
    req = requirements_file(role, inputs or load_inputs())
    try:
        wdir = download_wheels(req, wheel_dir(role), log, what=f"the {role} image")
    except BaseException:  # a partial wheel set (full disk, signal): downloaded again next time
        shutil.rmtree(wheel_dir(role), ignore_errors=True)
        raise
    loose = unpinned_wheels(req.read_text(), [w.name for w in wdir.glob("*.whl")])
    if loose:
        raise ConfigError(
            f"{len(loose)} wheel(s) the index gave are not pinned to their version here: "
            f"{', '.join(loose[:8])}{' ...' if len(loose) > 8 else ''}; a new release on "
            "the index would change this image (and the analyst's constraints every "
            "agent's requirements are resolved against)", path=show(str(req)),
            field=loose[0].split("==")[0],
            fix=f"pin every package the image installs: add {' '.join(loose[:8])} "
                "(or the versions you want) to the file")
    return wdir


_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?"
                  r"\s*===?\s*([^\s;#,*]+)\s*(?:[;#].*)?$")


def pypi_name(name: str) -> str:
    """PEP 503's normalised project name (the form a pypi package URL takes)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def unpinned_wheels(requirements: str, wheels: list[str]) -> list[str]:
    """``name==version`` for each wheel file name whose distribution is not pinned to
    exactly its version in ``requirements`` (a local label such as ``+cpu`` matches a pin
    without one, as PEP 440's ``==`` does), sorted."""
    pins: dict[str, str] = {}
    for line in requirements.splitlines():
        m = _PIN.match(line)
        if m:
            pins[pypi_name(m.group(1))] = m.group(2)
    loose = set()
    for filename in wheels:
        parts = filename[:-len(".whl")].split("-") if filename.endswith(".whl") else []
        if len(parts) < 5:
            loose.add(filename)  # not a wheel name: nothing pins it
            continue
        name, version = pypi_name(parts[0]), parts[1]
        pin = pins.get(name)
        if pin is None or (version != pin and version.split("+")[0] != pin):
            loose.add(f"{name}=={version}")
    return sorted(loose)


WHEEL_SUMS = ".sha256"
"""``sha256sum``-format lines (one per wheel) beside ``.digest`` in a wheel directory."""


def wheel_set_digest(sums: dict[str, str]) -> str:
    """The digest of a wheel set: over each (file name, sha256), in name order."""
    digest = hashlib.sha256()
    for name, sha in sorted(sums.items()):
        digest.update(name.encode() + b"\0" + sha.encode() + b"\n")
    return digest.hexdigest()


def download_wheels(req: Path, wdir: Path, log: Log, *, what: str,
                   field: str | None = None) -> Path:
    """Wheels for ``req`` (cp311 manylinux) into ``wdir``, once per requirements content
    and ``PIP_DOWNLOAD_ARGS``; ``wdir/.digest`` is the digest of the wheel set.

    Downloaded into a fresh sibling directory renamed into place when complete: a failure
    leaves no wheel behind. Every wheel's metadata is checked for direct URL or path
    requirements (pip's hook refuses them before they are touched; the check here is the
    second line). With ``field`` (operator input, e.g. ``project.requirements``), what pip
    refuses is :class:`runner.requirements.RequirementsRefused` (exit 3, pip's reason
    shown); an index that cannot be reached stays a PrerequisiteError."""
    extra = os.environ.get("PIP_DOWNLOAD_ARGS", "")
    stamp_value = _sha(req.read_bytes() + extra.encode())
    stamp = wdir / ".stamp"
    if stamp.is_file() and stamp.read_text().strip() == stamp_value:
        _refuse_direct_urls(wdir, field)  # a set cached before this check existed
        return wdir
    if wdir.exists():
        shutil.rmtree(wdir)
    wdir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{wdir.name}.", dir=wdir.parent))
    try:
        reqs = [ln for ln in req.read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
        if reqs:
            _pip_download(req, work, extra, log, what=what, field=field)
        _refuse_direct_urls(work, field)
        # Digest of the wheel set, computed once here (hashing torch each build is slow).
        # Each wheel's sha256 is kept too (WHEEL_SUMS), for the run's provenance.
        sums = {whl.name: sha256_file(whl) for whl in sorted(work.glob("*.whl"))}
        (work / WHEEL_SUMS).write_text("".join(f"{h}  {n}\n" for n, h in sums.items()))
        (work / ".digest").write_text(wheel_set_digest(sums))
        (work / ".stamp").write_text(stamp_value)
        os.chmod(work, 0o755)  # noqa: S103 - mkdtemp's 0700; wheels are not secret
        work.rename(wdir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return wdir


def _refuse_direct_urls(wdir: Path, field: str | None) -> None:
    """RequirementsRefused naming the first wheel in ``wdir`` whose metadata requires a
    URL or path."""
    from runner.requirements import RequirementsRefused, requires_dist_urls

    for whl in sorted(wdir.glob("*.whl")):
        urls = requires_dist_urls(whl)
        if urls:
            raise RequirementsRefused(
                f"the wheel {whl.name} requires {urls[0]!r}: a direct URL or path "
                "requirement", field=field,
                fix="depend on packages from the index only (name and version)")


def _pip_download(req: Path, work: Path, extra: str, log: Log, *, what: str,
                  field: str | None) -> None:
    from runner.requirements import RequirementsRefused, pip_reason

    cmd = [sys.executable, "-I", "-c", PIP_WHEELS_ONLY, "--only-binary=:all:",
           "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
           "--abi", "abi3", "--abi", "none", "--no-color", "--progress-bar", "off",
           "-d", str(work.resolve()), "-r", str(req.resolve())]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    cmd += extra.split()
    log(f"downloading wheels for {what} into {work.parent}")
    # cwd: the fresh, empty wheel directory. pip resolves a requirement that looks
    # like an archive name against its working directory (the operator's, often the
    # project checkout) and would build an sdist found there on the host.
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE")}
    env["NO_COLOR"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=work,
                          env=env, errors="replace")
    if proc.returncode == 0:
        return
    stderr = proc.stderr.replace(str(req.resolve()), req.name)
    for line in stderr.splitlines():
        if line.startswith(REFUSED_MARK):
            try:
                got = json.loads(line[len(REFUSED_MARK):])
                refused, source = str(got["requirement"]), str(got["source"])
            except (ValueError, KeyError, TypeError):
                continue
            raise RequirementsRefused(
                f"{source} requires {refused!r}: a direct URL or path requirement; nothing "
                "behind it was fetched", field=field,
                fix="depend on packages from the index only (name and version)")
    # pip logs why a resolution is impossible at info level (stdout): keep that part.
    out = proc.stdout
    cause = out[out.find("The conflict is caused by"):] if "The conflict is caused by" in out \
        else ""
    reason = pip_reason(stderr + "\n" + cause, MAX_REASON_CHARS)
    if field is not None and not any(sign in stderr for sign in NETWORK_SIGNS):
        raise RequirementsRefused(
            f"pip cannot satisfy the requirements: {reason}", field=field,
            fix="check the names and versions (pip's reason above); pin versions that "
                "publish cp311 manylinux or pure-Python wheels (no sdist is built) and "
                "that agree with each other")
    raise PrerequisiteError(f"pip download for {what} failed: {reason}\nFix: check network "
                            "access to the package index, or PIP_DOWNLOAD_ARGS.")


def input_hash(role: str, base_id: str, wheels_digest: str, *,
               inputs: ImageInputs | None = None, images: Path | None = None,
               sandbox: Path | None = None) -> str:
    """Hash of everything the role's image build reads, and of nothing else.

    Shared: the base image id, ``images/Dockerfile`` and ``images/harden.sh``. The role's
    own: its roles.yaml entry, its requirements file, the digest of its wheels and the
    sandbox files it copies in (path and bytes). Another role's inputs never enter it."""
    images = images or images_dir()
    sandbox = sandbox or sandbox_src()
    inputs = inputs or load_inputs(images)
    h = hashlib.sha256()
    h.update(f"role={role}\nbase={base_id}\n".encode())
    h.update(b"inputs=" + canonical_bytes(inputs.roles[role].model_dump()) + b"\n")
    for name, f in (("Dockerfile", images / "Dockerfile"), ("harden.sh", images / "harden.sh"),
                    ("requirements.txt", requirements_file(role, inputs, images))):
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(b"wheels=" + wheels_digest.encode() + b"\n")
    for f in role_files(role, inputs, sandbox):
        h.update(b"sandbox/" + str(f.relative_to(sandbox)).encode() + b"\0"
                 + f.read_bytes() + b"\0")
    return h.hexdigest()


def link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def _assemble_context(role: str, wheels: Path, inputs: ImageInputs) -> Path:
    """The role's build context: the Dockerfile, its requirements and wheels, harden.sh
    and exactly the sandbox files :func:`input_hash` covered."""
    ctx = state_dir() / "context" / role
    if ctx.exists():
        shutil.rmtree(ctx)
    try:
        (ctx / "wheels").mkdir(parents=True)
        shutil.copy2(images_dir() / "Dockerfile", ctx / "Dockerfile")
        shutil.copy2(requirements_file(role, inputs), ctx / "requirements.txt")
        shutil.copy2(images_dir() / "harden.sh", ctx / "harden.sh")
        for whl in wheels.glob("*.whl"):
            link_or_copy(whl, ctx / "wheels" / whl.name)
        root = sandbox_src()
        for f in role_files(role, inputs):
            dest = ctx / "sandbox" / f.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
    except BaseException:  # a full disk or a signal: no partial context stays behind
        shutil.rmtree(ctx, ignore_errors=True)
        raise
    return ctx


def lock_path() -> Path:
    return state_dir() / "images.lock.json"


class _Lock(RootModel[dict[str, BuiltImage]]):
    """``images.lock.json``: role -> its image."""


def read_lock() -> dict[str, BuiltImage]:
    """The image lock (runner.loading rules); empty when no image was built yet."""
    p = lock_path()
    if not p.is_file():
        return {}
    return load_model(p, _Lock, fmt="json", what="image lock",
                      fix="rebuild it: cyclebox images build").root


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
    inputs = load_inputs()
    lock = read_lock()
    out = []
    for role in roles:
        t0 = time.monotonic()
        wheels = ensure_wheels(role, log, inputs)
        ih = input_hash(role, base_id, (wheels / ".digest").read_text().strip(),
                        inputs=inputs)
        tag = f"cyclebox/{role}:{ih[:16]}"
        existing = backend.image_id(tag)
        built = existing is None or force
        if built:
            ctx = _assemble_context(role, wheels, inputs)
            try:
                log(f"building {tag} (network none)")
                for line in backend.build(ctx, tag, nocache=nocache,
                                          buildargs={"BASE_IMAGE": base_ref, "ROLE": role},
                                          labels={"io.cyclebox.role": role,
                                                  "io.cyclebox.input_hash": ih,
                                                  "io.cyclebox.base": base_id}):
                    log(line)
            finally:  # a failed or interrupted build leaves no context behind either
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
