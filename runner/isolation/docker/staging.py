"""Input staging for Docker role containers: each input mount hard-linked (or copied) under
an opaque per-run name, and the host output directory's seed content as a tar.

Both walk trees by directory descriptor (:mod:`runner.fswalk`): a path past ``PATH_MAX``
is staged like any other, and an entry that cannot be read is a named error, never
left out.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import shutil
import stat
import tarfile
import tempfile
from dataclasses import asdict
from pathlib import Path

from runner import fswalk
from runner.errors import ConfigError, PolicyViolation, SandboxError
from runner.isolation.docker.hardening import write_holder_files
from runner.isolation.owner import current_owner
from runner.isolation.policy import mount_violation
from runner.isolation.sandbox import RunSpec

STAGING_ENV = "CYCLEBOX_STAGING_DIR"
STAGED_DIR_MODE = 0o755


def _seed_tar(spec: RunSpec, links: dict[str, str]) -> bytes | None:
    """The host output directory's content as a tar for the output tmpfs, or None.

    Only host-made content is ever here (a stage's fresh directory, e.g. the apply
    stage's throwaway repository). Its symlinks go into ``links``: only those exact
    links may come back out (:func:`runner.isolation.copyout.extract`). The directory is
    walked and read by descriptor (:mod:`runner.fswalk`): a path past ``PATH_MAX`` is
    seeded like any other, and an entry that cannot be read is a named error, never
    left out."""
    root = spec.output_dir
    if root is None:
        return None
    uid, gid = spec.uid, spec.gid
    buf = io.BytesIO()
    total = 0
    seeded = False
    try:
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for e in fswalk.walk(root, max_depth=4096):
                seeded = True
                ti = fswalk.tarinfo(e, e.rel)
                if ti.issym():
                    links[ti.name] = ti.linkname
                ti.uid, ti.gid, ti.uname, ti.gname = uid, gid, "", ""
                total += ti.size
                if total > spec.output_cap_bytes:
                    raise SandboxError(f"{root}: seed content exceeds the output cap of "
                                       f"{spec.output_cap_bytes} bytes")
                fswalk.add_to_tar(tf, e, ti)
    except fswalk.WalkError as exc:
        raise SandboxError(f"{root}/{exc}: the output directory cannot be seeded "
                           "in full") from None
    return buf.getvalue() if seeded else None


STAGING_OWNER = "owner.json"


STAGING_PREFIX = "cbx-in-"
"""Per-run staging copies are ``<base>/cbx-in-<128 random bits>``: the path a role sees
in ``/proc/self/mountinfo`` names no pid, start time or uid of the controller."""
STAGING_NEW = STAGING_PREFIX + "new-"
"""A copy being made (``cbx-in-new-<pid>-<start>-...``, never mounted): renamed to its
random name once its owner record is inside, so `cyclebox gc` can always judge it."""


def staging_base() -> Path:
    """Where per-run input copies live: ``$CYCLEBOX_STAGING_DIR``, or the temp directory
    (each copy a private ``cbx-in-*`` directory in it, as gateway sockets are)."""
    return Path(os.environ.get(STAGING_ENV) or tempfile.gettempdir())


def legacy_staging_base() -> Path:
    """Where copies lived before: ``<tmp>/cyclebox-staging-<uid>`` (swept by gc)."""
    return Path(tempfile.gettempdir()) / f"cyclebox-staging-{os.getuid()}"


def check_mount_sources(spec: RunSpec) -> None:
    """The mount rules on every source the caller named (the gateway's own socket
    directory aside): no system directory, read-only inputs, no symlink as a source."""
    for i, m in enumerate(spec.mounts):
        if m.gateway:
            continue
        why = mount_violation(str(m.source), read_only=m.read_only)
        if why is not None:
            raise PolicyViolation(why, field=f"mounts[{i}]",
                                  fix="mount a project or data directory, read-only")
        if Path(m.source).is_symlink():
            raise PolicyViolation(f"{m.source} is a symlink; a mount source must be the "
                                  "directory or file itself", field=f"mounts[{i}]",
                                  fix="pass the resolved path")


def _new_staging_dir() -> Path:
    """A fresh ``<base>/cbx-in-<random>`` holding its owner record (beside the mounted
    ``m<i>`` directories, never in one), traversable (not listable) by the role uid.

    It is made as ``cbx-in-new-<pid>-<start>-...`` (so `cyclebox gc` can judge it if the
    controller dies before its record is written), then renamed: the mounted path, all a
    container sees in ``/proc/self/mountinfo``, names nothing about the controller."""
    base = staging_base()
    custom = bool(os.environ.get(STAGING_ENV))
    me = current_owner()
    for attempt in range(5):  # another run may remove an empty custom base meanwhile
        if custom:
            base.mkdir(mode=0o711, exist_ok=True)
            if base.is_symlink() or base.stat().st_uid != os.getuid():
                raise SandboxError(f"staging directory {base} is not ours; "
                                   f"Fix: set {STAGING_ENV} to a private directory")
        try:
            made = Path(tempfile.mkdtemp(prefix=f"{STAGING_NEW}{me.pid}-{me.start}-",
                                         dir=base))
            break
        except FileNotFoundError:
            if attempt == 4:
                raise
    try:
        os.chmod(made, 0o711)  # noqa: S103
        (made / STAGING_OWNER).write_text(json.dumps(asdict(me)))
        final = base / f"{STAGING_PREFIX}{secrets.token_hex(16)}"
        os.rename(made, final)
    except BaseException:
        shutil.rmtree(made, ignore_errors=True)
        raise
    return final


class _Staging:
    """Bind sources the container cannot map back to the operator's paths.

    Each input mount is hard-linked (copied across file systems) into
    ``$CYCLEBOX_STAGING_DIR`` or the temp directory, under a random per-run name
    (:func:`_new_staging_dir`), so ``/proc/self/mountinfo`` inside shows only that. The gateway
    socket directory is mounted as is (already an opaque temp directory). Beside the
    inputs, ``holder``: the holder's code for this container
    (:func:`runner.isolation.docker.hardening.write_holder_files`), gone with the copy."""

    def __init__(self, spec: RunSpec) -> None:
        self.dir: Path | None = None
        try:
            self._stage(spec)
            if self.dir is None:
                self.dir = _new_staging_dir()
            self.holder = write_holder_files(self.dir / "holder")
        except BaseException:
            self.cleanup()  # a half-made copy is never left behind
            raise

    def _stage(self, spec: RunSpec) -> None:
        # The mount rules apply to what the caller named, not to the staged copy (which
        # always lies in a harmless place): every source is checked before any copy.
        check_mount_sources(spec)
        mounts = []
        for i, m in enumerate(spec.mounts):
            if m.gateway:
                mounts.append(m)
                continue
            source = Path(m.source)
            if self.dir is None:
                self.dir = _new_staging_dir()
            dest = self.dir / f"m{i}"
            _link_tree(source, dest, target=m.target)
            mounts.append(m.model_copy(update={"source": dest}))
        self.spec = spec.model_copy(update={"mounts": tuple(mounts)})

    def cleanup(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            if os.environ.get(STAGING_ENV):
                with contextlib.suppress(OSError):  # the shared base, only when empty
                    self.dir.parent.rmdir()


def _link_tree(src: Path, dest: Path, *, target: str = "/") -> None:
    """Hard-link ``src`` (file or tree) to ``dest``; copy where a link is impossible.

    Symlinks inside are recreated as symlinks (a read-only bind shows them as before).
    The tree is walked by directory descriptor (:mod:`runner.fswalk`) and written the same
    way, so a path past ``PATH_MAX`` inside it is staged like any other; an entry that
    cannot be read is bad input naming it (exit 3), never left out, and so is a path
    that would be ``PATH_MAX`` or longer once mounted at ``target`` (no program in the
    container could open it by name)."""
    def one(s: Path, d: Path) -> None:
        try:
            os.link(s, d, follow_symlinks=False)
        except OSError:
            shutil.copy2(s, d, follow_symlinks=False)

    if not (src.is_dir() and not src.is_symlink()):
        one(src, dest)
        return
    # Staged directories are new inodes: readable by the role uid (which differs
    # from ours when we run as root), as an input must be; files keep their modes.
    dest.mkdir()
    os.chmod(dest, STAGED_DIR_MODE)
    # (relative directory, its staged copy's fd): the current entry's ancestors only
    made: list[tuple[str, int]] = [("", os.open(dest, fswalk.DIR_FLAGS))]
    try:
        for e in fswalk.walk(src, max_depth=4096):
            parent = e.rel.rpartition("/")[0]
            while made[-1][0] != parent:
                os.close(made.pop()[1])
            dfd = made[-1][1]
            inside = len(os.fsencode(f"{target.rstrip('/')}/{e.rel}"))
            if inside >= fswalk.PATH_MAX:
                raise fswalk.WalkError(e.rel, f"path of {inside} bytes once mounted at "
                                       f"{target}, past PATH_MAX ({fswalk.PATH_MAX}); no "
                                       "program in the container could open it")
            if e.is_link:
                os.symlink(e.readlink(), e.name, dir_fd=dfd)
            elif e.is_dir:
                os.mkdir(e.name, STAGED_DIR_MODE, dir_fd=dfd)
                sub = os.open(e.name, fswalk.DIR_FLAGS, dir_fd=dfd)
                os.fchmod(sub, STAGED_DIR_MODE)
                made.append((e.rel, sub))
            else:
                _link_or_copy(e, dfd)
    except fswalk.WalkError as exc:
        raise ConfigError(f"{src}/{fswalk.shown(exc.rel)}: {exc.reason}; the input tree "
                          "cannot be staged in full", fix="make every entry of the input "
                          "readable, with shorter paths (or remove it), and run again") from None
    finally:
        for _, fd in made:
            os.close(fd)


def _link_or_copy(e: fswalk.Entry, dfd: int) -> None:
    """One non-directory entry of an input tree into the directory ``dfd``: a hard link,
    or a copy (content, mode and times) where a link is impossible (another file system)."""
    try:
        os.link(e.name, e.name, src_dir_fd=e.parent_fd, dst_dir_fd=dfd, follow_symlinks=False)
    except OSError:
        _copy_in(e, dfd)


def _copy_in(e: fswalk.Entry, dfd: int) -> None:
    if not e.is_file:
        raise fswalk.WalkError(e.rel, "not a regular file, directory or symlink, and it "
                               "cannot be hard-linked into the staging copy")
    src_fd = e.open()
    try:
        fd = os.open(e.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0), stat.S_IMODE(e.st.st_mode), dir_fd=dfd)
        try:
            while chunk := os.read(src_fd, 1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            os.fchmod(fd, stat.S_IMODE(e.st.st_mode))
            os.utime(fd, ns=(e.st.st_atime_ns, e.st.st_mtime_ns))
        finally:
            os.close(fd)
    finally:
        os.close(src_fd)
