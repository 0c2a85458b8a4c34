"""PID 1 of every role container, and the in-container half of the output copy-out.

Stdlib only, and never imported from the image: the host reads this file and runs it
with ``python3 -I -c <source> MODE`` so that neither the image's ``sandbox`` package
nor anything the role wrote can change it (``-I``: no environment, no cwd on
``sys.path``).

Why a holder (the design, see also :mod:`runner.copyout`): a role's output directory
is a size- and inode-capped tmpfs *inside* the container, so the kernel, not a host
poll, stops a writer at the cap (``ENOSPC``). A tmpfs dies with its container, and
the engine's archive API does not see tmpfs mounts at all on the engines we support
(Docker 20.10 reads the container's root filesystem on the host, below the tmpfs), so
the output must be read out from inside while the container still runs. PID 1 is
therefore this holder, the role command runs through ``exec`` (its exit code comes
from the engine's exec record, which the role cannot forge), and afterwards the host
runs ``finish``, which kills every role process, reports the kernel's OOM counter and
the tmpfs usage, and writes the output directory as a tar stream to stdout for the
host's hostile-input extractor.

Modes:

``hold``
    Block every catchable signal, reap orphans on ``SIGCHLD`` and, on ``SIGUSR1``
    (sent by the host through the engine), kill every other process in the
    container. As PID 1 of the namespace it cannot be killed from inside.
``finish DIR|-``
    ``kill(-1, SIGKILL)`` until no other process is left, then write a JSON status
    line to stderr (OOM kills, tmpfs blocks/inodes used and free), unless ``-`` a PAX
    tar of ``DIR`` to stdout, and a last status line with the walk's errors. The walk
    is relative to directory fds, so no path length limit applies; symlinks, hard
    links and FIFOs are written as such so the host can name its refusal; sockets
    and devices are reported as errors.
``seed DIR``
    Extract the host-made tar on stdin into ``DIR`` (used only for stages whose
    output directory starts with host content, e.g. the apply stage's repository,
    whose checkout may hold symlinks; only those exact symlinks may come back).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import sys
import tarfile
import time

_BLOCK = {s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)}
MAX_ERRORS = 8


def hold() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCK)
    while True:
        sig = signal.sigwait({signal.SIGCHLD, signal.SIGUSR1})
        if sig == signal.SIGUSR1:
            _kill_others()
        _reap()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_others() -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(-1, signal.SIGKILL)


def _others() -> list[int]:
    me = os.getpid()
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, me):
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in (b"Z", b"X"):
                pids.append(int(name))
    return pids


def _oom_kills() -> int | None:
    for path, key in (("/sys/fs/cgroup/memory.events", "oom_kill"),
                      ("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill")):
        try:
            with open(path) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == key:
                        return int(v)
        except (OSError, ValueError):
            continue
    return None


def finish(root: str) -> int:
    deadline = time.monotonic() + 5
    while True:
        _kill_others()
        left = _others()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    status: dict[str, object] = {"phase": "pre", "others_left": len(left),
                                 "oom_kill": _oom_kills()}
    errors: list[str] = []
    if root != "-":
        try:
            st = os.statvfs(root)
            status["df"] = {"bsize": st.f_frsize, "blocks": st.f_blocks, "bfree": st.f_bfree,
                            "files": st.f_files, "ffree": st.f_ffree}
        except OSError as exc:
            errors.append(f"statvfs: {exc.strerror}")
    # before the tar: the host may stop reading the tar early, never this line
    sys.stderr.write(json.dumps(status) + "\n")
    sys.stderr.flush()
    if root != "-":
        out = os.fdopen(1, "wb", buffering=1 << 16, closefd=False)
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tf:
            try:
                fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError as exc:
                errors.append(f"open {root}: {exc.strerror}")
            else:
                _add_dir(tf, fd, "", errors)
        out.flush()
    sys.stderr.write(json.dumps({"phase": "post", "errors": errors}) + "\n")
    sys.stderr.flush()
    return 3 if errors or left else 0


def _info(name: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = stat.S_IMODE(st.st_mode)
    ti.mtime = int(st.st_mtime)
    return ti


def _add_dir(tf: tarfile.TarFile, dfd: int, prefix: str, errors: list[str]) -> None:
    # Iterative over an explicit stack of directory fds: no recursion limit, no PATH_MAX.
    stack: list[tuple[int, str, list[str]]] = [(dfd, prefix, sorted(os.listdir(dfd)))]
    while stack:
        fd, pre, names = stack[-1]
        if not names:
            os.close(fd)
            stack.pop()
            continue
        name = names.pop(0)
        rel = pre + name
        try:
            st = os.lstat(name, dir_fd=fd)
        except OSError as exc:
            _err(errors, f"{rel}: {exc.strerror}")
            continue
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            tf.addfile(_info(rel + "/", st, tarfile.DIRTYPE))
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                stack.append((sub, rel + "/", sorted(os.listdir(sub))))
            except OSError as exc:
                _err(errors, f"{rel}: {exc.strerror}")
        elif stat.S_ISREG(mode) and st.st_nlink > 1:
            ti = _info(rel, st, tarfile.LNKTYPE)
            ti.linkname = "(hard link)"
            tf.addfile(ti)
        elif stat.S_ISREG(mode):
            ti = _info(rel, st, tarfile.REGTYPE)
            ti.size = st.st_size
            try:
                ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
            except OSError as exc:
                _err(errors, f"{rel}: {exc.strerror}")
                continue
            with os.fdopen(ffd, "rb") as f:
                tf.addfile(ti, f)
        elif stat.S_ISLNK(mode):
            ti = _info(rel, st, tarfile.SYMTYPE)
            try:
                ti.linkname = os.readlink(name, dir_fd=fd)
            except OSError:
                ti.linkname = "(unreadable)"
            tf.addfile(ti)
        elif stat.S_ISFIFO(mode):
            tf.addfile(_info(rel, st, tarfile.FIFOTYPE))
        else:
            _err(errors, f"{rel}: not a regular file, directory, link or fifo")


def _err(errors: list[str], msg: str) -> None:
    if len(errors) < MAX_ERRORS:
        errors.append(msg)


def seed(root: str) -> int:
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tf:
        for m in tf:
            ok = m.isreg() or m.isdir() or m.issym()
            if not ok or m.name.startswith("/") or ".." in m.name.split("/"):
                sys.stderr.write(f"seed: refused {m.name!r}\n")
                return 3
            tf.extract(m, root, set_attrs=False)
            if m.issym():
                continue
            keep_x = m.isdir() or m.mode & 0o100
            os.chmod(os.path.join(root, m.name), 0o700 if keep_x else 0o600)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["hold"]:
        hold()
    if argv[:1] == ["finish"] and len(argv) == 2:
        return finish(argv[1])
    if argv[:1] == ["seed"] and len(argv) == 2:
        return seed(argv[1])
    sys.stderr.write("usage: hold | finish DIR|- | seed DIR\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
