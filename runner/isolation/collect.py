"""Read a role's output directory without trusting it.

Invariants: no symlink is followed (every open uses ``O_NOFOLLOW`` relative to a
directory fd that was itself opened with ``O_NOFOLLOW``); only regular files with
a single link are read (a hard link could alias a host file); FIFOs, sockets and
devices are refused without being opened for reading in a blocking way; per-file,
total-size and file-count caps hold while reading, not after. JSON parsing rejects
NaN, Infinity and duplicate keys.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner import fswalk
from runner.errors import OutputRejected
from sandbox.proposal import MAX_JSON_DEPTH, strict_json

_DIR_FLAGS = fswalk.DIR_FLAGS


@dataclass(frozen=True)
class Limits:
    """Caps for one output directory."""

    max_file_bytes: int = 16 * 1024 * 1024
    max_total_bytes: int = 64 * 1024 * 1024
    max_files: int = 10_000
    max_depth: int = 16


@dataclass
class Collected:
    """Files read from an output directory, keyed by relative POSIX path."""

    files: dict[str, bytes] = field(default_factory=dict)
    total_bytes: int = 0

    def sha256(self) -> dict[str, str]:
        return {p: hashlib.sha256(b).hexdigest() for p, b in sorted(self.files.items())}

    def json(self, rel: str) -> Any:
        if rel not in self.files:
            raise OutputRejected(f"expected output file {rel} is missing")
        return loads_strict(self.files[rel], source=rel)


def collect(root: Path, limits: Limits | None = None) -> Collected:
    """Read every file under ``root`` under the rules above; raise on the first breach.

    One walk by directory descriptor (:func:`runner.fswalk.walk`): iterative (depth is
    capped by ``max_depth``, never by Python's stack), each directory opened with
    ``O_NOFOLLOW`` relative to its parent's descriptor (so a path past ``PATH_MAX`` is read
    like any other), and a directory that cannot be opened or listed is refused by name,
    never left out. Names are checked as bytes: one that is not UTF-8 or holds a control
    character is refused by name (escaped), never decoded into the host's strings.
    """
    lim = limits or Limits()
    out = Collected()
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        raise OutputRejected(f"output directory {root} cannot be opened safely: "
                             f"{exc.strerror} (a symlink here is refused)") from None
    dirs = 1

    def descend(e: fswalk.Entry) -> bool:
        nonlocal dirs
        if e.depth > lim.max_depth:
            raise OutputRejected(f"{root}/{e.rel}/: nested deeper than {lim.max_depth} levels")
        dirs += 1
        if dirs > lim.max_files:
            raise OutputRejected(f"{root}: more than {lim.max_files} directories")
        return True

    try:
        for e in fswalk.walk(root_fd, descend=descend, max_depth=lim.max_depth + 2):
            parent = e.rel[:len(e.rel) - len(e.name)]
            name = _name(os.fsencode(e.name), parent, root)
            rel = f"{parent}{name}"
            mode = e.st.st_mode
            if stat.S_ISLNK(mode):
                raise OutputRejected(f"{root}/{rel}: symlink refused (never followed)")
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise OutputRejected(f"{root}/{rel}: not a regular file "
                                     f"({_kind(mode)}) refused")
            if e.st.st_nlink != 1:
                raise OutputRejected(f"{root}/{rel}: hard link ({e.st.st_nlink} links) "
                                     "refused; it may alias a file outside the output "
                                     "directory")
            if len(out.files) + 1 > lim.max_files:
                raise OutputRejected(f"{root}: more than {lim.max_files} files")
            out.files[rel] = _read_capped(e, rel, lim, out, root)
    except fswalk.WalkError as exc:
        raise OutputRejected(f"{root}/{exc}: cannot be read safely; refused") from None
    finally:
        os.close(root_fd)
    return out


def _name(raw: bytes, prefix: str, root: Path) -> str:
    """A directory entry's name as text, or OutputRejected naming it (escaped)."""
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        shown = raw.decode("utf-8", "backslashreplace")
        raise OutputRejected(f"{root}/{prefix}{shown}: file name is not UTF-8; "
                             "refused") from None
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        shown = name.encode("unicode_escape").decode("ascii")
        raise OutputRejected(f"{root}/{prefix}{shown}: file name holds a control "
                             "character; refused")
    return name


def _read_capped(e: fswalk.Entry, rel: str, lim: Limits, out: Collected, root: Path) -> bytes:
    try:
        fd = e.open()  # O_NOFOLLOW|O_NONBLOCK, the same inode as listed, a regular file
    except fswalk.WalkError:
        raise OutputRejected(f"{root}/{rel}: changed type while reading; refused") from None
    try:
        st = os.fstat(fd)
        # Re-check on the open descriptor: the entry could have been swapped.
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise OutputRejected(f"{root}/{rel}: changed type while reading; refused")
        budget = min(lim.max_file_bytes, lim.max_total_bytes - out.total_bytes)
        chunks: list[bytes] = []
        got = 0
        while True:
            chunk = os.read(fd, min(1 << 20, budget - got + 1))
            if not chunk:
                break
            got += len(chunk)
            if got > budget:
                which = ("file" if budget == lim.max_file_bytes else "total")
                cap = lim.max_file_bytes if which == "file" else lim.max_total_bytes
                raise OutputRejected(f"{root}/{rel}: {which} size cap of {cap} bytes exceeded")
            chunks.append(chunk)
        out.total_bytes += got
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "unknown type"


def loads_strict(data: bytes | str, *, source: str = "<json>",
                 max_containers: int | None = None, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON refusing NaN/Infinity and duplicate keys (and more than
    ``max_containers`` objects and arrays, or nesting past ``max_depth``); raise
    OutputRejected naming source."""
    try:
        if isinstance(data, bytes):  # a strict decode: no lone surrogate gets through
            return strict_json(data.decode("utf-8"), from_utf8=True,
                               max_containers=max_containers, max_depth=max_depth)
        return strict_json(data, max_containers=max_containers, max_depth=max_depth)
    except (ValueError, UnicodeDecodeError) as exc:
        raise OutputRejected(f"{source}: invalid JSON: {exc}") from None


def dir_usage(root: Path, max_entries: int = 100_000) -> tuple[int, int]:
    """(bytes, entries) under root by lstat, never following links; stops counting at max.

    Walked by directory descriptor (:func:`runner.fswalk.walk`): a path past ``PATH_MAX``
    counts like any other, and a directory that cannot be read raises OutputRejected
    naming it (never left out of the count silently)."""
    total = 0
    entries = 0
    try:
        for e in fswalk.walk(root, max_depth=1 << 16):
            if entries >= max_entries:
                break
            entries += 1
            if not e.is_dir:
                total += e.st.st_blocks * 512 if e.st.st_blocks else e.st.st_size
    except fswalk.WalkError as exc:
        raise OutputRejected(f"{root}/{exc}: cannot measure the directory in full") from None
    return total, entries
