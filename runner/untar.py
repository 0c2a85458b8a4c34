"""One tar extractor for every tar the host (or a Ray node) unpacks into a directory:
``git archive`` of a tree (the base tree, the apply stage's throwaway repository, the
candidate's export) and the Ray node's input cache and output seed.

It never uses :meth:`tarfile.TarFile.extractall` (which writes by absolute path, so a
tree whose paths fit under ``/src`` fails under a longer host directory with
``ENAMETOOLONG``, and which follows a symlink an earlier entry made). Headers are parsed
by :mod:`tarfile` (PAX and GNU long-name records capped at :data:`MAX_META_BYTES` before
they are read); everything is written relative to directory descriptors:

* each directory is created with ``mkdir`` relative to its parent's descriptor and
  opened with ``O_DIRECTORY|O_NOFOLLOW``; each file is created with
  ``O_CREAT|O_EXCL|O_NOFOLLOW`` in its directory's descriptor: a path's total length
  never matters, and nothing is ever written through a symlink;
* only regular files, directories and (when the caller allows them) symlinks are
  written; a hard link, device, fifo, sparse file or unknown type is refused by name;
* names are relative, without empty, ``.`` or ``..`` parts, NUL or control characters
  (C0, DEL, C1), and each part at most 255 bytes; a name seen twice is refused (never
  overwritten);
* entries, file bytes and depth are counted against the caller's bounds *before*
  anything is written; a file left half-written by a refusal is removed;
* modes are the archive's without setuid/setgid/sticky or group/other write (what
  ``filter="tar"`` kept), applied by descriptor (``fchmod``), never through a link; a
  directory without owner ``rwx`` gets its mode once everything in it is written.
  Ownership is never set (the extracting user owns everything, as before).

Any refusal is an :class:`UntarError` naming the entry; each caller turns it into its
own named error. Nothing is skipped.
"""

from __future__ import annotations

import errno
import os
import tarfile
from dataclasses import dataclass, field
from typing import IO, Any, cast

from runner.fswalk import shown

MAX_META_BYTES = 4 * 1024 * 1024
MAX_META_TOTAL = 64 * 1024 * 1024
"""Metadata records read over a whole archive (each is parsed whole: a few KB of gzip
expand to gigabytes of repeated PAX records)."""
MAX_META_CHAIN = 8
"""Metadata records in a row before an entry (tarfile reads a chain recursively)."""
"""Largest PAX or GNU long-name record read (a 4,096-deep path of 255-byte parts fits)."""
MAX_PART = 255
"""Longest name of one path part (``NAME_MAX``)."""
MODE_MASK = 0o755
"""Mode bits kept from the archive: no setuid/setgid/sticky, no group/other write."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_CACHED_LEVELS = 128
"""Directory descriptors kept open along the current path (deeper ones are reopened)."""
_META_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
               tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_TARFILE: Any = tarfile
"""tarfile's names the type stubs leave out (its header errors)."""
_REFUSED_EARLY = {tarfile.XGLTYPE: "global header", tarfile.GNUTYPE_SPARSE: "sparse file"}
_REFUSED = {tarfile.LNKTYPE: "hard link", tarfile.CHRTYPE: "character device",
            tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "fifo",
            tarfile.GNUTYPE_SPARSE: "sparse file", tarfile.CONTTYPE: "contiguous file"}


class UntarError(Exception):
    """An entry was refused, or could not be written; ``rel`` names it ('' for the
    archive as a whole); ``limit`` says whether a count/byte/depth bound was hit."""

    def __init__(self, rel: str, reason: str, *, limit: bool = False) -> None:
        self.rel = rel
        self.reason = reason
        self.limit = limit
        super().__init__(f"{shown(rel)}: {reason}" if rel else reason)


@dataclass(frozen=True)
class Limits:
    """Bounds of one extraction (each caller passes its own, as it bounded before)."""

    max_entries: int
    """Files, directories and links (parents created for an entry count too)."""
    max_bytes: int
    """Total bytes of file content."""
    max_depth: int
    """Path parts of the deepest entry."""
    symlinks: bool = False
    """Whether symlink entries are written (as links, never followed)."""


@dataclass
class Untarred:
    """What was written."""

    files: int = 0
    dirs: int = 0
    links: int = 0
    bytes: int = 0
    _implicit: set[str] = field(default_factory=set)
    """Parents made for an entry that came before its directory's own entry."""
    _modes: list[tuple[list[str], int]] = field(default_factory=list)
    """Directory modes applied at the end (those without owner rwx)."""

    @property
    def entries(self) -> int:
        return self.files + self.dirs + self.links


class _CheckedInfo(tarfile.TarInfo):
    """A header whose PAX or GNU long-name record is bounded before tarfile reads it
    whole into memory."""

    def _proc_member(self, tf: tarfile.TarFile) -> tarfile.TarInfo:
        seen = tf.__dict__.setdefault("_cbx_meta", [0, 0])  # [bytes, in a row]
        if self.size < 0:  # read as nothing, so it would cost nothing against the bounds
            raise UntarError("", f"a tar header with a negative size ({self.size}); refused")
        if self.type in _REFUSED_EARLY:
            # refused before tarfile reads what follows: a global header is kept and
            # applied to every later member (seconds each with millions of keys), an
            # old GNU sparse header reads its extension blocks without bound
            raise UntarError("", f"a tar {_REFUSED_EARLY[self.type]} refused")
        if self.type in _META_TYPES:
            if self.size > MAX_META_BYTES:
                raise UntarError("", f"a tar metadata record of {self.size} bytes (at most "
                                 f"{MAX_META_BYTES}); refused", limit=True)
            seen[0] += self.size
            seen[1] += 1
            if seen[0] > MAX_META_TOTAL or seen[1] > MAX_META_CHAIN:
                raise UntarError("", f"more than {MAX_META_TOTAL} bytes of tar metadata "
                                 f"records, or {MAX_META_CHAIN} in a row; refused",
                                 limit=True)
        else:
            seen[1] = 0
        return cast(tarfile.TarInfo, cast(Any, super())._proc_member(tf))

    def _proc_pax(self, tf: tarfile.TarFile) -> tarfile.TarInfo:
        """tarfile's own, with its records parsed in one linear pass: Python 3.11.7's
        regular expressions take time (``hdrcharset``) or memory (a keyword running on
        to a distant ``=``) that grows with the square of the record (CVE-2024-6232: a
        4 KB .tgz ran for hours). Global headers and sparse keys are refused."""
        t, me = cast(Any, tf), cast(Any, self)
        buf: bytes = t.fileobj.read(me._block(self.size))
        records: list[tuple[bytes, bytes]] = []
        pos, end = 0, min(self.size, len(buf))
        while pos < end:
            sp = buf.find(b" ", pos, min(end, pos + 24))
            digits = buf[pos:sp] if sp > pos else b""
            if not digits.isdigit() or int(digits) == 0 or pos + int(digits) > end:
                raise _TARFILE.InvalidHeaderError("invalid PAX record length")
            rec = buf[sp + 1:pos + int(digits)]
            eq = rec.find(b"=")
            if eq <= 0 or not rec.endswith(b"\n"):
                raise _TARFILE.InvalidHeaderError("invalid PAX record")
            records.append((rec[:eq], rec[eq + 1:-1]))
            pos += int(digits)
        headers: dict[str, str] = dict(t.pax_headers)
        binary = any(k == b"hdrcharset" and v == b"BINARY" for k, v in records)
        for key, value in records:
            name = me._decode_pax_field(key, "utf-8", "utf-8", t.errors)
            if name.startswith("GNU.sparse."):
                raise UntarError("", "a PAX sparse file (GNU.sparse) refused")
            enc = t.encoding if binary and name in tarfile.PAX_NAME_FIELDS else "utf-8"
            headers[name] = me._decode_pax_field(value, enc, t.encoding if binary
                                                   else "utf-8", t.errors)
        try:
            nxt = cast(Any, self.fromtarfile(tf))
        except tarfile.HeaderError as exc:
            raise _TARFILE.SubsequentHeaderError(str(exc)) from None
        nxt._apply_pax_info(headers, t.encoding, t.errors)
        nxt.offset = self.offset
        if nxt.size < 0:
            raise UntarError("", f"a PAX size of {nxt.size}; refused")
        if "size" in headers:  # as tarfile: the next header follows the new size
            offset = nxt.offset_data
            if nxt.isreg() or nxt.type not in tarfile.SUPPORTED_TYPES:
                offset += nxt._block(nxt.size)
            t.offset = offset
        return cast(tarfile.TarInfo, nxt)

    # PAX GNU.sparse.* keys: tarfile reads a sparse map (of any size) and int()s it
    def _proc_gnusparse_00(self, *_args: object) -> None:
        raise UntarError("", "a PAX sparse file (GNU.sparse) refused")

    _proc_gnusparse_01 = _proc_gnusparse_00
    _proc_gnusparse_10 = _proc_gnusparse_00


def name_problem(name: str) -> str | None:
    """Why :func:`extract` would refuse the entry name ``name`` (``/``-separated, not
    UTF-8 bytes as surrogates), or None."""
    if not name:
        return "empty name refused"
    bad = next((c for c in name if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None)
    if bad is not None:
        return f"control character U+{ord(bad):04X} in the name refused"
    if name.startswith("/"):
        return "absolute name refused"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "empty, '.' or '..' path part refused"
    if any(len(os.fsencode(p)) > MAX_PART for p in parts):
        return f"a path part is longer than {MAX_PART} bytes; refused"
    return None


def extract(fileobj: IO[bytes], dest: int, limits: Limits) -> Untarred:
    """Extract the tar read from ``fileobj`` (once, front to back: a pipe will do) into
    the directory whose descriptor is ``dest`` (kept open by the caller; it should be
    new and empty), up to the end-of-archive marker. Returns what was written; raises
    :class:`UntarError` naming the first entry refused."""
    got = Untarred()
    dirs = _Dirs(dest)
    try:
        with _open(fileobj) as tf:
            while True:
                try:
                    m = tf.next()
                except (tarfile.TarError, RecursionError, ValueError) as exc:
                    raise UntarError("", f"not a readable tar ({exc})") from None
                if m is None:
                    break
                _one(tf, m, dirs, limits, got)
                forget_read(tf)
        for parts, mode in got._modes:
            fd = dirs.open_parent([*parts, ""], "/".join(parts), create=None)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
    finally:
        dirs.close()
    return got


def forget_read(tf: tarfile.TarFile) -> None:
    """Drop the headers a stream-mode TarFile keeps of every member read (a stream is
    read once; kept, thousands of 4 MB PAX records filled the host's memory)."""
    cast(Any, tf).members.clear()


def _open(fileobj: IO[bytes]) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=fileobj, mode="r|", tarinfo=_CheckedInfo)
    except tarfile.TarError as exc:
        raise UntarError("", f"not a readable tar ({exc})") from None


def _one(tf: tarfile.TarFile, m: tarfile.TarInfo, dirs: _Dirs, lim: Limits,
         got: Untarred) -> None:
    name = m.name
    problem = name_problem(name)
    if problem is not None:
        raise UntarError(name, problem)
    parts = name.split("/")
    if len(parts) > lim.max_depth:
        raise UntarError(name, f"nested deeper than {lim.max_depth} levels; refused",
                         limit=True)
    if m.type in _REFUSED:
        raise UntarError(name, f"{_REFUSED[m.type]} refused (only regular files, "
                         f"directories{' and symlinks' if lim.symlinks else ''} are written)")
    if m.issym() and not lim.symlinks:
        raise UntarError(name, "symlink refused (only regular files and directories are "
                         "written here)")
    if not (m.isreg() or m.isdir() or m.issym()):
        raise UntarError(name, f"tar entry type {m.type!r} refused")
    if got.entries + 1 > lim.max_entries:
        raise UntarError(name, f"more than {lim.max_entries} entries; refused", limit=True)
    mode = m.mode & MODE_MASK
    pfd = dirs.open_parent(parts, name, create=(got, lim))
    try:
        if m.isdir():
            _mkdir(pfd, parts, name, mode, got)
        elif m.issym():
            _symlink(pfd, parts[-1], name, m, got)
        else:
            _write(tf, m, pfd, parts[-1], name, mode, lim, got)
    finally:
        os.close(pfd)


def _mkdir(pfd: int, parts: list[str], name: str, mode: int, got: Untarred) -> None:
    try:
        os.mkdir(parts[-1], 0o700, dir_fd=pfd)
    except FileExistsError:
        if name not in got._implicit:
            raise UntarError(name, "duplicate name refused (already in the archive)") from None
        got._implicit.discard(name)
        got.dirs -= 1  # counted when it was made for an earlier entry
    except OSError as exc:
        raise UntarError(name, f"cannot create the directory: {exc.strerror}") from None
    got.dirs += 1
    if mode & 0o700 == 0o700:
        try:
            fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=pfd)
        except OSError as exc:
            raise UntarError(name, f"cannot open the directory: {exc.strerror}") from None
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    else:  # applied at the end, so its own entries can still be written
        got._modes.append((parts, mode))


def _symlink(pfd: int, leaf: str, name: str, m: tarfile.TarInfo, got: Untarred) -> None:
    target = m.linkname
    if not target or "\0" in target:
        raise UntarError(name, "symlink with an empty or NUL target refused")
    try:
        os.symlink(target, leaf, dir_fd=pfd)
    except FileExistsError:
        raise UntarError(name, "duplicate name refused (already in the archive)") from None
    except OSError as exc:
        raise UntarError(name, f"cannot create the symlink: {exc.strerror}") from None
    os.utime(leaf, _times(m), dir_fd=pfd, follow_symlinks=False)
    got.links += 1


def _write(tf: tarfile.TarFile, m: tarfile.TarInfo, pfd: int, leaf: str, name: str,
           mode: int, lim: Limits, got: Untarred) -> None:
    if got.bytes + m.size > lim.max_bytes:
        raise UntarError(name, f"file bytes past the bound of {lim.max_bytes} "
                         f"({got.bytes} + {m.size}); refused", limit=True)
    try:
        fd = os.open(leaf, _NEW_FILE, 0o600, dir_fd=pfd)
    except FileExistsError:
        raise UntarError(name, "duplicate name refused (already in the archive)") from None
    except OSError as exc:
        raise UntarError(name, f"cannot create the file: {exc.strerror}") from None
    try:
        src = tf.extractfile(m)
        left = m.size
        while left and src is not None:
            chunk = src.read(min(left, 1 << 20))
            if not chunk:
                raise UntarError(name, "archive ends inside the file")
            left -= len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
        os.utime(fd, _times(m))
    except BaseException as exc:
        os.close(fd)
        fd = -1
        os.unlink(leaf, dir_fd=pfd)  # never leave a torn file behind
        if isinstance(exc, OSError):
            raise UntarError(name, f"cannot write: {exc.strerror or exc}") from None
        if isinstance(exc, tarfile.TarError):
            raise UntarError(name, f"not a readable tar ({exc})") from None
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    got.files += 1
    got.bytes += m.size


def _times(m: tarfile.TarInfo) -> tuple[int, int]:
    """The entry's mtime as (atime, mtime), clamped to what any filesystem takes."""
    t = mtime_of(m)
    return t, t


def mtime_of(m: tarfile.TarInfo) -> int:
    """An entry's mtime clamped to what any filesystem takes (a PAX record may say
    ``inf`` or ``nan``: 0)."""
    try:
        return min(max(int(m.mtime), 0), 2**32 - 1)
    except (OverflowError, ValueError, TypeError):
        return 0


class _Dirs:
    """Descriptors along the current path, reused while entries share a prefix (a tar
    lists a directory's entries together); deeper than :data:`_CACHED_LEVELS` they are
    opened for one entry and closed, but for the last such parent, kept for the entries
    after it in the same directory (so many files deep down cost one walk, not one each)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.stack: list[tuple[str, int]] = []
        self.deep: tuple[list[str], int] | None = None

    def close(self) -> None:
        while self.stack:
            os.close(self.stack.pop()[1])
        self._forget_deep()

    def _forget_deep(self) -> None:
        if self.deep is not None:
            os.close(self.deep[1])
            self.deep = None

    def open_parent(self, parts: list[str], name: str,
                    create: tuple[Untarred, Limits] | None) -> int:
        """A new descriptor of the directory holding ``parts[-1]``; a missing parent is
        made (counted as an entry) when ``create`` is given, else an error."""
        want = parts[:-1]
        if self.deep is not None and self.deep[0] == want:
            return os.dup(self.deep[1])
        keep = 0
        while keep < min(len(self.stack), len(want)) and self.stack[keep][0] == want[keep]:
            keep += 1
        while len(self.stack) > keep:
            os.close(self.stack.pop()[1])
        fd = self.stack[-1][1] if self.stack else self.root
        owned = False  # fd is a transient (uncached) descriptor to close
        try:
            for i in range(keep, len(want)):
                nfd = self._enter(fd, want, i, name, create)
                if owned:
                    os.close(fd)
                if len(self.stack) < _CACHED_LEVELS and not owned:
                    self.stack.append((want[i], nfd))
                    owned = False
                else:
                    owned = True
                fd = nfd
            if owned:
                self._forget_deep()
                self.deep = (want, os.dup(fd))
        except BaseException:
            if owned:
                os.close(fd)
            raise
        return fd if owned else os.dup(fd)

    @staticmethod
    def _enter(fd: int, want: list[str], i: int, name: str,
               create: tuple[Untarred, Limits] | None) -> int:
        part = want[i]
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            rel = "/".join(want[:i + 1])  # joined only when needed: O(depth) per level
            if create is None:
                raise UntarError(rel, "directory vanished during extraction") from None
        except OSError as exc:
            rel = "/".join(want[:i + 1])
            why = ("is not a directory (a file or symlink made by an earlier entry); "
                   "nothing is written through it" if exc.errno in (errno.ENOTDIR, errno.ELOOP)
                   else exc.strerror)
            raise UntarError(name, f"parent {shown(rel)} {why}") from None
        got, lim = create
        if got.entries + 2 > lim.max_entries:
            raise UntarError(name, f"more than {lim.max_entries} entries; refused",
                             limit=True)
        try:
            os.mkdir(part, 0o755, dir_fd=fd)
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.fchmod(nfd, 0o755)
        except OSError as exc:
            raise UntarError(name, f"cannot create its parent {shown(rel)}: "
                             f"{exc.strerror}") from None
        got.dirs += 1
        got._implicit.add(rel)
        return nfd
