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

from runner.errors import SandboxError

ENTRY = "x"
"""The single top-level name an input tar holds (the mount's file or directory)."""


def _normalize(ti: tarfile.TarInfo) -> tarfile.TarInfo:
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.mtime = 0
    return ti


def pack_input(source: Path) -> bytes:
    """A reproducible tar of ``source`` (file or tree) under :data:`ENTRY`; symlinks are
    kept as links, never followed; anything but files, directories and links is refused."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        paths = [source]
        if source.is_dir() and not source.is_symlink():
            paths += sorted(source.rglob("*"))
        for p in paths:
            arc = ENTRY if p == source else f"{ENTRY}/{p.relative_to(source).as_posix()}"
            ti = tf.gettarinfo(str(p), arcname=arc)
            if not (ti.isreg() or ti.isdir() or ti.issym()):
                raise SandboxError(f"{p}: only files, directories and symlinks can be "
                                   "shipped to a node as a mount")
            _add(tf, p, ti)
    return buf.getvalue()


def _add(tf: tarfile.TarFile, p: Path, ti: tarfile.TarInfo) -> None:
    """``p`` under ``ti`` (normalized: no owner, no time), its content if a file."""
    _normalize(ti)
    if ti.isreg():
        with p.open("rb") as f:
            tf.addfile(ti, f)
    else:
        tf.addfile(ti)


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
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tf:
            tf.extractall(tmp, filter="tar")
        os.chmod(tmp, 0o755)  # noqa: S103 - the role uid traverses to its input
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / ENTRY).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / ENTRY


def cached(cache: Path, expected: str) -> Path | None:
    """The cached input named ``expected``, or None."""
    p = cache / expected / ENTRY
    return p if p.exists() or p.is_symlink() else None


def pack_output(root: Path, cap: int) -> bytes:
    """A tar of a node-side output directory (already capped by the node's own copy-out)
    for the head's safe reader; links are packed as links, never followed."""
    buf = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for p in sorted(root.rglob("*")):
            ti = tf.gettarinfo(str(p), arcname=p.relative_to(root).as_posix())
            if not (ti.isreg() or ti.isdir() or ti.issym()):
                continue
            total += ti.size
            if total > cap:
                raise SandboxError(f"node output exceeds its cap of {cap} bytes")
            _add(tf, p, ti)
    return buf.getvalue()


def unpack_seed(data: bytes, dest: Path) -> None:
    """The head's seed content (host-made, e.g. the apply stage's checkout) into the
    node's fresh output directory."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tf:
        tf.extractall(dest, filter="tar")
