"""PID 1 of every role container, and the in-container half of the output copy-out.

Stdlib only, and never imported from the image: the host reads this file and runs it
with ``python3 -I -S -c <source> MODE`` so that neither the image's ``sandbox``
package nor anything the role wrote can change it (``-I``: no environment, no cwd on
``sys.path``; ``-S``: no site-packages, and ~100 ms less start-up per exec).

Why a holder (the design, see also :mod:`runner.isolation.copyout`): a role's output directory
is a size- and inode-capped tmpfs *inside* the container, so the kernel, not a host
poll, stops a writer at the cap (``ENOSPC``). A tmpfs dies with its container, and
the engine's archive API does not see tmpfs mounts at all on the engines we support
(Docker 20.10 reads the container's root filesystem on the host, below the tmpfs), so
the output must be read out from inside while the container still runs. PID 1 is
therefore this holder and the role command runs through ``exec``: its exit code comes
from the engine's exec record, which the role cannot forge. When the host sends
``SIGUSR1`` (the command ended, or a limit was hit), the holder kills every role
process, then writes its status and the output tar to *its own* stdout/stderr, which
the host attached to before start, and exits. It makes itself non-dumpable first, so
a role process (same uid) cannot reach those pipes through ``/proc/1/fd`` nor ptrace
it, and as PID 1 of the namespace it cannot be killed from inside. Doing the copy-out
here rather than in a second exec saves an exec (~150 ms) per container.

Modes:

``hold DIR|-``
    Block every catchable signal, make itself non-dumpable, write :data:`READY` to
    stdout (the host waits for it before it starts the role command), reap orphans on
    ``SIGCHLD``; on ``SIGUSR1`` run ``finish DIR`` on its own stdout/stderr and exit.
``finish DIR|-``
    ``kill(-1, SIGKILL)`` until no other process is left, then write a JSON status
    line to stderr (OOM kills, tmpfs blocks/inodes used and free, dumpable flag),
    unless ``-`` a PAX tar of ``DIR`` to stdout, and a last status line with the
    walk's errors. The walk is relative to directory fds, so no path length limit
    applies; symlinks, hard links and FIFOs are written as such so the host can name
    its refusal; sockets and devices are reported as errors.
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
import time
from typing import BinaryIO

_BLOCK = {s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)}
MAX_ERRORS = 8
READY = b"cyclebox-holder-ready\n"
"""First bytes on the holder's stdout, written once it is non-dumpable: the host starts
the role command only after reading them (a role process started earlier could open
``/proc/1/fd/1`` before the ``prctl`` and keep it). The tar follows."""


def hold(root: str) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCK)
    dumpable = _undumpable()
    os.write(1, READY)
    while True:
        sig = signal.sigwait({signal.SIGCHLD, signal.SIGUSR1})
        if sig == signal.SIGUSR1:
            sys.stdout.flush()
            os._exit(finish(root, dumpable=dumpable))
        _reap()


def _undumpable() -> int:
    """Make this process non-dumpable, so that a role process (same uid) can neither
    open ``/proc/1/fd/1`` to write into the stream the host reads, nor ptrace it.
    Returns the dumpable flag afterwards (0 when protected), reported to the host."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
        return int(libc.prctl(3, 0, 0, 0, 0))  # PR_GET_DUMPABLE
    except (OSError, AttributeError, ImportError):
        return -1


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


def finish(root: str, *, dumpable: int | None = None) -> int:
    deadline = time.monotonic() + 5
    while True:
        _kill_others()
        left = _others()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    status: dict[str, object] = {"phase": "pre", "others_left": len(left),
                                 "oom_kill": _oom_kills(), "dumpable": dumpable}
    errors: list[str] = []
    budget = _Budget(None)
    if root != "-":
        try:
            st = os.statvfs(root)
            status["df"] = {"bsize": st.f_frsize, "blocks": st.f_blocks, "bfree": st.f_bfree,
                            "files": st.f_files, "ffree": st.f_ffree}
            if st.f_blocks > 0:
                budget = _Budget(st.f_blocks * st.f_frsize)
        except OSError as exc:
            errors.append(f"statvfs: {exc.strerror}")
    # before the tar: the host may stop reading the tar early, never this line
    sys.stderr.write(json.dumps(status) + "\n")
    sys.stderr.flush()
    if root != "-":
        out = os.fdopen(1, "wb", buffering=1 << 16, closefd=False)
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            errors.append(f"open {root}: {exc.strerror}")
        else:
            _add_dir(out, fd, b"", errors, budget)
        out.write(bytes(2 * BLOCK))
        out.flush()
    post: dict[str, object] = {"phase": "post", "errors": errors}
    if budget.over:
        post["limit"] = budget.over
    sys.stderr.write(json.dumps(post) + "\n")
    sys.stderr.flush()
    return 3 if errors or left else 0


# A minimal PAX tar writer (tarfile costs ~60 ms of imports in every copy-out).
BLOCK = 512
MAX_OCTAL_SIZE = 8**11 - 1
"""The largest size an 11-digit octal header field holds; above it a PAX record."""


class _Budget:
    """File bytes still allowed in the stream: the output tmpfs's size. A file whose
    ``st_size`` passes it can only be sparse (the kernel capped the real blocks); its
    holes are never streamed, the file is left out and the host told (``limit``)."""

    def __init__(self, cap: int | None) -> None:
        self.left = cap
        self.over = ""

    def take(self, size: int, shown: str) -> bool:
        if self.left is None:
            return True
        if size > self.left:
            if not self.over:
                self.over = (f"{shown!r}: {size} bytes (sparse) pass the output directory's "
                             f"size; left out")
            return False
        self.left -= size
        return True


def _pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


def _block(name: bytes, kind: bytes, size: int, mode: int, mtime: int,
           link: bytes = b"") -> bytes:
    h = bytearray(BLOCK)
    h[0:len(name[:100])] = name[:100]
    h[100:108] = b"%07o\0" % (mode & 0o7777)
    h[108:116] = b"%07o\0" % 0
    h[116:124] = b"%07o\0" % 0
    # a bigger size would widen the field and shift the header: a PAX record has it
    h[124:136] = b"%011o\0" % (size if size <= MAX_OCTAL_SIZE else 0)
    h[136:148] = b"%011o\0" % max(0, min(mtime, 0o77777777777))
    h[148:156] = b" " * 8
    h[156:157] = kind
    h[157:157 + len(link[:100])] = link[:100]
    h[257:265] = b"ustar\x0000"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _header(name: bytes, kind: bytes, size: int, st: os.stat_result,
            link: bytes = b"") -> bytes:
    mtime = int(st.st_mtime)
    recs = b""
    if len(name) > 100:
        recs += _pax_record(b"path", name)
    if len(link) > 100:
        recs += _pax_record(b"linkpath", link)
    if size > MAX_OCTAL_SIZE:
        recs += _pax_record(b"size", b"%d" % size)
    pax = b""
    if recs:
        pax = (_block(b"././@PaxHeader", b"x", len(recs), 0o644, mtime) + recs
               + bytes(-len(recs) % BLOCK))
    return pax + _block(name, kind, size, stat.S_IMODE(st.st_mode), mtime, link)


def _add_dir(out: BinaryIO, dfd: int, prefix: bytes, errors: list[str],
             budget: _Budget) -> None:
    # Iterative over an explicit stack of directory fds: no recursion limit, no PATH_MAX.
    stack: list[tuple[int, bytes, list[bytes]]] = [(dfd, prefix, sorted(_names(dfd)))]
    while stack:
        fd, pre, names = stack[-1]
        if not names:
            os.close(fd)
            stack.pop()
            continue
        name = names.pop(0)
        rel = pre + name
        shown = rel.decode("utf-8", "replace")
        try:
            st = os.lstat(name, dir_fd=fd)
        except OSError as exc:
            _err(errors, f"{shown}: {exc.strerror}")
            continue
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            out.write(_header(rel + b"/", b"5", 0, st))
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                stack.append((sub, rel + b"/", sorted(_names(sub))))
            except OSError as exc:
                _err(errors, f"{shown}: {exc.strerror}")
        elif stat.S_ISREG(mode) and st.st_nlink > 1:
            out.write(_header(rel, b"1", 0, st, b"(hard link)"))
        elif stat.S_ISREG(mode):
            _add_file(out, fd, name, rel, st, errors, budget)
        elif stat.S_ISLNK(mode):
            try:
                link = os.readlink(name, dir_fd=fd)
            except OSError:
                link = b"(unreadable)"
            out.write(_header(rel, b"2", 0, st, link))
        elif stat.S_ISFIFO(mode):
            out.write(_header(rel, b"6", 0, st))
        else:
            _err(errors, f"{shown}: not a regular file, directory, link or fifo")


def _names(fd: int) -> list[bytes]:
    return [os.fsencode(n) for n in os.listdir(fd)]


def _add_file(out: BinaryIO, dfd: int, name: bytes, rel: bytes,
              st: os.stat_result, errors: list[str], budget: _Budget) -> None:
    if not budget.take(st.st_size, rel.decode("utf-8", "replace")):
        return
    try:
        ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError as exc:
        _err(errors, f"{rel.decode('utf-8', 'replace')}: {exc.strerror}")
        return
    size = st.st_size
    out.write(_header(rel, b"0", size, st))
    left = size
    try:
        while left:
            chunk = os.read(ffd, min(left, 1 << 16))
            if not chunk:
                _err(errors, f"{rel.decode('utf-8', 'replace')}: shrank while read")
                out.write(bytes(left))
                break
            out.write(chunk)
            left -= len(chunk)
    finally:
        os.close(ffd)
    out.write(bytes(-size % BLOCK))


def _err(errors: list[str], msg: str) -> None:
    if len(errors) < MAX_ERRORS:
        errors.append(msg)


def seed(root: str) -> int:
    import tarfile  # only here: seeding is rare, and the input is the host's own tar

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
    if argv[:1] == ["hold"] and len(argv) == 2:
        hold(argv[1])
    if argv[:1] == ["finish"] and len(argv) == 2:
        return finish(argv[1])
    if argv[:1] == ["seed"] and len(argv) == 2:
        return seed(argv[1])
    sys.stderr.write("usage: hold DIR|- | finish DIR|- | seed DIR\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
