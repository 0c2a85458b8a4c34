"""One walker for every tree the host reads: a run directory (what containers wrote, so
hostile) or an operator's input tree (a data directory, a project).

It works by directory descriptor, never by path: each directory is opened with
``O_DIRECTORY|O_NOFOLLOW`` relative to its parent's descriptor and listed through that
descriptor, and each file is opened relative to its directory's descriptor. A path's
total length never matters (a tree 16 directories deep can hold names far past
``PATH_MAX``), and no symlink is ever followed.

Nothing is skipped silently: a directory that cannot be opened or listed, or an entry
that cannot be stat'ed or opened, raises :class:`WalkError` naming its path relative to
the root and the reason. Each caller turns that into its own named error (bad input for
an operator's tree, a receipt or verification failure for a run directory).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
MAX_DEPTH = 256
"""Deepest nesting walked by default (one descriptor is open per level)."""


def shown(rel: str) -> str:
    """A relative name for a message: not-UTF-8 bytes and control characters escaped."""
    raw = os.fsencode(rel).decode("utf-8", "backslashreplace")
    return raw.encode("unicode_escape").decode("ascii").replace("\\\\", "\\")


class WalkError(Exception):
    """An entry of the tree could not be read; ``rel`` names it (relative to the root)."""

    def __init__(self, rel: str, reason: str) -> None:
        self.rel = rel
        self.reason = reason
        super().__init__(f"{shown(rel) or '.'}: {reason}")


@dataclass(frozen=True)
class Entry:
    """One entry (never the root itself); valid while the walk has not moved past it."""

    rel: str
    """Path relative to the root, ``/``-separated (not-UTF-8 bytes as surrogates)."""
    name: str
    parent_fd: int
    """Descriptor of the directory holding it (open only during the walk)."""
    st: os.stat_result
    """``lstat`` of the entry."""
    depth: int
    """1 for an entry directly in the root."""

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.st.st_mode)

    @property
    def is_link(self) -> bool:
        return stat.S_ISLNK(self.st.st_mode)

    def open(self) -> int:
        """A read descriptor of this regular file (no link followed, no blocking open)."""
        try:
            fd = os.open(self.name, FILE_FLAGS, dir_fd=self.parent_fd)
        except OSError as exc:
            raise WalkError(self.rel, f"cannot open: {exc.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (self.st.st_dev,
                                                                      self.st.st_ino):
            os.close(fd)
            raise WalkError(self.rel, "changed while being read; refused")
        return fd

    def sha256(self) -> str:
        h = hashlib.sha256()
        with os.fdopen(self.open(), "rb") as f:
            try:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            except OSError as exc:
                raise WalkError(self.rel, f"cannot read: {exc.strerror}") from None
        return h.hexdigest()

    def readlink(self) -> str:
        try:
            return os.readlink(self.name, dir_fd=self.parent_fd)
        except OSError as exc:
            raise WalkError(self.rel, f"cannot read the link: {exc.strerror}") from None


def open_root(root: Path | str, *, follow: bool = True) -> int:
    """A descriptor of the walk's root directory (the root itself may be reached through
    a link when ``follow``; nothing below it is)."""
    flags = DIR_FLAGS if not follow else DIR_FLAGS & ~os.O_NOFOLLOW
    try:
        return os.open(root, flags)
    except OSError as exc:
        raise WalkError("", f"cannot open the directory {root}: {exc.strerror}") from None


def open_dir(parent_fd: int, name: str, rel: str) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise WalkError(rel, f"cannot open the directory: {exc.strerror}") from None


def _list(fd: int, rel: str) -> list[tuple[str, os.stat_result]]:
    try:
        names = sorted(os.listdir(fd))
    except OSError as exc:
        raise WalkError(rel, f"cannot list the directory: {exc.strerror}") from None
    out = []
    for name in names:
        try:
            out.append((name, os.lstat(name, dir_fd=fd)))
        except FileNotFoundError:
            continue  # removed since the listing: it is not there
        except OSError as exc:
            raise WalkError(f"{rel}/{name}" if rel else name,
                            f"cannot stat: {exc.strerror}") from None
    return out


def walk(root: Path | str | int, *, descend: Callable[[Entry], bool] | None = None,
         max_depth: int = MAX_DEPTH, max_entries: int | None = None) -> Iterator[Entry]:
    """Every entry under ``root`` (a path, or a directory descriptor the caller keeps),
    depth first in name order, a directory before its contents.

    ``descend(entry)`` False leaves a directory's contents out (on purpose, e.g. data the
    caller binds another way). Deeper than ``max_depth`` or more than ``max_entries``
    entries raises :class:`WalkError`."""
    root_fd = os.dup(root) if isinstance(root, int) else open_root(root)
    stack: list[tuple[int, str, int, Iterator[tuple[str, os.stat_result]]]] = []
    count = 0
    try:
        listing = _list(root_fd, "")
    except BaseException:
        os.close(root_fd)
        raise
    stack.append((root_fd, "", 0, iter(listing)))
    try:
        while stack:
            fd, prefix, depth, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                os.close(fd)
                continue
            name, st = nxt
            count += 1
            if max_entries is not None and count > max_entries:
                raise WalkError(prefix, f"more than {max_entries} entries; refusing to walk on")
            rel = f"{prefix}/{name}" if prefix else name
            entry = Entry(rel=rel, name=name, parent_fd=fd, st=st, depth=depth + 1)
            yield entry
            if not entry.is_dir or (descend is not None and not descend(entry)):
                continue
            if depth + 1 >= max_depth:
                raise WalkError(rel, f"nested deeper than {max_depth} levels")
            sub = open_dir(fd, name, rel)
            if (os.fstat(sub).st_dev, os.fstat(sub).st_ino) != (st.st_dev, st.st_ino):
                os.close(sub)
                raise WalkError(rel, "changed while being walked; refused")
            try:
                listing = _list(sub, rel)
            except BaseException:
                os.close(sub)
                raise
            stack.append((sub, rel, depth + 1, iter(listing)))
    finally:
        for fd, _, _, _ in stack:
            os.close(fd)


PATH_MAX = 4096


def check_mountable(root: Path, target: str,
                    refuse: Callable[[Entry], str | None] | None = None) -> None:
    """Raise :class:`WalkError` on the first entry of the input tree ``root`` that cannot
    be read, or whose path would be ``PATH_MAX`` or longer once ``root`` is mounted at
    ``target`` (no program in the container could open it by name), or that ``refuse``
    gives a reason for."""
    base = len(os.fsencode(target.rstrip("/"))) + 1
    for e in walk(root, max_depth=4096):
        inside = base + len(os.fsencode(e.rel))
        if inside >= PATH_MAX:
            raise WalkError(e.rel, f"path of {inside} bytes once mounted at {target}, past "
                            f"PATH_MAX ({PATH_MAX}); no program in the container could "
                            "open it")
        why = refuse(e) if refuse is not None else None
        if why is not None:
            raise WalkError(e.rel, why)


@contextlib.contextmanager
def root_entry(root: Path) -> Iterator[Entry]:
    """The walk's root itself as an :class:`Entry` (``rel`` empty, depth 0), looked up
    by ``lstat`` in its parent's descriptor: a root that is a file is read the same way
    as any entry of a tree (no link followed, opened relative to its directory)."""
    parent, name = os.path.split(os.path.abspath(root))
    pfd = open_root(parent or "/")
    try:
        try:
            st = os.lstat(name or ".", dir_fd=pfd)
        except OSError as exc:
            raise WalkError("", f"cannot stat {root}: {exc.strerror}") from None
        yield Entry(rel="", name=name or ".", parent_fd=pfd, st=st, depth=0)
    finally:
        os.close(pfd)


def tarinfo(e: Entry, arcname: str) -> tarfile.TarInfo:
    """A tar header for ``e`` from its ``lstat`` (what ``TarFile.gettarinfo`` gives for a
    path, without any path): a regular file, a directory or a symlink (its target read
    by descriptor); anything else raises :class:`WalkError` naming it. A hard-linked file
    is a regular file here, never a tar hard link."""
    ti = tarfile.TarInfo(arcname)
    st = e.st
    ti.mode = stat.S_IMODE(st.st_mode)
    ti.uid, ti.gid = st.st_uid, st.st_gid
    ti.mtime = int(st.st_mtime)
    if e.is_file:
        ti.type, ti.size = tarfile.REGTYPE, st.st_size
    elif e.is_dir:
        ti.type = tarfile.DIRTYPE
    elif e.is_link:
        ti.type, ti.linkname = tarfile.SYMTYPE, e.readlink()
    else:
        raise WalkError(e.rel, f"not a regular file, directory or symlink "
                        f"({kind(st.st_mode)}); refused")
    return ti


def add_to_tar(tf: tarfile.TarFile, e: Entry, ti: tarfile.TarInfo) -> None:
    """Add ``e`` under ``ti`` (from :func:`tarinfo`, perhaps edited), a file's content read
    through a descriptor opened relative to its directory; a file whose size changed
    since it was listed raises :class:`WalkError` (the tar never holds a torn entry)."""
    if not ti.isreg():
        tf.addfile(ti)
        return
    with os.fdopen(e.open(), "rb") as f:
        if os.fstat(f.fileno()).st_size != ti.size:
            raise WalkError(e.rel, "changed size while being read; refused")
        try:
            tf.addfile(ti, f)
        except OSError as exc:
            raise WalkError(e.rel, f"cannot read: {exc.strerror or exc}") from None


def kind(mode: int) -> str:
    """A file type's name for a message."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "unknown type"
