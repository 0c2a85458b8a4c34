"""Fetch an :class:`~runner.toolchain.npm_lock.NpmPlan`'s tarballs on the host and lay out
``node_modules`` exactly as the lockfile's keys say. Nothing from a package runs here.

* Each tarball is fetched over HTTPS (plain http only from a loopback mirror: the address
  was checked by :func:`~runner.toolchain.npm_lock.registry_problem`), at most
  :data:`MAX_TARBALL_BYTES` and :data:`FETCH_TIMEOUT_S`, redirects refused, into a cache
  keyed by its sha512 (``<state>/npm/tarballs/``). Its sha512 is checked against the
  lockfile's ``integrity`` BEFORE a byte is extracted; a cached file is checked again
  on every use.
* Extraction is :func:`runner.untar.extract` (by directory descriptor; links, devices,
  absolute or ``..`` names refused by name), after the first path part (``package/``,
  whatever npm's packer named it) is stripped, into a fresh directory per key.
* ``.bin`` links are relative symlinks ``<parent node_modules>/.bin/<name> ->
  ../<pkg>/<path>``; their targets are made executable, as npm's bin-links does.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import posixpath
import shutil
import stat
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, NamedTuple

from runner.errors import PrerequisiteError
from runner.toolchain.npm_lock import NpmPackage, NpmPlan, NpmRefused
from runner.untar import Limits, UntarError, _CheckedInfo, extract, forget_read, mtime_of

MAX_TARBALL_BYTES = 256 * 1024 * 1024
"""Largest tarball fetched (the biggest CLI bundles are ~100 MB)."""
MAX_UNPACKED_BYTES = 1024 * 1024 * 1024
MAX_LAYOUT_BYTES = 4 * 1024 * 1024 * 1024
MAX_FETCHED_BYTES = 4 * 1024 * 1024 * 1024
"""The tarballs of one layout together (what is downloaded and cached): bytes a
gzip stream holds past its tar's end are fetched but never unpacked, so the unpacked
bound alone does not cap them."""
"""All packages of a layout together, unpacked (one small tarball installed under many
keys, or many gzip bombs of 1 GiB each, filled the host's disk)."""
FETCH_TIMEOUT_S = 120.0
LAYOUT_VERSION = "3"
"""Changes when :func:`lay_out` lays a tree out differently (part of the image's hash).
3: every directory 0755 and file 0644/0755 whatever the host's umask."""
LIMITS = Limits(max_entries=50_000, max_bytes=MAX_UNPACKED_BYTES, max_depth=64)

Log = Callable[[str], None]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # a redirect is an error (HTTPError 30x), never followed off-registry


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(_NoRedirect())


def _fetch(pkg: NpmPackage, dest: Path, *, source: str, field: str, path: str) -> str:
    """Download ``pkg``'s tarball to ``dest`` (bounded), checking its sha512 first; its
    sha256 (for the run's provenance) is hashed from the same bytes."""
    tmp = dest.with_name(dest.name + f".{os.getpid()}.part")
    h, h256 = hashlib.sha512(), hashlib.sha256()
    got = 0
    try:
        headers = {"Accept": "application/octet-stream", "User-Agent": "cyclebox"}
        req = urllib.request.Request(pkg.url, headers=headers)  # noqa: S310
        # the scheme was checked (https, or http to a loopback mirror): registry_problem
        resp_cm = _opener().open(req, timeout=FETCH_TIMEOUT_S)
        with resp_cm as resp, tmp.open("wb") as out:
            while chunk := resp.read(1 << 20):
                got += len(chunk)
                if got > MAX_TARBALL_BYTES:
                    raise NpmRefused(f"{source}: {pkg.key}: the tarball is larger than "
                                     f"{MAX_TARBALL_BYTES} bytes", path=path, field=field,
                                     fix="depend on a smaller package")
                h.update(chunk)
                h256.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        tmp.unlink(missing_ok=True)
        raise PrerequisiteError(f"{pkg.name}@{pkg.version}: cannot fetch {pkg.url} ({exc}). "
                                "Fix: make the npm registry reachable from the host (or set "
                                "npm_config_registry to a mirror)") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if h.hexdigest() != pkg.sha512_hex:
        tmp.unlink(missing_ok=True)
        raise NpmRefused(f"{source}: {pkg.key}: the tarball from {pkg.url} does not match the "
                         f"lockfile's integrity (sha512 {h.hexdigest()[:16]}..., expected "
                         f"{pkg.sha512_hex[:16]}...); nothing was extracted", path=path,
                         field=field, fix="regenerate the lockfile from the registry you "
                         "fetch from; a tarball that changed under a published version is "
                         "a tampered mirror")
    os.replace(tmp, dest)
    return h256.hexdigest()


class Tarball(NamedTuple):
    path: Path
    sha256: str
    """Of the bytes whose sha512 was just checked against the lockfile's integrity."""


def cached_tarball(pkg: NpmPackage, cache: Path, *, source: str, field: str,
                   path: str) -> Tarball:
    """The verified tarball of ``pkg`` in ``cache``, fetched when absent or corrupt."""
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / f"{pkg.sha512_hex}.tgz"
    if dest.is_file() and not dest.is_symlink():
        h, h256 = hashlib.sha512(), hashlib.sha256()
        with dest.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                h256.update(chunk)
        if h.hexdigest() == pkg.sha512_hex:
            return Tarball(dest, h256.hexdigest())
    dest.unlink(missing_ok=True)
    return Tarball(dest, _fetch(pkg, dest, source=source, field=field, path=path))


def tarball_filename(pkg: NpmPackage) -> str:
    """The tarball's file name as the registry serves it (``tsx-4.19.2.tgz``)."""
    name = posixpath.basename(urllib.parse.urlsplit(pkg.url).path)
    return urllib.parse.unquote(name) or f"{pkg.name.rsplit('/', 1)[-1]}-{pkg.version}.tgz"


def _strip_first(tgz: Path, limits: Limits = LIMITS) -> IO[bytes]:
    """The tar stream with every name's first part removed (npm's ``strip: 1``); an entry
    that is only the top directory is dropped. Names are checked again by untar. Bounded
    as untar bounds (entries, bytes, metadata records: a gzip bomb stops at the bound),
    spilled to disk past 16 MB."""
    # spilled beside the tarball (the cache), never to a system /tmp that may be RAM
    out = tempfile.SpooledTemporaryFile(max_size=16 << 20, dir=str(tgz.parent))  # noqa: SIM115
    entries = size = 0
    # untar's header class: PAX / GNU long-name records are bounded before they are read
    with gzip.open(tgz, "rb") as raw, tarfile.open(fileobj=raw, mode="r|",
                                                   tarinfo=_CheckedInfo) as src, \
            tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as dst:
        for m in src:
            entries, size = entries + 1, size + max(m.size, 0)
            if entries > limits.max_entries or size > limits.max_bytes:
                raise UntarError("", f"more than {limits.max_entries} entries or "
                                 f"{limits.max_bytes} bytes unpacked; refused", limit=True)
            name = m.name
            rest = name.split("/", 1)[1] if "/" in name.lstrip("/") else ""
            if name.startswith("/"):
                rest = name  # absolute: kept as is, so untar refuses it by name
            if not rest.strip("/"):
                if m.isdir():
                    continue  # the package's own top directory
                raise UntarError(name, "an entry outside the package's top directory "
                                 "refused")
            # a fresh header: only what untar uses, none of the source's PAX records
            # (an mtime of inf or nan in one raised when written again)
            n = tarfile.TarInfo(rest)
            n.type, n.size, n.mode, n.linkname = m.type, m.size, m.mode, m.linkname
            n.mtime = mtime_of(m)
            dst.addfile(n, src.extractfile(m) if m.isfile() else None)
            forget_read(src)
    out.seek(0)
    return out


def _extract(pkg: NpmPackage, tgz: Path, into: Path, *, source: str, field: str,
             path: str, left: int = MAX_LAYOUT_BYTES) -> int:
    """Unpack one package into ``into`` (at most ``left`` bytes, what the layout has
    left); the bytes written."""
    limits = Limits(max_entries=LIMITS.max_entries, max_bytes=min(LIMITS.max_bytes, left),
                    max_depth=LIMITS.max_depth)
    try:  # a parent's tarball may already hold this key's place (or a file there)
        into.mkdir(parents=True)
        fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise NpmRefused(f"{source}: {pkg.key}: its place is taken by a file of an enclosing "
                         f"package's tarball ({exc.strerror})", path=path, field=field,
                         fix="regenerate the lockfile; a tarball that ships the "
                         "node_modules its lockfile installs is not installed") from None
    try:
        got = extract(_strip_first(tgz, limits), fd, limits)
    except UntarError as exc:
        if exc.limit and limits.max_bytes < LIMITS.max_bytes:
            raise NpmRefused(f"{source}: the packages unpack to more than {MAX_LAYOUT_BYTES} "
                             f"bytes together (at {pkg.key})", path=path, field=field,
                             fix="depend on fewer or smaller packages") from None
        raise NpmRefused(f"{source}: {pkg.key}: {pkg.name}@{pkg.version}'s tarball was "
                         f"refused: {exc}", path=path, field=field,
                         fix="depend on another release of the package") from None
    except (tarfile.TarError, OSError, EOFError, RecursionError, ValueError,
            zlib.error) as exc:  # a deflate error past the headers comes through as is
        raise NpmRefused(f"{source}: {pkg.key}: {pkg.name}@{pkg.version}'s tarball is not a "
                         f"readable .tgz ({exc})", path=path, field=field,
                         fix="depend on another release of the package") from None
    finally:
        os.close(fd)
    return got.bytes


def _npm_modes(root: Path) -> None:
    """npm's modes on ``root`` and everything under it, whatever the host's umask (the
    image's uid is not the host's): directories 0755, files 0644, executables 0755;
    symlinks are left alone (their own mode means nothing)."""
    def fix(p: str) -> None:
        st = os.lstat(p)
        if stat.S_ISDIR(st.st_mode):
            os.chmod(p, 0o755)  # noqa: S103 - read by the image's uid
        elif stat.S_ISREG(st.st_mode):
            os.chmod(p, 0o755 if st.st_mode & 0o111 else 0o644)

    fix(str(root))
    for d, dirs, files in os.walk(root):
        for n in (*dirs, *files):
            fix(os.path.join(d, n))


def _link_bins(pkg: NpmPackage, root: Path) -> None:
    parent = (root / pkg.key).parent  # .../node_modules or .../node_modules/@scope
    if pkg.name.startswith("@"):
        parent = parent.parent
    rel_pkg = os.path.relpath(root / pkg.key, parent)
    bindir = parent / ".bin"
    for name, target in pkg.bin:
        file = root / pkg.key / target
        if not file.is_file() or file.is_symlink():
            continue  # npm skips a bin whose file is missing, too
        bindir.mkdir(exist_ok=True)
        link = bindir / name
        if link.is_symlink() or link.exists():
            continue  # the first (sorted) package to claim a bin name keeps it
        link.symlink_to(f"../{rel_pkg}/{target}")
        os.chmod(file, 0o755)  # noqa: S103 - a bin is run by the image's uid


def lay_out(plan: NpmPlan, dest: Path, cache: Path, log: Log, *, source: str, field: str,
            path: str) -> dict[str, str]:
    """Fetch, verify and extract every package of ``plan`` into ``dest`` (the tree a
    lockfile key's ``node_modules/`` names; ``dest`` must not exist; on any refusal
    nothing is left at ``dest`` or beside it). Returns each key's tarball sha256."""
    for key, why in plan.skipped:
        log(f"npm: skipped optional {key} ({why})")
    for p in plan.packages:
        if p.scripts_ignored:
            log(f"npm: {p.name}@{p.version} installed WITHOUT its install script "
                "(project.npm_ignore_scripts)")
    tmp = Path(tempfile.mkdtemp(prefix=".npm-", dir=dest.parent))
    sha256: dict[str, str] = {}
    used = fetched = 0
    try:
        for p in plan.packages:
            tgz = cached_tarball(p, cache, source=source, field=field, path=path)
            fetched += tgz.path.stat().st_size
            if fetched > MAX_FETCHED_BYTES:
                raise NpmRefused(f"{source}: the packages' tarballs come to more than "
                                 f"{MAX_FETCHED_BYTES} bytes (at {p.key})", path=path,
                                 field=field, fix="depend on fewer or smaller packages")
            sha256[p.key] = tgz.sha256
            used += _extract(p, tgz.path, tmp / p.key, source=source, field=field,
                             path=path, left=MAX_LAYOUT_BYTES - used)
        for p in plan.packages:
            _link_bins(p, tmp)
        (tmp / "node_modules").mkdir(exist_ok=True)
        _npm_modes(tmp / "node_modules")
        os.replace(tmp / "node_modules", dest)  # tmp is the install root: keys start there
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"npm: {len(plan.packages)} package(s) laid out ({len(plan.skipped)} skipped)")
    return sha256


__all__ = ["LAYOUT_VERSION", "MAX_FETCHED_BYTES", "MAX_TARBALL_BYTES", "Tarball",
           "cached_tarball", "lay_out", "tarball_filename"]
