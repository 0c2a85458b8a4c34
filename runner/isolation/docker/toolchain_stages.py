"""One stage per agent toolchain for the derived-image builder (:mod:`.agent_image`).

Each resolver (pip: :mod:`runner.requirements` + ``download_wheels``; apt:
:mod:`runner.toolchain.apt`; npm: :mod:`runner.toolchain.npm_lock` +
:mod:`runner.toolchain.npm_fetch`) is wrapped as a :class:`Stage`: what it resolved
(``digest``: the content addresses of every artefact, known BEFORE anything is fetched
where the lockfile already names them), the versions it installs, and ``fill``, which
puts its artefacts into the build context only when the image must be built.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runner.errors import PrerequisiteError
from runner.hashing import sha256_file
from runner.isolation.docker.images import (
    WHEEL_SUMS,
    Log,
    download_wheels,
    link_or_copy,
    pypi_name,
    wheel_set_digest,
)
from runner.paths import state_dir
from runner.toolchain import AgentToolchains, ResolvedFile


@dataclass(frozen=True)
class Stage:
    """One toolchain's part of a derived image."""

    name: str
    """pip, apt or npm."""
    digest: str
    """sha256 over everything it installs (covered by the image's input hash)."""
    installed: list[str]
    """The pinned versions it installs (image label and the plan's record)."""
    fill: Callable[[Path], None]
    """Puts its artefacts into the build context directory."""
    artifacts: Callable[[], list[ResolvedFile]]
    """The files it installs (after ``fill``: the ones it put there; without: the same,
    from the resolution or the verified cache)."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def wheel_file(filename: str, sha256: str) -> ResolvedFile:
    """A wheel's entry from its file name (PEP 427: ``{name}-{version}(-{build})?-...``)."""
    parts = filename.removesuffix(".whl").split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise PrerequisiteError(f"{filename!r} is not a wheel file name. Fix: remove the "
                                "agent's wheel cache (state directory wheels/agent)")
    return ResolvedFile("pypi", pypi_name(parts[0]), parts[1], filename, sha256)


def wheel_files(wheels: Path, digest: str) -> list[ResolvedFile]:
    """The wheels of a directory :func:`download_wheels` filled: their sums as recorded at
    download (hashed again only for a directory cached before the sums were kept), and
    refused unless they are exactly the set its ``.digest`` covers."""
    names = sorted(w.name for w in wheels.glob("*.whl"))
    sums_file = wheels / WHEEL_SUMS
    if sums_file.is_file():
        sums = {}
        for line in sums_file.read_text().splitlines():
            sha, _, name = line.partition("  ")
            sums[name] = sha
    else:
        sums = {n: sha256_file(wheels / n) for n in names}
    if sorted(sums) != names or wheel_set_digest(sums) != digest:
        raise PrerequisiteError(f"the wheels in {wheels} are not the set their .digest names "
                                "(changed after download). Fix: remove that directory")
    if not sums_file.is_file():  # hashed once: kept for the next freeze
        sums_file.write_text("".join(f"{sums[n]}  {n}\n" for n in names))
    return [wheel_file(n, sums[n]) for n in names]


def pip_stage(requirements: str, log: Log, field: str) -> Stage:
    req_sha = _sha(requirements.encode())
    req_file = state_dir() / "agent" / f"{req_sha[:16]}.txt"
    req_file.parent.mkdir(parents=True, exist_ok=True)
    if not req_file.is_file() or req_file.read_text() != requirements:
        req_file.write_text(requirements)
    wheels = download_wheels(req_file, state_dir() / "wheels" / "agent" / req_sha[:16], log,
                             what="the agent's requirements", field=field)
    digest = (wheels / ".digest").read_text().strip()
    files = wheel_files(wheels, digest)

    def fill(ctx: Path) -> None:
        (ctx / "requirements.txt").write_text(requirements)
        for whl in wheels.glob("*.whl"):
            link_or_copy(whl, ctx / "wheels" / whl.name)

    return Stage("pip", _sha(f"{req_sha}\n{digest}\n".encode()),
                 requirements.splitlines(), fill, lambda: files)


def apt_stage(names: tuple[str, ...], image_status: bytes, log: Log, path: str) -> Stage:
    from runner.toolchain.apt import AptResolver

    resolver = AptResolver(state_dir() / "apt", image_status)
    debs = resolver.resolve(names, path=path)
    log(f"apt: {len(debs)} package(s) beyond the analyst image: "
        f"{', '.join(d.pin for d in debs) or '(none: the image has them)'}")
    lines = "".join(f"{d.filename} {d.sha256}\n" for d in debs)

    def fill(ctx: Path) -> None:
        if debs:
            resolver.download(names, debs, ctx / "debs")
        (ctx / "apt.txt").write_text("".join(f"{d.pin}\n" for d in debs))

    # apt's SHA256 from the signed index; download() refuses a .deb that differs
    files = [ResolvedFile("deb", d.package, d.version, d.filename, d.sha256) for d in debs]
    return Stage("apt", _sha(f"{' '.join(names)}\n{lines}".encode()),
                 [d.pin for d in debs], fill, lambda: files)


def npm_stage(tc: AgentToolchains, log: Log, path: str) -> Stage:
    from runner.toolchain.npm_fetch import (
        LAYOUT_VERSION,
        cached_tarball,
        lay_out,
        tarball_filename,
    )
    from runner.toolchain.npm_lock import parse_lockfile, registry_from_env

    npm = tc.npm
    if npm is None:
        raise ValueError("npm_stage needs project.npm")
    plan = parse_lockfile(npm.lockfile, npm.package_json, source=npm.source,
                          pkg_source=npm.pkg_source,
                          registry=registry_from_env(dict(os.environ)),
                          ignore_scripts=npm.ignore_scripts, path=path, field="project.npm")
    h = hashlib.sha256(f"layout {LAYOUT_VERSION}\n".encode())
    for part in (npm.lockfile, npm.package_json, "\n".join(npm.ignore_scripts).encode()):
        h.update(_sha(part).encode() + b"\n")
    for p in plan.packages:  # integrity is the tarball's own digest, checked at fetch
        h.update(f"{p.key} {p.integrity}\n".encode())

    cache = state_dir() / "npm" / "tarballs"
    sha256: dict[str, str] = {}

    def fill(ctx: Path) -> None:
        (ctx / "node_modules").rmdir()  # lay_out renames a finished tree into place
        sha256.update(lay_out(plan, ctx / "node_modules", cache, log, source=npm.source,
                              field="project.npm", path=path))

    def artifacts() -> list[ResolvedFile]:
        for p in plan.packages:  # without fill (an image built elsewhere): the cache
            if p.key not in sha256:
                sha256[p.key] = cached_tarball(p, cache, source=npm.source,
                                               field="project.npm", path=path).sha256
        return sorted({ResolvedFile("npm", p.name, p.version, tarball_filename(p),
                                    sha256[p.key]) for p in plan.packages})

    return Stage("npm", h.hexdigest(), plan.pins(), fill, artifacts)


def stages(tc: AgentToolchains, log: Log, *, image_status: Callable[[], bytes],
           field: str) -> list[Stage]:
    """The stages ``tc`` declares, in install order (apt first: npm and pip may need it)."""
    out = []
    if tc.apt:
        out.append(apt_stage(tc.apt, image_status(), log, tc.cycle_file))
    if tc.requirements is not None:
        out.append(pip_stage(tc.requirements, log, field))
    if tc.npm is not None:
        out.append(npm_stage(tc, log, tc.cycle_file))
    return out


def empty_context(ctx: Path) -> None:
    """The context every build starts from: each toolchain's slot present and empty,
    so the one Dockerfile serves any combination."""
    for d in ("wheels", "debs", "node_modules"):
        (ctx / d).mkdir()
    for f in ("requirements.txt", "apt.txt"):
        (ctx / f).write_text("")
    os.chmod(ctx / "node_modules", 0o755)  # noqa: S103 - read by the image's uid


__all__ = ["Stage", "empty_context", "stages"]
