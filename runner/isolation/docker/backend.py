"""Docker implementation of :class:`runner.isolation.sandbox.Sandbox`; only it imports docker.

Invariants: a container is created from an image id or local tag and never pulled;
its arguments come only from :func:`runner.isolation.docker.hardening.create_kwargs` (the container)
and :func:`runner.isolation.docker.hardening.exec_kwargs` (the role command, run by exec under the
holder PID 1 of :mod:`sandbox.holder`); stdout/stderr are streamed from the exec (the
engine keeps no log copy) and counted against the cap; the output directory is a
kernel-capped tmpfs copied out through :mod:`runner.isolation.copyout` before removal; input
mounts are staged under opaque names; every container is removed in ``finally`` and
removal is confirmed by asking the engine, not assumed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests.exceptions
from docker.models.containers import _create_container_args

from runner import fswalk, interrupts
from runner.errors import (
    ConfigError,
    OutputRejected,
    PolicyViolation,
    PrerequisiteError,
    SandboxError,
)
from runner.isolation.collect import loads_strict
from runner.isolation.copyout import CopyLimits, CopyRefused, Extracted, extract
from runner.isolation.docker.hardening import create_kwargs, exec_kwargs, holder_argv
from runner.isolation.owner import Owner, current_owner
from runner.isolation.policy import mount_violation
from runner.isolation.sandbox import (
    LABEL_PREFIX,
    MANAGED_LABEL,
    DeferredRun,
    OutputCallback,
    PreparedRun,
    RunFlags,
    RunRecord,
    RunSpec,
    StopReason,
    SweepResult,
    classify_stop,
)
from sandbox.holder import READY

TAIL_BYTES = 64 * 1024
STOP_GRACE_S = 5.0
"""How long role processes get to die after the holder's SIGUSR1 before we kill all."""
STATUS_CAP = 64 * 1024
SEED_REPLY_CAP = 64
FINISH_BASE_S = 30.0
FINISH_BYTES_PER_S = 32 * 1024 * 1024
READY_TIMEOUT_S = 10.0
"""How long the holder may take to protect its output stream before the run fails."""
STAGING_ENV = "CYCLEBOX_STAGING_DIR"
STAGED_DIR_MODE = 0o755


@dataclass
class _Finish:
    """What the copy-out found."""

    oom_kills: int = 0
    limit: bool = False
    invalid: bool = False
    detail: str = ""
    egress: tuple[str, ...] = ()
    egress_count: int = 0


class _DiedEarly(Exception):
    """The container stopped (killed from outside) before its role command could run."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__("container stopped before its command ran")
        self.state = state


def killed_from_outside(container: Mapping[str, Any], *, ours: bool) -> str | None:
    """A detail naming an outside kill when the container itself (the holder, PID 1)
    stopped with a signal we did not send: e.g. ``docker kill`` (137, SIGKILL). The
    holder exits 0 after a copy-out; only our own last-resort kill (``ours``) or the
    kernel's OOM killer (flagged) would also stop it by a signal."""
    state = container.get("State")
    if ours or not isinstance(state, Mapping) or state.get("Running") \
            or state.get("OOMKilled"):
        return None
    code = state.get("ExitCode")
    if not isinstance(code, int) or code <= 128:
        return None
    try:
        name = signal.Signals(code - 128).name
    except ValueError:
        name = f"signal {code - 128}"
    return (f"the container was killed from outside the controller (exit {code}, {name}; "
            "e.g. docker kill)")


class _CopyOut:
    """Reads the holder's own stdout/stderr (attached before start): its status lines
    and the output tar, extracted as it streams by :func:`runner.isolation.copyout.extract`."""

    def __init__(self, spec: RunSpec, seed_links: dict[str, str],
                 stream: Iterator[tuple[bytes | None, bytes | None]]) -> None:
        self.spec = spec
        self.seed_links = seed_links
        self.stream = stream
        self.announced = threading.Event()
        """Set when the holder's first status line arrived (it got our SIGUSR1)."""
        self.ready = threading.Event()
        """Set when the holder's stdout began (``ready_ok``: with :data:`READY`) or ended."""
        self.ready_ok = False
        self.done = threading.Event()
        self.errs = _Tail()
        self.got: Extracted | BaseException | None = None
        self._thread = threading.Thread(target=self._consume, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _chunks(self) -> Iterator[bytes]:
        cleared = False
        head = b""
        for o, e in self.stream:
            if e and self.errs.total < STATUS_CAP:
                self.errs.add(e)
                if b"\n" in e:
                    self.announced.set()
            data = o
            if data and not self.ready.is_set():
                # the holder's readiness marker (written before any role process exists)
                head += data
                if len(head) < len(READY):
                    continue
                self.ready_ok = head.startswith(READY)
                self.ready.set()
                if not self.ready_ok:
                    raise CopyRefused("output stream: the holder's readiness marker is missing")
                data = head[len(READY):]
            if data:
                if not cleared and self.spec.output_dir is not None:
                    _clear(self.spec.output_dir)  # host-made seed content, if any
                    cleared = True
                yield data

    def _consume(self) -> None:
        spec = self.spec
        chunks = self._chunks()
        try:
            if spec.output_dir is not None:
                lim = CopyLimits(max_bytes=spec.output_cap_bytes,
                                 max_entries=spec.output_max_entries)
                self.got = extract(chunks, spec.output_dir, lim, seed_links=self.seed_links)
        except BaseException as exc:
            self.got = exc
            self.ready.set()
            self.done.set()  # refused: decided now; the rest is drained and dropped
        try:
            # Keep reading to the end (the status line follows the tar), dropping any
            # bytes: a writer blocked on an unread pipe would also block the engine's
            # kill and removal of the container.
            for _ in chunks:
                pass
        except (requests.exceptions.RequestException, OSError, ValueError):
            pass
        finally:
            self.ready.set()  # the stream ended: whoever waits for the marker stops
            self.done.set()

    def result(self, *, holder_gone: bool = False) -> _Finish:
        """What the copy-out found; ``holder_gone``: the container stopped (killed from
        outside), so no status line can still be on its way."""
        fin = _Finish()
        spec = self.spec
        if not self.done.is_set():
            fin.invalid, fin.detail = True, "copy-out did not finish in time"
            return fin
        got = self.got
        if isinstance(got, CopyRefused):
            # decided before the end of the stream: the status line, written before
            # the tar but on the other pipe, may still be on its way
            self.announced.wait(0 if holder_gone else STOP_GRACE_S)
        status = _status(self.errs.text())
        pre, post = status.get("pre"), status.get("post")
        if pre is None or (post is None and not isinstance(got, CopyRefused)):
            fin.invalid = True
            fin.detail = "container stopped before its output could be copied out"
            return fin
        with contextlib.suppress(TypeError, ValueError):
            fin.oom_kills = int(pre.get("oom_kill") or 0)
        fin.egress, fin.egress_count = egress_refused(pre)
        if pre.get("dumpable") != 0:
            fin.invalid = True
            fin.detail = "the holder could not protect its output stream (dumpable)"
            return fin
        df = pre.get("df") if isinstance(pre.get("df"), dict) else None
        # gVisor's tmpfs reports no inode counts (files 0): only a real count can be full;
        # the host's extractor still caps entries there.
        full = df is not None and (df.get("bfree") == 0 or (
            df.get("ffree") == 0 and isinstance(df.get("files"), int) and df["files"] > 0))
        if full:
            fin.limit = True
            fin.detail = (f"output tmpfs full ({spec.output_cap_bytes} bytes, "
                          f"{spec.output_max_entries} entries); further writes got ENOSPC")
        # the holder left out a (sparse) file bigger than the output directory itself
        over = post.get("limit") if post is not None else None
        if over:
            fin.limit = True
            fin.detail = "; ".join(x for x in (fin.detail, f"output cap: {str(over)[:300]}")
                                   if x)
        if isinstance(got, CopyRefused):
            fin.limit = fin.limit or got.limit
            fin.invalid = not fin.limit
            fin.detail = "; ".join(x for x in (fin.detail, str(got)) if x)
        elif isinstance(got, BaseException):
            fin.invalid, fin.detail = True, f"copy-out failed: {type(got).__name__}: {got}"
        elif spec.output_dir is not None and not fin.limit:
            errors = post.get("errors") if post is not None else None
            if errors or pre.get("others_left"):
                fin.invalid = True
                fin.detail = ("copy-out reported: "
                              + ("; ".join(map(str, errors or [])) or "processes left"))[:500]
        return fin


EGRESS_MAX_HOSTS = 16
EGRESS_HOST_CHARS = 120


def egress_refused(pre: Mapping[str, Any]) -> tuple[tuple[str, ...], int]:
    """The hosts and the count of requests the holder's deny-all proxy refused, from its
    status line (written by the role's container, so bounded and escaped again here)."""
    hosts = pre.get("egress_refused")
    count = pre.get("egress_refused_count")
    names = [h for h in (hosts if isinstance(hosts, list) else []) if isinstance(h, str)]
    shown = tuple(ascii(h[:EGRESS_HOST_CHARS])[1:-1][:EGRESS_HOST_CHARS]
                  for h in names[:EGRESS_MAX_HOSTS])
    n = count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else 0
    return shown, max(n, len(shown))


def _holder_said(text: str) -> str:
    """The holder's own refusal before READY (e.g. its loopback relay could not listen),
    bounded and escaped, for the error message; empty when it said nothing of the kind."""
    for line in text.splitlines()[:4]:
        if line.startswith("relay: "):
            return f" ({ascii(line[:200])[1:-1]})"
    return ""


def _status(text: str) -> dict[str, dict[str, Any]]:
    """The holder's status lines by phase ("pre" before the tar, "post" after it)."""
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines()[:8]:
        try:
            got = loads_strict(line[:STATUS_CAP], source="copy-out status")
        except OutputRejected:
            continue
        if isinstance(got, dict) and got.get("phase") in ("pre", "post"):
            out.setdefault(str(got["phase"]), got)
    return out


def _clear(root: Path) -> None:
    """Empty a host output directory that held host-made seed content."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


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
    socket directory is mounted as is (already an opaque temp directory)."""

    def __init__(self, spec: RunSpec) -> None:
        self.dir: Path | None = None
        try:
            self._stage(spec)
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


def connect(timeout: int = 60) -> docker.DockerClient:
    """A client for the local engine, or PrerequisiteError saying how to get one."""
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        raise PrerequisiteError(
            f"Docker engine not reachable ({exc}). Fix: start it (`make docker` installs "
            "Debian's docker.io and starts dockerd when run as root), or set DOCKER_HOST."
        ) from None
    return client


@dataclass(frozen=True)
class EngineInfo:
    """Facts about the engine that doctor reports."""

    version: str
    api_version: str
    cgroup_version: str
    storage_driver: str
    security_options: tuple[str, ...]
    runtimes: tuple[str, ...]
    docker_root: str


def engine_info(client: docker.DockerClient) -> EngineInfo:
    info = client.info()
    ver = client.version()
    return EngineInfo(
        version=str(ver.get("Version", "?")),
        api_version=str(ver.get("ApiVersion", "?")),
        cgroup_version=str(info.get("CgroupVersion", "?")),
        storage_driver=str(info.get("Driver", "?")),
        security_options=tuple(info.get("SecurityOptions") or ()),
        runtimes=tuple(sorted((info.get("Runtimes") or {}).keys())),
        docker_root=str(info.get("DockerRootDir", "")),
    )


class _Tail:
    """Counts a byte stream and keeps its last TAIL_BYTES."""

    def __init__(self) -> None:
        self.total = 0
        self.buf = bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.buf += chunk
        if len(self.buf) > TAIL_BYTES:
            del self.buf[: len(self.buf) - TAIL_BYTES]

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


def exec_state(info: Mapping[str, Any] | None) -> tuple[int | None, bool]:
    """(exit code, still running) from an exec's inspect JSON.

    None (the engine dropped the exec with its container): gone, its code unknown. Ended
    means not running *and* an exit code: an exec the engine has not started yet shows
    neither, and counts as still running."""
    if info is None:
        return None, False
    code = info.get("ExitCode")
    if not info.get("Running") and code is not None:
        return int(code), False
    return None, True


def flags_from_inspect(container: Mapping[str, Any], exec_info: Mapping[str, Any] | None, *,
                       oom_kills: int = 0, timed_out: bool = False,
                       stream_exceeded: bool = False, output_dir_exceeded: bool = False,
                       output_invalid: bool = False, output_detail: str = "",
                       cleanup_confirmed: bool = True) -> RunFlags:
    """What :func:`runner.isolation.sandbox.classify_stop` decides on, from the engine's
    JSON (``container``: container inspect; ``exec_info``: the role command's exec
    inspect, None when the engine dropped it) and what the controller saw itself.

    The exit code is the exec's (the container's own is the holder's). The engine sets
    ``State.OOMKilled`` only when the kernel killed PID 1, so an OOM-killed role command
    is known by the ``oom_kill`` count the holder read from the cgroup (``oom_kills``).
    Pure; tested on captured ``docker inspect`` output (``tests/fixtures/inspect/``).
    """
    state = container.get("State")
    engine_oom = bool(state.get("OOMKilled")) if isinstance(state, Mapping) else False
    return RunFlags(exit_code=exec_state(exec_info)[0], oom_killed=engine_oom or oom_kills > 0,
                    timed_out=timed_out, stream_exceeded=stream_exceeded,
                    output_dir_exceeded=output_dir_exceeded, output_detail=output_detail,
                    output_invalid=output_invalid, cleanup_confirmed=cleanup_confirmed)


class DockerSandbox:
    """Runs role containers on the local Docker engine under the isolation contract."""

    name = "docker"

    def __init__(self, client: docker.DockerClient | None = None,
                 owner: Owner | None = None, timeout: int = 60) -> None:
        self.client = client or connect(timeout=timeout)
        self.owner = owner or current_owner()

    # -- running ---------------------------------------------------------------
    def prepare(self, spec: RunSpec) -> PreparedRun:
        """Deferred until the holder starts the role command itself (issue 23, part 1, on
        branch ``holder``): the container is created when the case runs."""
        return DeferredRun(self, spec)

    def run(self, spec: RunSpec, *, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None) -> RunRecord:
        """Run one role command to completion or limit, copy its output out; always remove.

        PID 1 is :mod:`sandbox.holder`; the role command runs through exec, so its exit
        code is the engine's exec record. Its output directory is a capped tmpfs that
        the holder writes as a tar to its own stdout when we send SIGUSR1, read here from
        an attach made before start (see :mod:`runner.isolation.copyout`).

        ``cancel`` set before the container starts: it is removed unstarted and
        SandboxError raised (a caller stopping a run sweeps the containers that exist;
        this closes the gap for one whose creation was in flight during the sweep).
        """
        staged: _Staging | None = None
        try:
            # A signal while the copy is made would leave it behind: held until the
            # copy is ours to remove, then it unwinds.
            with interrupts.deferred():
                staged = _Staging(spec)
            return self._run_staged(staged.spec, on_output=on_output, cancel=cancel)
        finally:
            if staged is not None:
                staged.cleanup()

    def _run_staged(self, spec: RunSpec, *, on_output: OutputCallback | None,
                    cancel: threading.Event | None) -> RunRecord:
        kwargs = create_kwargs(spec, self.owner, secrets.token_hex(4))
        api = self.client.api
        started = time.monotonic()
        deadline = started + spec.timeout_s
        out, err = _Tail(), _Tail()
        stream_exceeded = threading.Event()
        stopping = threading.Event()
        timed_out = False
        exec_info: dict[str, Any] | None = None
        state: dict[str, Any] = {}
        fin = _Finish()
        image_id = spec.image
        cid: str | None = None
        ours_killed = False
        try:
            seed_links: dict[str, str] = {}
            seed = _seed_tar(spec, seed_links)
            try:
                # the model layer's create() also inspects the new container: skip that
                args = _create_container_args({**kwargs, "version": api._version})
                cid = str(api.create_container(**args)["Id"])
            except docker.errors.ImageNotFound:
                raise SandboxError(f"image {spec.image} for role {spec.role} is not present "
                                   "locally. Fix: cyclebox images build") from None
            except docker.errors.APIError as exc:
                raise SandboxError(f"engine refused to create the {spec.role} container: "
                                   f"{exc.explanation or exc}") from None
            except BaseException:
                # Interrupted (a signal) with the request sent: the engine may still be
                # creating it, and there is no id to remove yet; remove it by name.
                self._remove_late(str(kwargs["name"]))
                raise
            if cancel is not None and cancel.is_set():
                raise SandboxError(f"{spec.role} container not started: the run is stopping")
            copy = _CopyOut(spec, seed_links, api.attach(
                cid, stdout=True, stderr=True, stream=True, logs=False, demux=True))
            try:
                api.start(cid)
                copy.start()
                if seed is not None:
                    self._seed(cid, spec, seed)
                exec_id = api.exec_create(cid, **exec_kwargs(spec))["Id"]
                # no role process before the holder made itself non-dumpable
                if not self._wait_ready(copy, cid) or not copy.ready_ok:
                    raise SandboxError(f"the {spec.role} container's holder did not protect "
                                       f"its output stream within {READY_TIMEOUT_S:.0f} s"
                                       + _holder_said(copy.errs.text()))
                stream = api.exec_start(exec_id, stream=True, demux=True)
            except (SandboxError, docker.errors.APIError) as exc:
                # The container stopped under us (docker kill right after start): a run
                # that ended, named, rather than an engine failure that ends the cycle.
                dead = self._stopped(cid, within_s=2.0)  # a kill may still be landing
                if dead is not None and killed_from_outside(dead, ours=False):
                    raise _DiedEarly(dead) from None
                if isinstance(exc, SandboxError):
                    raise
                raise SandboxError(f"engine could not start the {spec.role} command: "
                                   f"{exc.explanation or exc}") from None

            def stop_role(flag: threading.Event | None) -> None:
                # Never block the pump thread on the engine. SIGUSR1 makes the holder
                # kill every role process and copy the output out; repeated until it
                # says so, since a signal that arrives before the holder has set up its
                # signal mask (its first few ms) is dropped.
                if flag is not None:
                    flag.set()
                if stopping.is_set():
                    return
                stopping.set()

                def _stop() -> None:
                    for _ in range(int(STOP_GRACE_S / 0.05)):
                        with contextlib.suppress(docker.errors.APIError,
                                                 requests.exceptions.RequestException):
                            api.kill(cid, signal="SIGUSR1")
                        if copy.announced.wait(0.05) or copy.done.is_set():
                            return

                threading.Thread(target=_stop, daemon=True).start()

            def pump() -> None:
                cap = spec.stdout_cap_bytes
                try:
                    for o, e in stream:
                        live = on_output is not None and not stream_exceeded.is_set()
                        if o:
                            out.add(o)
                            if live:
                                on_output("stdout", o)  # type: ignore[misc]
                        if e:
                            err.add(e)
                            if live:
                                on_output("stderr", e)  # type: ignore[misc]
                        if out.total + err.total > cap and not stream_exceeded.is_set():
                            stop_role(stream_exceeded)
                except (requests.exceptions.RequestException, OSError, ValueError):
                    pass  # stream closed under us (kill/remove); counts stand as read

            pumper = threading.Thread(target=pump, daemon=True)
            pumper.start()
            exec_info = self._wait_exec(exec_id, pumper, deadline)
            running = exec_state(exec_info)[1]
            # a command ended by SIGKILL (or dropped): was the whole container killed?
            killed = exec_state(exec_info)[0] in (None, 137)
            dead = None if running else self._stopped(cid, within_s=1.0 if killed else 0.0)
            if running:
                timed_out = True
            stop_role(None)  # also stops what the command left running in the background
            if running:
                exec_info = self._wait_exec(exec_id, pumper, time.monotonic() + STOP_GRACE_S)
            copy.done.wait(STOP_GRACE_S + FINISH_BASE_S
                           + spec.output_cap_bytes / FINISH_BYTES_PER_S)
            if not copy.done.is_set():
                ours_killed = True
                with contextlib.suppress(docker.errors.APIError):
                    api.kill(cid)
                copy.done.wait(10)
            # a container killed under us may leave the exec's stream open until it is
            # removed: nothing more will come, so do not wait the full grace for it
            pumper.join(timeout=0.5 if dead is not None else STOP_GRACE_S)
            fin = copy.result(holder_gone=dead is not None
                              and killed_from_outside(dead, ours=ours_killed) is not None)
            state = api.inspect_container(cid)
            image_id = str(state.get("Image", spec.image))
        except _DiedEarly as died:
            state = died.state
            image_id = str(state.get("Image", spec.image))
        finally:
            confirmed = self._remove(cid) if cid else True
        flags = flags_from_inspect(state, exec_info, oom_kills=fin.oom_kills,
                                   timed_out=timed_out, stream_exceeded=stream_exceeded.is_set(),
                                   output_dir_exceeded=fin.limit, output_invalid=fin.invalid,
                                   output_detail=fin.detail, cleanup_confirmed=confirmed)
        reason, detail = classify_stop(flags)
        exit_code = flags.exit_code
        outside = killed_from_outside(state, ours=ours_killed)
        if outside is not None and reason is StopReason.PROCESS_FAILED:
            detail = outside if exec_info is None else f"{outside}; the command: {detail}"
            exit_code = int(state["State"]["ExitCode"])  # what ended it: the outside kill
        return RunRecord(
            run_id=spec.run_id, role=spec.role, image_id=image_id,
            container_name=str(kwargs["name"]), exit_code=exit_code, stop_reason=reason,
            detail=detail, wall_s=round(time.monotonic() - started, 3),
            stdout_bytes=out.total, stderr_bytes=err.total,
            stdout_tail=out.text(), stderr_tail=err.text(), cleanup_confirmed=confirmed,
            labels=dict(kwargs["labels"]), egress_refused=fin.egress,
            egress_refused_count=fin.egress_count,
        )

    def _wait_exec(self, exec_id: str, pumper: threading.Thread,
                   deadline: float) -> dict[str, Any] | None:
        """An exec's inspect JSON, polled until it ends or ``deadline`` (see
        :func:`exec_state`); None when the engine no longer knows it.

        The output stream usually ends with the process, so the poll waits on it first;
        a process that closed its stdio is still caught by the exec record."""
        step = 0.01
        while True:
            try:
                info: dict[str, Any] = self.client.api.exec_inspect(exec_id)
            except docker.errors.NotFound:
                # The engine drops an exec with its container (the holder exited after a
                # stop): the command is gone and its code unknown.
                return None
            now = time.monotonic()
            if not exec_state(info)[1] or now >= deadline:
                return info
            wait = min(step, deadline - now)
            if pumper.is_alive():
                pumper.join(timeout=wait)
            else:
                time.sleep(wait)
            step = min(step * 2, 0.25)

    def _wait_ready(self, copy: _CopyOut, cid: str) -> bool:
        """Wait for the holder's readiness marker (:data:`READY_TIMEOUT_S`); False at once
        when the container stopped meanwhile (its attach stream may stay open)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not copy.ready.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or self._stopped(cid) is not None:
                return False
        return True

    def _stopped(self, cid: str, within_s: float = 0.0) -> dict[str, Any] | None:
        """The container's inspect JSON once it is no longer running (polled for up to
        ``within_s``); None while it runs or when the engine cannot say."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                info: dict[str, Any] = self.client.api.inspect_container(cid)
            except (docker.errors.APIError, requests.exceptions.RequestException):
                return None
            state = info.get("State")
            if isinstance(state, Mapping) and not state.get("Running"):
                return info
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def _seed(self, cid: str, spec: RunSpec, data: bytes) -> None:
        """Copy the host output directory's content into the output tmpfs (exec, stdin)."""
        api = self.client.api
        eid = api.exec_create(cid, holder_argv("seed", spec.output_target), user=spec.user,
                              stdin=True, stdout=True, stderr=True, workdir="/")["Id"]
        sock = api.exec_start(eid, socket=True)
        raw = getattr(sock, "_sock", sock)
        try:
            raw.sendall(data)
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_WR)
            seen = 0
            while seen < SEED_REPLY_CAP and raw.recv(65536):
                seen += 1
        finally:
            raw.close()
        code, running = exec_state(self._wait_exec(eid, threading.Thread(),
                                                   time.monotonic() + 30))
        if running or code != 0:
            raise SandboxError(f"could not seed the {spec.role} output directory "
                               f"(exit {code})")

    def _remove_late(self, name: str, within_s: float = 3.0) -> None:
        """Remove a container whose create request may still be in flight at the engine."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                self.client.api.remove_container(name, force=True, v=True)
            except docker.errors.NotFound:
                time.sleep(0.2)
                continue
            except (docker.errors.APIError, requests.exceptions.RequestException):
                pass
            return

    def _remove(self, cid: str) -> bool:
        """Force-remove and confirm the engine no longer knows the container."""
        api = self.client.api
        for attempt in range(5):
            try:
                api.remove_container(cid, force=True, v=True)
            except docker.errors.NotFound:
                return True
            except docker.errors.APIError:
                time.sleep(0.2 * (attempt + 1))  # "removal already in progress"
            try:
                api.inspect_container(cid)
            except docker.errors.NotFound:
                return True
        return False

    # -- cleanup ---------------------------------------------------------------
    def managed_containers(self) -> list[tuple[str, str, dict[str, str]]]:
        """(id, name, labels) of every container carrying the cyclebox label."""
        rows = self.client.api.containers(all=True, filters={"label": f"{MANAGED_LABEL}=1"})
        return [(r["Id"], (r.get("Names") or ["?"])[0].lstrip("/"), dict(r.get("Labels") or {}))
                for r in rows]

    def remove(self, cid: str) -> bool:
        return self._remove(cid)

    def leftovers(self, run_id: str) -> list[str]:
        """Remove every container still labelled with ``run_id``; return their names."""
        return [name for cid, name, labels in self.managed_containers()
                if labels.get(f"{LABEL_PREFIX}.run_id") == run_id
                and self.remove(cid)]

    def sweep(self, *, only_orphans: bool = True, dry_run: bool = False) -> list[SweepResult]:
        """Labelled containers (see :func:`runner.isolation.gc.sweep_containers`), then the
        input staging copies of controllers that are gone."""
        from runner.isolation.gc import sweep_containers, sweep_staging_dirs

        return [*sweep_containers(self, only_orphans=only_orphans, dry_run=dry_run),
                *sweep_staging_dirs(staging_base(), owner_name=STAGING_OWNER,
                                    prefix=STAGING_PREFIX, dry_run=dry_run,
                                    remove_base=bool(os.environ.get(STAGING_ENV))),
                *sweep_staging_dirs(legacy_staging_base(), owner_name=STAGING_OWNER,
                                    dry_run=dry_run)]

    # -- images ----------------------------------------------------------------
    def image_id(self, ref: str) -> str | None:
        try:
            return str(self.client.api.inspect_image(ref)["Id"])
        except docker.errors.ImageNotFound:
            return None

    def image_size(self, ref: str) -> int:
        return int(self.client.api.inspect_image(ref)["Size"])

    def save_image(self, image_id: str, chunk_bytes: int) -> Iterator[bytes]:
        """``docker save`` of one image by its id (the tar names no tag), streamed in
        pieces of at most ``chunk_bytes``; SandboxError when the engine refuses."""
        try:
            yield from self.client.api.get_image(image_id, chunk_size=chunk_bytes)
        except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
            raise SandboxError(f"docker save {image_id} failed: {exc}") from None

    def load_image(self, archive: Path) -> None:
        """``docker load`` of a saved tar, streamed from the file (never read whole)."""
        try:
            with archive.open("rb") as f:
                for msg in self.client.api.load_image(f):
                    if isinstance(msg, dict) and msg.get("error"):
                        raise SandboxError(f"docker load failed: {str(msg['error'])[:500]}")
        except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
            raise SandboxError(f"docker load failed: {exc}") from None

    def tag_image(self, image_id: str, ref: str) -> None:
        """Give ``image_id`` the name ``ref`` (``repo[:tag]``; a digest name is refused)."""
        repo, tag = docker.utils.parse_repository_tag(ref)
        if tag is not None and tag.startswith("sha256:"):
            raise SandboxError(f"{ref} names a digest; an image cannot be tagged with it")
        try:
            self.client.api.tag(image_id, repo, tag or "latest")
        except docker.errors.APIError as exc:
            raise SandboxError(f"docker tag {image_id} {ref} failed: {exc}") from None

    def images_with_label(self, label: str) -> list[dict[str, Any]]:
        return list(self.client.api.images(filters={"label": label}))

    def build(self, context: Path, tag: str, *, buildargs: dict[str, str],
              labels: dict[str, str], nocache: bool = False) -> Iterator[str]:
        """Build ``context/Dockerfile`` with no network; yield log lines; raise on error."""
        try:
            for chunk in self.client.api.build(
                path=str(context), tag=tag, buildargs=buildargs, labels=labels,
                network_mode="none", rm=True, forcerm=True, pull=False, decode=True,
                nocache=nocache,
            ):
                if "error" in chunk:
                    raise SandboxError(f"image build for {tag} failed: {chunk['error'].strip()}")
                line = chunk.get("stream")
                if line and line.strip():
                    yield line.rstrip()
        except docker.errors.APIError as exc:
            raise SandboxError(f"image build for {tag} failed: {exc.explanation or exc}") from None
