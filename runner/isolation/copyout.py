"""Extract a role's output tar stream onto the host, treating every byte as hostile.

The container never writes host disk: its output directory is a tmpfs inside it,
capped by the kernel in bytes (``size=``) and files (``nr_inodes=``). After the role
command ends, the in-container ``finish`` step of :mod:`sandbox.holder` writes that
directory as a tar stream, which arrives here through the engine. This module is the
only reader of that stream and never uses :func:`tarfile.extractall`:

* its own parser of 512-byte ustar/PAX/GNU headers (checksums verified, PAX and GNU
  long-name records capped at :data:`MAX_META_BYTES` before they are read);
* only regular files and directories are written; symlinks, hard links, devices,
  FIFOs, sparse and unknown entries are refused by name (the one exception: a
  symlink the host itself seeded, returned unchanged, is recreated as it was);
* names are relative UTF-8 without control characters (C0, DEL, C1), ``.``/``..``/empty
  parts or a leading ``/``, and are bounded in length, part length and depth;
* every byte read counts against a stream cap (the tmpfs size plus tar overhead for
  the allowed number of entries), every data byte against the output cap *before*
  it is written, every entry against the entry cap, so a forged stream exhausts
  neither memory nor disk; a refused file is never partly left behind;
* everything is created relative to directory fds with ``O_NOFOLLOW|O_EXCL`` and gets
  modes we choose: files 0644, directories 0755, owned by the operator (no setuid,
  nothing group- or world-writable, whatever the container set).

The existing :func:`runner.isolation.collect.collect` then reads the extracted tree as before.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from runner.errors import OutputRejected

BLOCK = 512
MAX_META_BYTES = 64 * 1024
PAGE = 4096
FILE_MODE = 0o644
DIR_MODE = 0o755
"""Readable by a later role container running as another uid (an output that becomes an
input, e.g. a model); writable only by the operator. The fresh output directory itself
stays 0700."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_NEW_FILE = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
             | getattr(os, "O_CLOEXEC", 0))
_REFUSED_TYPES = {b"1": "hard link", b"2": "symlink", b"3": "character device",
                  b"4": "block device", b"6": "fifo", b"K": "long link name",
                  b"S": "sparse file", b"V": "volume header", b"M": "multi-volume part"}


SCRATCH: dict[str, tuple[str, ...]] = {"apply": ("repo/.git",)}
"""Per role, the ``.git`` directories of its output that are its own scratch: the apply
container commits in ``/work/repo`` (:mod:`runner.cycle.apply`), and the host, which
rebuilds the candidate in its own repository, never keeps that one. Any other path
part named ``.git`` (in any case, with trailing dots or spaces) is refused: a git
repository a container wrote, kept in a run directory the operator owns, would run its
``core.fsmonitor`` or hooks as the operator at the first ``git status`` there (a shell
prompt or an editor opening the run does one)."""


def limits_for(role: str, *, max_bytes: int, max_entries: int) -> CopyLimits:
    """The copy-out caps of one role's output: its tmpfs, and its scratch."""
    return CopyLimits(max_bytes=max_bytes, max_entries=max_entries,
                      scratch=SCRATCH.get(role, ()))


# Code points HFS+ ignores in names (git's is_hfs_dotgit): ".g\u200cit" is ".git" there.
_HFS_IGNORED = dict.fromkeys([*range(0x200C, 0x2010), *range(0x202A, 0x202F),
                              *range(0x206A, 0x2070), 0xFEFF])


def _as_read(part: str) -> str:
    """``part`` as some filesystem a run directory may be copied to reads it: any case,
    trailing dots or spaces dropped (Windows), HFS+ ignorable code points dropped (macOS),
    an NTFS stream suffix dropped (``.git::$INDEX_ALLOCATION``), the last component of a
    backslash path (``x\\.git`` on Windows)."""
    p = part.rsplit("\\", 1)[-1].translate(_HFS_IGNORED).split(":", 1)[0]
    return p.rstrip(". ").casefold()


_VCS = (("git", "git"), ("hg", "Mercurial"), ("sl", "Sapling"), ("jj", "jj"),
        ("bzr", "Bazaar"))
VCS_DIRS = {**{f".{n}": t for n, t in _VCS}, **{f"{n}~1": t for n, t in _VCS}}
"""The directories in which a version-control tool keeps a repository and its config,
which it obeys as whoever runs it (Mercurial's ``.hg/hgrc`` hooks, owned by the
operator once copied out, ran at ``hg status``), by the name as some filesystem reads it
(:func:`_as_read`); and each one's 8.3 short name (``git~1``)."""


def _vcs_part(parts: list[str]) -> int | None:
    """Index of the first path part some version-control tool (on any filesystem) would
    take for its repository directory (:data:`VCS_DIRS`)."""
    return next((i for i, p in enumerate(parts) if _as_read(p) in VCS_DIRS), None)


GIT_DIR_NAMES = frozenset({"head", "objects", "refs"})
"""What makes a directory a git directory to git itself (``is_git_directory``): a
``HEAD``, an ``objects`` and a ``refs`` in it, whatever the directory is called (a bare
repository: ``safe.bareRepository`` is ``all`` by default, and its config is obeyed)."""

GIT_POINTERS = frozenset({"commondir", "gitdir"})
"""Files by which git (and libgit2) take a directory's ``objects``, ``refs`` and config
from another directory: a ``HEAD`` beside a ``commondir`` naming ``y`` made a bare
repository of two directories, neither of which held all three names."""

HEAD_PREFIX = 40
"""Bytes of a file named ``HEAD`` read to tell whether git takes it for one
(``validate_headref``: ``ref:`` then a ref, or an object id of 40 or 64 hex digits)."""


def _head_like(first: bytes) -> bool:
    """The first bytes of a file named ``HEAD`` are what git takes for a HEAD (broadly:
    any ``ref:``, whatever follows; 40 hex digits, the shortest object id)."""
    return first.startswith(b"ref:") or (
        len(first) >= HEAD_PREFIX and all(c in b"0123456789abcdefABCDEF" for c in first[:40]))


class CopyRefused(OutputRejected):
    """The output stream broke a rule; ``limit`` says whether a size/count cap was hit."""

    def __init__(self, message: str, *, limit: bool = False) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class CopyLimits:
    """Caps for one output stream."""

    max_bytes: int
    """Total file bytes (the tmpfs size, i.e. the role's ``output_cap``)."""
    max_entries: int
    """Files plus directories (the tmpfs ``nr_inodes``)."""
    max_depth: int = 32
    max_name: int = 4096
    max_part: int = 255
    scratch: tuple[str, ...] = ()
    """Output paths that are the container's own scratch (:data:`SCRATCH`): their
    entries are read off the stream and counted (:attr:`Extracted.scratch`), never
    written to the host."""

    @property
    def stream_cap(self) -> int:
        """Bytes the stream may carry: data plus, per entry, padding, a header and a
        PAX record with the longest allowed name, plus the end-of-archive blocks."""
        per_entry = 4 * BLOCK + self.max_name
        return self.max_bytes + self.max_entries * per_entry + 20 * BLOCK


@dataclass
class Extracted:
    """What was written on the host."""

    files: int = 0
    dirs: int = 0
    bytes: int = 0
    pages: int = 0
    """File bytes rounded up to 4 KiB pages per file (tmpfs usage, sparse files aside)."""
    stream_bytes: int = 0
    scratch: int = 0
    """Entries of the role's scratch (:attr:`CopyLimits.scratch`): read, not written."""


class _Stream:
    """Exact reads from an iterator of chunks, with a hard cap on bytes consumed."""

    def __init__(self, chunks: Iterable[bytes], cap: int) -> None:
        self._it: Iterator[bytes] = iter(chunks)
        self._buf = bytearray()
        self.cap = cap
        self.taken = 0

    def read(self, n: int, *, what: str) -> bytes:
        if n < 0:  # a negative size would rewind ``taken`` and void the cap
            raise CopyRefused(f"output stream: negative length while reading {what}")
        if self.taken + n > self.cap:
            raise CopyRefused(f"output stream exceeds {self.cap} bytes while reading {what}",
                              limit=True)
        while len(self._buf) < n:
            try:
                chunk = next(self._it)
            except StopIteration:
                raise CopyRefused(f"output stream truncated while reading {what}") from None
            self._buf += chunk
            if len(self._buf) > n + (1 << 20) and len(self._buf) > self.cap - self.taken:
                raise CopyRefused(f"output stream exceeds {self.cap} bytes", limit=True)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        self.taken += n
        return out

    def chunks(self, n: int, *, what: str) -> Iterator[bytes]:
        while n:
            k = min(n, 1 << 20)
            yield self.read(k, what=what)
            n -= k


_OCTAL_DIGITS = frozenset(b"01234567")


def _octal(field: bytes, what: str) -> int:
    """A header number, never negative: octal digits only (``int()`` alone would take
    ``-1``, ``+7`` or ``1_0``), or GNU base-256 without its sign bit."""
    if field[:1] and field[0] & 0x80:  # GNU base-256
        if field[0] & 0x40:  # two's-complement sign bit: a negative number
            raise CopyRefused(f"output stream: negative {what} field in a tar header")
        return int.from_bytes(field, "big") & ~(0x80 << (8 * (len(field) - 1)))
    s = field.split(b"\0", 1)[0].strip(b" ")
    if not s:
        return 0
    if not set(s) <= _OCTAL_DIGITS:
        raise CopyRefused(f"output stream: bad {what} field in a tar header")
    return int(s, 8)


def _checksum_ok(h: bytes) -> bool:
    want = _octal(h[148:156], "checksum")
    return sum(h[:148]) + 8 * 32 + sum(h[156:]) == want


def _pax(data: bytes) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    i = 0
    while i < len(data):
        sp = data.find(b" ", i)
        if sp < 0:
            raise CopyRefused("output stream: malformed PAX record")
        try:
            n = int(data[i:sp])
        except ValueError:
            raise CopyRefused("output stream: malformed PAX record length") from None
        rec = data[i:i + n]
        if n <= sp - i or len(rec) != n or not rec.endswith(b"\n"):
            raise CopyRefused("output stream: malformed PAX record")
        key, eq, value = rec[sp - i + 1:-1].partition(b"=")
        if not eq:
            raise CopyRefused("output stream: malformed PAX record")
        out[key] = value
        i += n
    return out


def _parts(raw: bytes, lim: CopyLimits) -> list[str]:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CopyRefused(f"output entry {raw[:200]!r}: name is not UTF-8") from None
    shown = repr(name[:200])
    if len(raw) > lim.max_name:
        raise CopyRefused(f"output entry {shown}: name longer than {lim.max_name} bytes",
                          limit=True)
    bad = next((c for c in name if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None)
    if bad is not None:  # C0, DEL and C1 (U+0080-U+009F): none reaches the host's disk
        raise CopyRefused(f"output entry {shown}: control character U+{ord(bad):04X} "
                          "in name refused")
    if name.startswith("/"):
        raise CopyRefused(f"output entry {shown}: absolute name refused")
    parts = name.rstrip("/").split("/")
    if name.startswith("./"):
        parts = parts[1:]
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise CopyRefused(f"output entry {shown}: empty, '.' or '..' path part refused")
    if any(len(p.encode()) > lim.max_part for p in parts):
        raise CopyRefused(f"output entry {shown}: a path part is longer than "
                          f"{lim.max_part} bytes", limit=True)
    if len(parts) > lim.max_depth:
        raise CopyRefused(f"output entry {shown}: nested deeper than {lim.max_depth} levels",
                          limit=True)
    return parts


def _open_parent(root_fd: int, parts: list[str], lim: CopyLimits, got: Extracted) -> int:
    """fd of the directory holding ``parts[-1]``, creating missing parents.

    A parent created here (its entry did not come first) counts as an entry, as it
    would in the tmpfs; room for the entry ``parts`` itself is kept, so the count
    never passes ``lim.max_entries``."""
    fd = os.dup(root_fd)
    try:
        for p in parts[:-1]:
            try:
                nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if got.files + got.dirs + 2 > lim.max_entries:
                    raise CopyRefused(f"output has more than {lim.max_entries} entries",
                                      limit=True) from None
                os.mkdir(p, DIR_MODE, dir_fd=fd)
                got.dirs += 1
                nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except OSError as exc:
        os.close(fd)
        raise CopyRefused(f"output entry {'/'.join(parts)!r}: parent cannot be created "
                          f"({exc.strerror})") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def extract(chunks: Iterable[bytes], dest: Path, lim: CopyLimits, *,
            seed_links: Mapping[str, str] | None = None) -> Extracted:
    """Extract a tar stream into the existing directory ``dest``; raise CopyRefused.

    ``seed_links`` maps relative paths to symlink targets that the *host* put into
    the output directory before the run (a repository checkout's own symlinks): a
    symlink entry equal to one of them is recreated as it was; any other is refused."""
    st = _Stream(chunks, lim.stream_cap)
    got = Extracted()
    root_fd = os.open(dest, _DIR_FLAGS)
    try:
        _extract(st, root_fd, lim, got, dict(seed_links or {}))
    finally:
        os.close(root_fd)
        got.stream_bytes = st.taken
    return got


def _git_dir_names(parts: list[str], seen: dict[str, set[str]], shown: str) -> None:
    """Note each of ``HEAD``, ``objects`` and ``refs`` along ``parts`` (an entry's own
    name or a parent it implies) under its directory; refuse once one directory holds
    all three (a bare repository's layout, under any name)."""
    for i, p in enumerate(parts):
        name = _as_read(p)  # "refs." is "refs" on Windows
        if name in GIT_DIR_NAMES:
            where = "/".join(_as_read(x) for x in parts[:i])
            names = seen.setdefault(where, set())
            names.add(name)
            if names == GIT_DIR_NAMES:
                raise CopyRefused(
                    f"output entry {shown!r}: {where or 'the output'!r} holds HEAD, objects "
                    "and refs, a git repository's layout (a git command run in it or below "
                    "would obey its config as the operator); write a bundle or a patch "
                    "instead")


def _extract(st: _Stream, root_fd: int, lim: CopyLimits, got: Extracted,
             seed_links: dict[str, str]) -> None:
    git_dirs: dict[str, set[str]] = {}
    long_name: bytes | None = None
    pax: dict[bytes, bytes] = {}
    while True:
        h = st.read(BLOCK, what="a tar header")
        if h == bytes(BLOCK):
            return  # end of archive; the rest (a second zero block, padding) is ignored
        if not _checksum_ok(h):
            raise CopyRefused("output stream: tar header checksum mismatch")
        kind = h[156:157]
        size = _octal(h[124:136], "size")
        if kind in (b"x", b"g", b"L"):
            if size > MAX_META_BYTES:
                raise CopyRefused(f"output stream: metadata record of {size} bytes refused",
                                  limit=True)
            data = st.read(size, what="a metadata record")
            st.read(-size % BLOCK, what="padding")
            if kind == b"x":
                pax = _pax(data)
            elif kind == b"L":
                long_name = data.split(b"\0", 1)[0]
            continue
        if b"path" in pax:
            raw = pax[b"path"]
        elif long_name is not None:
            raw = long_name
        else:
            raw = h[:100].split(b"\0", 1)[0]
            if h[257:263] == b"ustar\0":
                prefix = h[345:500].split(b"\0", 1)[0]
                if prefix:
                    raw = prefix + b"/" + raw
        if b"size" in pax:
            value = pax[b"size"]
            # digits only: int() would also take "-1", "+1", " 1" or "1_0"
            if not (value.isdigit() and len(value) <= 20):
                raise CopyRefused("output stream: bad PAX size")
            size = int(value)
        link = pax.get(b"linkpath", h[157:257].split(b"\0", 1)[0])
        long_name, pax = None, {}
        parts = _parts(raw, lim)
        shown = "/".join(parts)
        vcs = _vcs_part(parts)
        if vcs is not None:
            if "/".join(parts[:vcs + 1]) not in lim.scratch:
                tool = VCS_DIRS[_as_read(parts[vcs])]
                raise CopyRefused(
                    f"output entry {shown!r}: a {parts[vcs]!r} path part refused (a {tool} "
                    f"repository a container wrote is never kept on the host, where {tool} "
                    "would obey its config and hooks; write a bundle or a patch instead)")
            got.scratch += 1
            st.read(size + (-size % BLOCK), what="scratch data")
            continue
        _git_dir_names(parts, git_dirs, shown)
        if kind == b"2" and shown in seed_links and \
                link == seed_links[shown].encode("utf-8", "surrogateescape"):
            if got.files + got.dirs + 1 > lim.max_entries:
                raise CopyRefused(f"output has more than {lim.max_entries} entries",
                                  limit=True)
            pfd = _open_parent(root_fd, parts, lim, got)
            try:
                os.symlink(seed_links.pop(shown), parts[-1], dir_fd=pfd)
            except FileExistsError:
                raise CopyRefused(f"output entry {shown!r}: duplicate name") from None
            finally:
                os.close(pfd)
            got.files += 1
            st.read(size + (-size % BLOCK), what="link data")
            continue
        if kind in _REFUSED_TYPES:
            raise CopyRefused(f"output entry {shown!r}: {_REFUSED_TYPES[kind]} refused "
                              "(only regular files and directories are copied out)")
        if got.files + got.dirs + 1 > lim.max_entries:
            raise CopyRefused(f"output has more than {lim.max_entries} entries", limit=True)
        if kind == b"5":
            pfd = _open_parent(root_fd, parts, lim, got)
            try:
                try:
                    os.mkdir(parts[-1], DIR_MODE, dir_fd=pfd)
                except FileExistsError:
                    if not stat.S_ISDIR(os.lstat(parts[-1], dir_fd=pfd).st_mode):
                        raise CopyRefused(f"output entry {shown!r}: duplicate name") from None
                dfd = os.open(parts[-1], _DIR_FLAGS, dir_fd=pfd)
                os.fchmod(dfd, DIR_MODE)  # whatever the umask
                os.close(dfd)
            finally:
                os.close(pfd)
            got.dirs += 1
            st.read(size + (-size % BLOCK), what="directory data")
            continue
        if kind not in (b"0", b"\0", b"7"):
            raise CopyRefused(f"output entry {shown!r}: tar entry type {kind!r} refused")
        if size < 0 or got.bytes + size > lim.max_bytes:
            raise CopyRefused(f"output entry {shown!r}: output cap of {lim.max_bytes} bytes "
                              f"exceeded ({got.bytes} + {size})", limit=True)
        name = _as_read(parts[-1])
        if name in GIT_POINTERS:
            raise CopyRefused(f"output entry {shown!r}: a file named {parts[-1]!r} points git "
                              "at another directory's objects, refs and config (with a HEAD "
                              f"beside it, a repository); {_GIT_FIX}")
        _write_file(st, root_fd, parts, size, lim, got, head=name == "head")
        got.files += 1
        got.bytes += size
        got.pages += -(-size // PAGE)
        st.read(-size % BLOCK, what="padding")


_GIT_FIX = "write a bundle or a patch instead (git would obey its config and hooks there)"


def _refuse_head(first: bytes, shown: str) -> None:
    if _head_like(first):
        raise CopyRefused(f"output entry {shown!r}: a HEAD git would take for a repository's "
                          f"(it begins {first[:12]!r}); {_GIT_FIX}")


def _write_file(st: _Stream, root_fd: int, parts: list[str], size: int, lim: CopyLimits,
                got: Extracted, *, head: bool = False) -> None:
    """Write one file's bytes. ``head``: it is named ``HEAD`` (as some filesystem reads the
    name), and is refused, before its last byte is written, when git takes it for a HEAD:
    git treats a directory as a repository only beside a valid HEAD (``is_git_directory``),
    wherever its objects and refs are (``commondir``)."""
    shown = "/".join(parts)
    first = b""
    pfd = _open_parent(root_fd, parts, lim, got)
    try:
        try:
            fd = os.open(parts[-1], _NEW_FILE, FILE_MODE, dir_fd=pfd)
        except FileExistsError:
            raise CopyRefused(f"output entry {shown!r}: duplicate name") from None
        try:
            os.fchmod(fd, FILE_MODE)
            for chunk in st.chunks(size, what=f"file {shown!r}"):
                if head and len(first) < HEAD_PREFIX:
                    first += chunk[:HEAD_PREFIX - len(first)]
                    if len(first) >= HEAD_PREFIX or len(first) == size:
                        _refuse_head(first, shown)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            fd = -1
            os.unlink(parts[-1], dir_fd=pfd)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
    finally:
        os.close(pfd)
