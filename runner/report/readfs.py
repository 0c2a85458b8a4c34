"""Bounded, link-refusing reads below a run directory.

A run directory holds what containers wrote, so no path component below the root is
followed if it is a symlink (``O_NOFOLLOW`` on every component, each opened relative to
its parent's fd), only regular files are read, and every read stops at a byte cap.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

from runner.errors import OutputRejected
from runner.isolation.collect import loads_strict

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
MAX_FILE = 32 * 1024 * 1024
MAX_LINES = 200_000


def _open_parent(root: Path, parts: list[str]) -> int | None:
    """The directory holding ``root/parts...``, each component opened relative to its
    parent's descriptor with ``O_NOFOLLOW`` (so the path's total length never matters);
    None when a component is absent; OutputRejected naming any other failure."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OutputRejected(f"{root}: cannot open the run directory: {exc.strerror}"
                             ) from None
    try:
        for i, part in enumerate(parts):
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                return None
            except OSError as exc:
                where = f"{root}/{'/'.join(parts[:i + 1])}"
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OutputRejected(f"{where}: a path component is a symlink or not a "
                                         "directory; refused") from None
                raise OutputRejected(f"{where}: cannot open the directory: {exc.strerror}"
                                     ) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _split(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise OutputRejected(f"{rel!r}: not a plain relative path")
    return parts


def read_bytes(root: Path, rel: str, cap: int = MAX_FILE, *,
               head: bool = False) -> bytes | None:
    """The bytes of ``root/rel`` or None when absent; refuses links, non-files, > cap.
    With ``head``, a longer file is not refused: its first cap + 1 bytes are returned."""
    parts = _split(rel)
    dfd = _open_parent(root, parts[:-1])
    if dfd is None:
        return None
    try:
        try:
            fd = os.open(parts[-1], _FILE, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OutputRejected(f"{root}/{rel}: symlink refused (never followed)") from None
            raise OutputRejected(f"{root}/{rel}: cannot open: {exc.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OutputRejected(f"{root}/{rel}: not a regular file; refused")
            chunks, got = [], 0
            while chunk := os.read(fd, min(1 << 20, cap - got + 1)):
                got += len(chunk)
                if got > cap and head:
                    chunks.append(chunk)
                    return b"".join(chunks)[:cap + 1]
                if got > cap:
                    raise OutputRejected(f"{root}/{rel}: larger than the {cap}-byte cap")
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def is_file(root: Path, rel: str) -> bool:
    """True when ``root/rel`` is a regular file reached without following any link; False
    when it is absent. Anything else (a link or another kind of file there, a component
    that cannot be opened) is OutputRejected naming it: never taken for absent silently."""
    parts = _split(rel)
    dfd = _open_parent(root, parts[:-1])
    if dfd is None:
        return False
    try:
        try:
            mode = os.lstat(parts[-1], dir_fd=dfd).st_mode
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise OutputRejected(f"{root}/{rel}: cannot stat: {exc.strerror}") from None
        if stat.S_ISLNK(mode):
            raise OutputRejected(f"{root}/{rel}: symlink refused (never followed)")
        if not stat.S_ISREG(mode):
            raise OutputRejected(f"{root}/{rel}: not a regular file; refused")
        return True
    finally:
        os.close(dfd)


def read_json(root: Path, rel: str, cap: int = MAX_FILE) -> Any:
    """Strict JSON (no NaN, no duplicate keys, bounded depth) or None when absent."""
    data = read_bytes(root, rel, cap)
    return None if data is None else loads_strict(data, source=f"{root}/{rel}")


MAX_CONTAINERS = 4_000_000
"""Most JSON objects and arrays a JSON Lines file may hold (counted by its ``[`` and
``{`` bytes, before anything is parsed): each costs the reader ~60 bytes of memory
against its 2 bytes of text, so 1 GiB of ``[[],[],...]`` lines once took 27 GB. A
record holds about 8; a report of 200,000 records (:data:`MAX_LINES`) needs 1.6 M."""


def read_jsonl(root: Path, rel: str, cap: int = MAX_FILE,
               max_lines: int = MAX_LINES) -> list[Any] | None:
    """One strict JSON value per non-empty line, or None when absent."""
    data = read_bytes(root, rel, cap)
    if data is None:
        return None
    if data.count(b"[") + data.count(b"{") > MAX_CONTAINERS:
        raise OutputRejected(f"{root}/{rel}: more than {MAX_CONTAINERS} JSON objects and "
                             "arrays; refused unparsed (not a file cyclebox wrote)")
    lines = [ln for ln in data.split(b"\n") if ln.strip()]
    if len(lines) > max_lines:
        raise OutputRejected(f"{root}/{rel}: more than {max_lines} lines")
    return [loads_strict(ln, source=f"{root}/{rel}:{i + 1}") for i, ln in enumerate(lines)]
