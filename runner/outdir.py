"""Output directories are made exclusively: prior evidence is never overwritten.

``refuse_existing`` is checked first, so a rerun into used evidence fails before any
work; ``make_fresh_dir`` decides races; ``remove_created`` takes back what a failed
command made before its run started, so the corrected rerun can use the same path.
``staged`` is for a command whose output is only whole or absent (an export corpus, a
build context): it is written under a hidden sibling name and renamed into place at the
end, so a failure, a full disk or a signal leaves nothing at ``out`` to block the rerun.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from runner.errors import ConfigError
from runner.failures import is_environment_error

__all__ = ["make_fresh_dir", "refuse_existing", "refuse_inside_run", "remove_created",
           "run_holding", "staged", "within"]


def is_run_dir(d: Path) -> bool:
    """``d`` is a cyclebox run directory: its ``plan.json`` is one ``cyclebox freeze``
    wrote (an object with ``plan``, ``hashes`` and ``plan_hash``), a regular file owned by
    this user (another user's file named so decides nothing here), beside ``inputs/``."""
    from runner.loading import read_capped

    plan = d / "plan.json"
    try:
        st = os.lstat(plan)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() \
                or not (d / "inputs").is_dir():
            return False
        doc = json.loads(read_capped(plan, max_bytes=64 << 20, what="plan"))
    except (OSError, ValueError, ConfigError):
        return False
    return isinstance(doc, dict) and {"plan", "hashes", "plan_hash"} <= doc.keys()


def run_holding(path: Path) -> Path | None:
    """The cyclebox run directory ``path`` lies in (:func:`is_run_dir`, the nearest one
    above it), judged on the path with its links resolved (a missing tail as given); None
    when there is none. ``path`` itself is not looked at: one that exists is refused as
    taken."""
    try:
        p = Path(os.path.realpath(path))
    except (OSError, ValueError):
        return None
    return next((d for d in p.parents if is_run_dir(d)), None)


def within(path: Path, root: Path) -> bool:
    """``path`` is ``root`` or lies under it: by the path with links resolved (a missing
    tail as given), or by device and inode of ``root`` met among ``path``'s existing
    directories (a bind mount of ``root`` elsewhere; its path does not say so)."""
    try:
        p, r = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    except (OSError, ValueError):
        return False
    if p == r or r in p.parents:
        return True
    try:
        st = os.stat(r)
    except OSError:
        return False
    for d in (p, *p.parents):
        try:
            sd = os.stat(d)
        except OSError:
            continue
        if (sd.st_dev, sd.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def refuse_inside_run(path: Path, *, field: str = "--out") -> None:
    """ConfigError when ``path`` lies in a cyclebox run directory: its receipt binds every
    file in it (a corpus, packet, comparison or plan written there made ``receipt
    verify`` of that run fail, and every later export of it with it)."""
    run = run_holding(path)
    if run is not None:
        raise ConfigError(f"{_shown(path)} is inside the cyclebox run {_shown(run)}, "
                          "whose receipt binds "
                          "every file in it (anything written there makes `cyclebox receipt "
                          "verify` of that run fail)", field=field,
                          fix="write it beside the run directory, not in it")


def write_once(path: Path, data: bytes, *, what: str, field: str, fix: str) -> None:
    """Write ``data`` at ``path``, which must not exist (a symlink there, even a dangling
    one, counts): written whole and fsynced under a random name beside it, then linked
    into place, which never replaces and never follows a link. ConfigError naming
    ``field`` when the target appeared meanwhile or the directory cannot be written; an
    environment failure (a full disk) as itself."""
    parent = path.parent if str(path.parent) else Path(".")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    tmp = parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    made = False
    try:
        fd = os.open(tmp, flags, 0o644)  # a random name: an existing one is an OSError below
        made = True
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never replaces: FileExistsError when the target appeared
        except FileExistsError:
            raise ConfigError(f"{_shown(path)} appeared meanwhile; {what} is never "
                              "overwritten", field=field, fix=fix) from None
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        if is_environment_error(exc):
            raise
        raise ConfigError(f"cannot write {_shown(path)}: {exc.strerror or exc}",
                          path=_shown(path), field=field,
                          fix="pick a path in a directory you can write (not read-only)"
                          ) from None
    finally:
        if made:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _shown(path: Path) -> str:
    from runner.loading import show

    return show(str(path))


def make_parents(out: Path, created: list[Path]) -> None:
    """Create ``out``'s missing parents, outermost first, appending each one this call
    made to ``created`` as it goes (so a failure midway still names what it made; one a
    racer made a moment earlier is not ours)."""
    for parent in reversed(out.parents):
        if not parent.exists():
            with contextlib.suppress(FileExistsError):
                parent.mkdir()
                created.append(parent)


def make_fresh_dir(out: Path) -> list[Path]:
    """Create ``out`` exclusively (an existing one is refused, also when a racer made it a
    moment ago); returns the directories created, ``out`` last, for :func:`remove_created`.

    Missing parents are created and, on a refusal, left in place: removing them could pull
    a directory from under a racer that is about to create its own ``out`` there."""
    refuse_inside_run(out)
    created: list[Path] = []
    try:
        make_parents(out, created)
        out.mkdir()
    except FileExistsError:
        raise ConfigError(f"{out} already exists; prior evidence is never overwritten",
                          field="--out", fix="choose a new output directory") from None
    except OSError as exc:
        raise ConfigError(f"cannot create {out}: {exc.strerror}", field="--out",
                          fix="choose an output directory you can write") from None
    created.append(out)
    return created


def refuse_existing(out: Path) -> None:
    """ConfigError when ``out`` exists (or cannot even be looked at): checked first, so a
    rerun into used evidence fails before any work; :func:`make_fresh_dir` decides races.
    So is an ``out`` inside a run directory (:func:`refuse_inside_run`)."""
    try:
        taken = out.exists() or out.is_symlink()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{out} is not a usable output directory ({exc})", field="--out",
                          fix="choose a new output directory") from None
    if taken:
        raise ConfigError(f"{out} already exists; prior evidence is never overwritten",
                          field="--out", fix="choose a new output directory")
    refuse_inside_run(out)


def remove_created(created: list[Path]) -> None:
    """Undo :func:`make_fresh_dir` after a failure before the run started: the last
    directory (ours, made exclusively) with its content, then parents we made if empty."""
    if not created:
        return
    *parents, out = created
    shutil.rmtree(out, ignore_errors=True)
    for d in reversed(parents):
        with contextlib.suppress(OSError):
            d.rmdir()


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; FileExistsError when ``dst`` exists (renameat2
    RENAME_NOREPLACE where the kernel and file system have it; else checked, then renamed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
              _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code), str(dst))
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


@contextlib.contextmanager
def staged(out: Path, *, field: str = "--out") -> Iterator[Path]:
    """A new hidden directory beside ``out`` to write into; renamed to ``out`` when the
    block ends normally (never over an existing ``out``: ConfigError), removed with its
    content and the parents this made when it does not (an error, a full disk, a signal).

    So ``out`` exists only whole: an interrupted or failed command leaves nothing that
    blocks running it again. A directory that refuses the write is bad input naming
    ``out``; a full disk stays an environment failure."""
    refuse_existing(out)
    created: list[Path] = []
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    made = False
    try:
        try:
            make_parents(out, created)
            tmp.mkdir()
            made = True
        except OSError as exc:
            if is_environment_error(exc):
                raise
            raise ConfigError(f"cannot create {out}: {exc.strerror or exc}", field=field,
                              fix="choose an output directory you can write") from None
        yield tmp
        try:
            _rename_noreplace(tmp, out)
        except FileExistsError:
            raise ConfigError(f"{out} already exists (made while this command ran); prior "
                              "evidence is never overwritten", field=field,
                              fix="choose a new output directory") from None
    except BaseException:
        if made:
            shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
