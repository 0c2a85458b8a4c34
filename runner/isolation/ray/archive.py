"""Tars that travel between the head and a node.

Inputs (a mount's directory or file) are packed deterministically and named by their
sha256, so a node caches each distinct input once. Outputs come back as a tar of the
node's output directory and are read on the head only by
:func:`runner.isolation.copyout.extract` (the same safe reader as a local run).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
from pathlib import Path

from runner import fswalk, untar
from runner.errors import ConfigError, SandboxError

MAX_DEPTH = 4097
"""Deepest entry of a tar a node unpacks: the packers walk 4,096 levels, under ``x``."""
ENTRY = "x"
"""The single top-level name an input tar holds (the mount's file or directory)."""


def _normalize(ti: tarfile.TarInfo) -> tarfile.TarInfo:
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.mtime = 0
    return ti


def pack_input(source: Path) -> bytes:
    """A reproducible tar of ``source`` (file or tree) under :data:`ENTRY`; symlinks are
    kept as links, never followed; anything but files, directories and links is refused.

    Walked and read by directory descriptor (:mod:`runner.fswalk`): a path past
    ``PATH_MAX`` is packed like any other, and an entry that cannot be read is a
    ConfigError naming it (bad input, exit 3), never left out."""
    buf = io.BytesIO()
    try:
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            with fswalk.root_entry(source) as top:
                _add(tf, _shippable(source, top), ENTRY)
                tree = top.is_dir
            for e in fswalk.walk(source, max_depth=4096) if tree else ():
                problem = untar.name_problem(e.rel)  # the node would refuse it
                if problem is not None:
                    raise fswalk.WalkError(e.rel, problem)
                _add(tf, _shippable(source, e), f"{ENTRY}/{e.rel}")
    except fswalk.WalkError as exc:
        raise ConfigError(f"{source}/{exc}: the input cannot be shipped to a node in full",
                          fix="make every entry of the input readable, with shorter paths "
                          "(or remove it)") from None
    return buf.getvalue()


def _shippable(source: Path, e: fswalk.Entry) -> fswalk.Entry:
    if not (e.is_file or e.is_dir or e.is_link):
        where = f"{source}/{fswalk.shown(e.rel)}" if e.rel else str(source)
        raise SandboxError(f"{where}: only files, directories and symlinks can be shipped "
                           "to a node as a mount")
    return e


def _add(tf: tarfile.TarFile, e: fswalk.Entry, arcname: str) -> int:
    """``e`` under ``arcname`` (normalized: no owner, no time), its content if a file;
    returns the content size."""
    ti = _normalize(fswalk.tarinfo(e, arcname))
    fswalk.add_to_tar(tf, e, ti)
    return ti.size


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unpack_input(data: bytes, expected: str, cache: Path) -> Path:
    """The cached copy of an input (``cache/<sha256>/x``), unpacked from ``data`` when
    absent; ``data`` must hash to ``expected``. Unpacked beside and renamed into place,
    so a half-written entry is never used."""
    final = cache / expected
    if (final / ENTRY).exists():
        return final / ENTRY
    if digest(data) != expected:
        raise SandboxError(f"input archive does not match its digest {expected[:12]}")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{expected}.{os.getpid()}.{os.urandom(4).hex()}"
    tmp.mkdir(mode=0o755)
    try:
        _unpack(data, tmp, _limits(data, symlinks=True), "input archive " + expected[:12])
        os.chmod(tmp, 0o755)  # noqa: S103 - the role uid traverses to its input
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / ENTRY).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / ENTRY


def _limits(data: bytes, *, symlinks: bool, max_bytes: int | None = None) -> untar.Limits:
    """Bounds for a tar held whole in memory: no more entries than its 512-byte headers,
    no more file bytes than it holds (or ``max_bytes``), the depth the packers walk."""
    return untar.Limits(max_entries=len(data) // 512, max_depth=MAX_DEPTH,
                        max_bytes=len(data) if max_bytes is None else max_bytes,
                        symlinks=symlinks)


def _unpack(data: bytes, dest: Path, limits: untar.Limits, what: str) -> None:
    """``data`` into the directory ``dest``, by directory descriptor (:mod:`runner.untar`):
    a path past ``PATH_MAX`` on this node is written like any other; an entry refused
    (absolute, ``..``, through a link, a hard link or device, a duplicate) is a
    SandboxError naming it."""
    fd = os.open(dest, fswalk.DIR_FLAGS)
    try:
        untar.extract(io.BytesIO(data), fd, limits)
    except untar.UntarError as exc:
        raise SandboxError(f"{what} refused on this node: {exc}") from None
    finally:
        os.close(fd)


def cached(cache: Path, expected: str) -> Path | None:
    """The cached input named ``expected``, or None."""
    p = cache / expected / ENTRY
    return p if p.exists() or p.is_symlink() else None


def pack_output(root: Path, cap: int) -> bytes:
    """A tar of a node-side output directory (already capped by the node's own copy-out)
    for the head's safe reader; links are packed as links, never followed. Walked and read
    by descriptor: a path past ``PATH_MAX`` is packed like any other; an entry that is not
    a file, directory or link, or cannot be read, is a SandboxError naming it (never
    left out)."""
    buf = io.BytesIO()
    total = 0
    try:
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for e in fswalk.walk(root, max_depth=4096):
                total += e.st.st_size if e.is_file else 0
                if total > cap:
                    raise SandboxError(f"node output exceeds its cap of {cap} bytes")
                _add(tf, e, e.rel)
    except fswalk.WalkError as exc:
        raise SandboxError(f"{root}/{exc}: the output directory cannot be packed in full"
                           ) from None
    return buf.getvalue()


def unpack_seed(data: bytes, dest: Path, max_bytes: int | None = None) -> None:
    """The head's seed content (host-made, e.g. the apply stage's checkout, its own
    symlinks kept as links) into the node's fresh output directory, by directory
    descriptor; at most ``max_bytes`` of file content (the output cap)."""
    _unpack(data, dest, _limits(data, symlinks=True, max_bytes=max_bytes), "output seed")
