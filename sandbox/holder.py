"""PID 1 of every role container, and the in-container half of the output copy-out.

Stdlib only, and never imported from the image: the host writes this file and its own
compile of it into a directory mounted read-only in each container and runs it with
``python3 -I -S -c <boot> MODE`` so that neither the image's ``sandbox`` package nor
anything the role wrote can change it (``-I``: no environment, no cwd on ``sys.path``;
``-S``: no site-packages, and ~100 ms less start-up per exec; see
:data:`runner.isolation.docker.hardening.HOLDER_BOOT`). Its start is on the path of
every container that is not prepared ahead, so it imports little before READY: no
``typing``, ``json``, ``re``, ``contextlib``, ``enum`` (``_signal``, not ``signal``),
nor OpenSSL (:class:`Seal`).

Why a holder (the design, see also :mod:`runner.isolation.copyout`): a role's output directory
is a size- and inode-capped tmpfs *inside* the container, so the kernel, not a host
poll, stops a writer at the cap (``ENOSPC``). A tmpfs dies with its container, and
the engine's archive API does not see tmpfs mounts at all on the engines we support
(Docker 20.10 reads the container's root filesystem on the host, below the tmpfs), so
the output must be read out from inside while the container still runs.

PID 1 is therefore this holder, and it starts the role command itself, as its child,
when the host hands it the case (a frame on its stdin, attached before start; see "the
case channel" below): the child inherits the container's user, seccomp filter (under
gVisor too, which applies the OCI profile to the first process only),
no-new-privileges, limits, environment and working directory, with ``/dev/null`` as
stdin and a pipe of the holder's as stdout and stderr. The holder frames every chunk
read from those pipes onto its own stdout and, when the child ended, its wait status:
the role never holds the holder's stdio, so whatever it writes arrives as the payload
of an output frame, and its exit code is the holder's ``waitpid``, never anything it
printed. The holder makes itself non-dumpable first, so a role process (same uid)
cannot reach those pipes through ``/proc/1/fd`` nor ptrace it, and as PID 1 of the
namespace it cannot be killed from inside. When the command ends, or the host sends
``SIGUSR1`` (a limit was hit, a timeout), the holder kills every role process, then
writes the command's exit status, its status lines and the output tar, all as frames,
and exits: no ``docker exec`` for the command, none for the copy-out. Frames after the
hand-over are sealed (:class:`Seal`): gVisor's ``/proc`` lets a same-uid process open
``/proc/1/fd/1`` despite the non-dumpable flag, and what it writes there must not pass.

Modes:

``hold DIR|- [SOCKET]``
    Block every catchable signal, make itself non-dumpable, with ``SOCKET`` (the
    mounted gateway socket) start the loopback relay (below) and the deny-all egress
    proxy on :data:`EGRESS_PORT` (near the end), write :data:`READY` to
    stdout (the host hands over the case only after it), then serve the case channel:
    an optional seed tar (:data:`F_SEED`, extracted into ``DIR`` as ``seed`` does),
    the case (:data:`F_CASE`: the command is started as its child), the command's
    output and exit status; reap orphans on ``SIGCHLD``; when the command ended or on
    ``SIGUSR1`` run ``finish DIR`` (its status lines and tar as frames) and exit.
``finish DIR|-``
    ``kill(-1, SIGKILL)`` until no other process is left, then write a JSON status
    line to stderr (OOM kills, tmpfs blocks/inodes used and free, dumpable flag, the
    egress the proxy refused),
    unless ``-`` a PAX tar of ``DIR`` to stdout, and a last status line with the
    walk's errors. The walk is relative to directory fds, so no path length limit
    applies; symlinks, hard links and FIFOs are written as such so the host can name
    its refusal; sockets and devices are reported as errors.
``seed DIR``
    Extract the host-made tar on stdin into ``DIR`` (for stages whose output
    directory starts with host content, e.g. the apply stage's repository, whose
    checkout may hold symlinks; only those exact symlinks may come back). ``hold``
    does the same from an :data:`F_SEED` frame, so no exec is needed for it either.

The loopback relay (containers whose role may reach a model): TCP
``127.0.0.1:``:data:`RELAY_PORT` to the gateway socket, bytes copied unchanged both
ways (the gateway checks the token and applies this binding's limits). So that
nothing in the container can take its place or reach more through it:

- it listens before :data:`READY`, i.e. before any role process exists, without
  ``SO_REUSEADDR``/``SO_REUSEPORT``: the kernel refuses the port (and the wildcard
  address) to everyone else for the container's life; PID 1 cannot be killed from
  inside, is non-dumpable (no ptrace, no ``/proc/1/fd``), and the role has no
  capability to redirect loopback traffic;
- it reaches exactly one socket, the container's own binding: there is nothing more
  to reach, whoever listens;
- no thread: the holder's one loop polls the non-blocking sockets for at most
  :data:`SIGNAL_POLL_MS`, then takes pending signals (still all blocked), so
  ``SIGUSR1`` -> ``finish`` is reached within one round however busy or stuck the
  relay's connections are, and ``finish`` never waits on them (``os._exit`` ends all);
- at most :data:`RELAY_MAX_CONNECTIONS` connections (the gateway's default per binding;
  more wait in the kernel's backlog), :data:`RELAY_BUFFER` bytes per direction per
  connection; a flood or a half-open connection holds only those slots, and the
  gateway's own timeouts free them; it never writes to stdout/stderr (the host's
  status and tar channel).
"""

from __future__ import annotations

import os
import stat
import sys
import time

TYPE_CHECKING = False  # not typing's: it imports re (~10 ms of every container's start)
if TYPE_CHECKING:
    import signal
    from typing import IO, Any, Protocol
else:
    import _signal as signal  # the same functions and numbers; signal's enums import enum

_BLOCK = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}


class _suppress:  # contextlib.suppress's stand-in (contextlib: ~3 ms of imports)
    def __init__(self, *kinds: type[BaseException]) -> None:
        self.kinds = kinds

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, self.kinds)
MAX_ERRORS = 8
ERROR_CHARS = 200
"""An error's text is cut here (8 of them, escaped, stay well inside a status frame)."""
RELAY_HOST = "127.0.0.1"
RELAY_PORT = 40080
"""The in-container model endpoint's port, on the container's own loopback."""
RELAY_MAX_CONNECTIONS = 16
"""Relayed connections at once: the gateway's default ``max_connections`` per binding."""
RELAY_BUFFER = 64 * 1024
"""Bytes held per direction per connection (back-pressure beyond it)."""
RELAY_BACKLOG = 64
# A lingering close (what HTTP servers do): once the gateway stopped reading a request
# (it answered from the head) or ended the connection, the rest of what the client sends
# is read and discarded, so a client that writes its whole body before it reads (httpx
# does) gets to the answer, and closing never resets a connection whose answer is still
# in the kernel. Bounded: at most LINGER_BYTES discarded per connection, and at most
# LINGER_S after the gateway's side ended before the client's is closed.
LINGER_BYTES = 16 << 20
LINGER_S = 2.0
EGRESS_PORT = 40081
"""The deny-all HTTP proxy's port: HTTP(S)_PROXY of a bound container points here."""
EGRESS_MAX_HOSTS = 16
"""Distinct refused targets named in the status; more are only counted."""
EGRESS_HOST_CHARS = 120
EGRESS_HEAD_BYTES = 4096
"""A request line not complete within these bytes is refused as ``?``."""
SIGNAL_POLL_MS = 25
"""With a relay, the longest the holder waits on sockets before it looks for signals."""
READY = b"cyclebox-holder-ready\n"
"""First bytes on the holder's stdout, written once it is non-dumpable: the host hands
over the case only after reading them (a role process started earlier could open
``/proc/1/fd/1`` before the ``prctl`` and keep it). Frames follow (the case channel)."""


def hold(root: str, gateway_socket: str | None = None) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCK)
    dumpable = _undumpable()
    relay: _Relay | None = None
    egress: _Egress | None = None
    if gateway_socket is not None:
        try:
            relay = relay_open(gateway_socket)
            egress = egress_open()
        except OSError as exc:
            # no READY: the host starts no role command and names this line
            sys.stderr.write(f"relay: cannot listen on {RELAY_HOST}:{RELAY_PORT}/"
                             f"{EGRESS_PORT}: {exc.strerror or exc}\n")
            sys.stderr.flush()
            os._exit(3)
    os.write(1, READY)
    case = _Case(root)
    if relay is not None:
        case.also_poll(relay.poller)
    waited = {signal.SIGCHLD, signal.SIGUSR1}
    while not case.ended and not case.stopped():
        case.tick()
        # One thread for everything: a round of IO (relay and the case channel, at most
        # SIGNAL_POLL_MS of waiting), then any pending signal, so SIGUSR1 is acted on
        # within one round however busy the relay is, and finish never waits on it.
        if relay is not None and not relay.broken:
            relay.step(SIGNAL_POLL_MS)
            if egress is not None:
                egress.step()
            closing = case.step(0)
        else:
            closing = case.step(SIGNAL_POLL_MS)
        # the command's pipes just closed (it is likely exiting) or nothing is left to
        # poll: wait for its SIGCHLD itself rather than one more poll round
        wait_s = SIGNAL_POLL_MS / 1000 if case.idle() and relay is None else (
            0.01 if closing else 0)
        info = signal.sigtimedwait(waited, wait_s)
        if info is None:
            continue
        if info.si_signo == signal.SIGUSR1:
            # a role process's kill(1, SIGUSR1) ends nothing; the host's ends the case
            # once its stop frame is read too (F_STOP), before or after it
            case.signalled = case.signalled or from_outside(info.si_pid, info.si_code)
            if case.stopped():
                break
            continue
        case.reap()
    sys.stdout.flush()
    # the host gone, nobody reads a tar: the role processes are killed all the same
    os._exit(finish("-" if case.host_gone else root, dumpable=dumpable, case=case,
                    egress=egress))


SI_USER = 0


def from_outside(si_pid: int, si_code: int) -> bool:
    """A signal sent from outside the container's PID namespace (the host's ``docker
    kill``, under runc and runsc alike): no sender pid in this namespace, and
    ``kill()``'s code. A role process's ``kill``/``tgkill`` names its own pid,
    ``rt_sigqueueinfo`` (which could claim pid 0) cannot claim ``SI_USER`` for another
    process, nor can an ``F_SETSIG`` I/O signal (``POLL_*`` codes). Only such a signal
    ends a case: a warm import's ``SIGUSR1`` to PID 1 once ended its own case before the
    hand-over (the interpreter killed, its exit status recorded as the case's)."""
    return si_pid == 0 and si_code == SI_USER


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
    if os.getpid() != 1:
        # only as PID 1 of its own namespace is "everyone else" the role's processes;
        # anywhere else (a test on the host) kill(-1) would reach the host's own
        return
    with _suppress(ProcessLookupError, PermissionError):
        os.kill(-1, signal.SIGKILL)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _stat_fields(path: str) -> list[bytes]:
    """The fields of a ``/proc`` stat file after the command name (the state first); empty
    when the process or thread is gone."""
    data = _read(path)
    return data.rsplit(b")", 1)[1].split() if data and b")" in data else []


def _other_pids() -> list[str]:
    """Every process but this one and PID 1, as its ``/proc`` name."""
    me = os.getpid()
    return [n for n in os.listdir("/proc") if n.isdigit() and int(n) not in (1, me)]


def _tasks(pid: str) -> list[str]:
    """Its threads' ids; none when ``/proc`` lists none (gone, or gVisor's process whose
    leader thread exited)."""
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def _other_states() -> list[tuple[int, bytes]]:
    """(pid, state letter) of every process but this one and PID 1."""
    return [(int(pid), fields[0]) for pid in _other_pids()
            if (fields := _stat_fields(f"/proc/{pid}/stat"))]


def _others() -> list[int]:
    return [pid for pid, state in _other_states() if state not in (b"Z", b"X")]


def _running_others() -> list[str]:
    """Every thread of every other process that is running or may run ("pid/tid
    (state)"): not stopped (``T``, ``t``), gone (``Z``, ``X``) or in uninterruptible sleep
    (``D``, no CPU). Threads, not processes: a process whose leader thread exited shows
    ``Z`` while its other threads run."""
    found = []
    for pid in _other_pids():
        for tid in _tasks(pid):
            fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            if fields and fields[0] not in (b"T", b"t", b"Z", b"X", b"D"):
                found.append(f"{pid}/{tid} ({fields[0].decode(errors='replace')})")
    return found


def _switches(status: bytes) -> int | None:
    """Voluntary plus involuntary context switches of a ``/proc`` status file, if shown."""
    counts = [int(line.split()[1]) for line in status.splitlines()
              if line.startswith((b"voluntary_ctxt_switches:", b"nonvoluntary_ctxt_switches:"))]
    return sum(counts) if len(counts) == 2 else None


def _activity() -> dict[str, int]:
    """A counter per role thread that grows only when it runs: its context switches
    (``/proc/PID/task/TID/status``, Linux), or where those are not shown (gVisor) its
    process's CPU clock ticks (``/proc/PID/stat``, every thread of it, exited ones too:
    under gVisor a process whose leader thread exited lists no task while another runs).
    A key that changes kind (its tasks no longer listed) is a new key: it ran."""
    found: dict[str, int] = {}
    for pid in _other_pids():
        counted = False
        for tid in _tasks(pid):
            n = _switches(_read(f"/proc/{pid}/task/{tid}/status") or b"")
            if n is not None:
                found[f"{pid}/{tid}"] = n
                counted = True
        if not counted:
            fields = _stat_fields(f"/proc/{pid}/stat")
            if len(fields) > 12 and fields[11].isdigit() and fields[12].isdigit():
                found[pid] = int(fields[11]) + int(fields[12])
    return found


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


def finish(root: str, *, dumpable: int | None = None, case: _Case | None = None,
           egress: _Egress | None = None) -> int:
    """Kill every other process, then the status lines (stderr) and the tar of ``root``;
    with ``case`` (``hold`` mode) first the command's last output and its exit status,
    and the tar as frames on the case channel; with ``egress`` the targets its proxy
    refused, in the first status line."""
    deadline = time.monotonic() + 5
    while True:
        _kill_others()
        left = _others() if os.getpid() == 1 else []
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if case is not None:
        case.close(all_gone=not left)
    status: dict[str, object] = {"phase": "pre", "others_left": len(left),
                                 "oom_kill": _oom_kills(), "dumpable": dumpable}
    if egress is not None:
        status["egress_refused"] = egress.hosts
        status["egress_refused_count"] = egress.count
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
    _status_line(status, framed=case is not None)
    if root != "-":
        out: _Writer = (_TarFrames() if case is not None
                        else os.fdopen(1, "wb", buffering=1 << 16, closefd=False))
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
    _status_line(post, framed=case is not None)
    return 3 if errors or left else 0


def _status_line(status: dict[str, object], *, framed: bool) -> None:
    line = _json(status) + "\n"
    if framed:  # a frame (sealed once there is a case), never stderr a role may reach
        _send(F_STATUS, line.encode())
    else:
        sys.stderr.write(line)
        sys.stderr.flush()


if TYPE_CHECKING:
    class _Writer(Protocol):
        def write(self, data: bytes, /) -> object: ...

        def flush(self) -> None: ...


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


def _add_dir(out: _Writer, dfd: int, prefix: bytes, errors: list[str],
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


def _add_file(out: _Writer, dfd: int, name: bytes, rel: bytes,
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
    """Keep the first MAX_ERRORS, each cut at ERROR_CHARS: a path has no length limit
    here, and the status line that carries them must stay a small frame."""
    if len(errors) < MAX_ERRORS:
        errors.append(msg if len(msg) <= ERROR_CHARS else msg[:ERROR_CHARS] + "...")


def seed(root: str, source: IO[bytes] | None = None) -> int:
    """Extract the host-made tar read from ``source`` (default: stdin) into ``root``."""
    import tarfile  # only here: seeding is rare, and the input is the host's own tar

    with tarfile.open(fileobj=source or sys.stdin.buffer, mode="r|") as tf:
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


# -- the case channel ------------------------------------------------------------------
# After READY, the holder's stdout carries only frames: a kind byte, the payload's length
# (4 bytes, big-endian), the payload, and from the hand-over on a tag (Seal). Everything
# the role command writes arrives wrapped in a frame by the holder, which alone holds the
# role's pipes, so no byte the role writes can be taken for a frame of another kind (an
# exit status, a tar). The host writes frames the same way on the holder's stdin
# (attached before start; the role's stdin is /dev/null); once it has the case the holder
# parses nothing more there, and only watches for its end: the host's process gone (the
# engine closes the stdin of a ``StdinOnce`` container when the attach ends), the holder
# ends the case as on ``SIGUSR1`` rather than let the command run on for nobody.

FRAME_HEADER = 5
FRAME_MAX = 1 << 20
"""The largest payload either side sends in one frame (bigger: a broken channel)."""
CHUNK = 1 << 16
# holder -> host
F_STDOUT, F_STDERR = b"o", b"e"
"""A chunk the role command wrote to its stdout / stderr."""
F_STARTED = b"s"
"""The command was exec'd (JSON ``{"pid": N}``) or could not be (``{"error": ...}``)."""
F_EXIT = b"x"
"""The command's wait status (JSON ``{"code": N}``, 128+signal when killed), once."""
F_SEEDED = b"k"
"""The seed tar was extracted (JSON ``{"ok": bool, "error": str}``)."""
F_TAR = b"t"
"""A piece of the output tar, written by ``finish`` after the exit status."""
# host -> holder
F_SEED = b"d"
"""The host-made tar for the output directory (before the case)."""
F_CASE = b"c"
"""The hand-over: the :class:`Seal` key (:data:`SEAL_KEY_BYTES`), then the argv joined by
NUL bytes; the holder starts the command as its child at once. After :data:`F_WARM`,
the warm frame's go token alone: the waiting interpreter goes on to run the command
(the seal key never crosses stdin while a role process exists: under gVisor one can
open ``/proc/1/fd/0``)."""
F_STOP = b"q"
"""After the hand-over, empty: the host ends the case (it then sends ``SIGUSR1`` until the
holder's copy-out is announced). The holder ends a case only with both, in either order:
this frame, which a role cannot write under runc (PID 1 is not dumpable: no
``/proc/1/fd/0``), and a ``SIGUSR1`` from outside the PID namespace, which a role cannot
forge under gVisor (and under runc only by filling its uid's count of queued signals
past the holder's limit, a count shared by every process of the uid on the host)."""
_STOP_FRAME = F_STOP + bytes(FRAME_HEADER - 1)
F_WARM = b"w"
"""Optional, after any seed and before the case (a warm start): the :class:`Seal` key,
a go token (:data:`SEAL_KEY_BYTES` each), then the modules to import (comma-separated)
and the argv, NUL-separated. Every frame from here on is sealed; the holder starts the
command's interpreter as its child with :data:`WARM_BOOT`, which imports those modules,
says so, and waits for the case; the holder then stops every role process
(``SIGSTOP``) until the hand-over, as it does :data:`WARM_LIMIT_S` after the warm frame
whatever the imports do, and reads at most :data:`EARLY_BYTES` of their output before it."""
FREEZE_SETTLE_S = 0.5
"""After stopping a warm start's processes, how long before they must all be seen stopped
(a signal stops a process only once it is scheduled)."""
FREEZE_CHECK_S = 0.1
"""How often the holder then checks that every role process stays stopped."""
WARM_LIMIT_S = 60.0
"""How long a warm start's imports may run before the holder stops them (``SIGSTOP``,
continued at the hand-over): the time before a case is outside its ``timeout``."""
EARLY_BYTES = 256 * 1024
"""What the holder reads of the role's output before the hand-over (a warm start's
imports); the role then blocks on its full pipe until the hand-over."""

WARM_BOOT = """\\
import os, sys
def _cyclebox_warm():
    go, ready, mods, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    module = argv[0] == "-m"
    if module:
        first = os.getcwd()
    else:
        argv[0] = os.path.abspath(argv[0])
        first = os.path.dirname(os.path.realpath(argv[0]))
    if sys.path and sys.path[0] in ("", os.getcwd()) and not sys.flags.safe_path:
        sys.path[0] = first
    elif not sys.flags.safe_path:
        sys.path.insert(0, first)
    failed = None
    try:
        for name in filter(None, mods.split(",")):
            __import__(name)
    except BaseException as exc:
        failed = exc
    try:
        os.write(ready, b"r")
        os.close(ready)
    except OSError:
        pass
    while True:
        try:
            word = os.read(go, 1)
            break
        except InterruptedError:
            continue
    os.close(go)
    if word != b"g":
        os._exit(125)
    if failed is not None:
        raise failed
    import runpy
    if module:
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
_cyclebox_warm()
"""
"""What a warm start runs as ``python -c WARM_BOOT GO_FD READY_FD MODULES SCRIPT|-m MODULE
ARGS``: ``sys.path[0]`` set as ``python SCRIPT`` (the script's directory) or ``python -m``
(the working directory) would set it, the modules imported, one byte on ``READY_FD``,
then a wait on ``GO_FD`` (the holder writes ``g`` at the hand-over; nothing of the
script runs before it), then the script (its path made absolute, as ``python`` makes
``__main__.__file__``) or module run as ``__main__`` with ``sys.argv`` as the cold command
would see it. An import that failed is raised after the hand-over, so it fails the case
as the cold command would (exit 1, its traceback on stderr). Without the go byte (the
container discarded) it exits 125."""


F_STATUS = b"l"
"""One of ``finish``'s JSON status lines (on stderr outside ``hold``)."""
TAG_BYTES = 16
SEAL_KEY_BYTES = 32


def case_payload(key: bytes, argv: list[str]) -> bytes:
    """The :data:`F_CASE` payload (the host builds it; an argv string holds no NUL)."""
    return key + b"\0".join(a.encode("utf-8", "surrogateescape") for a in argv)


def _json(value: object) -> str:
    """ASCII JSON of None, bools, ints, strings, lists and dicts: what the holder
    reports. Its own, because ``json`` imports ``re`` (~10 ms of every container's
    start, before READY)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        out = []
        for ch in value:
            n = ord(ch)
            if ch in '"\\':
                out.append("\\" + ch)
            elif 0x20 <= n < 0x7F:
                out.append(ch)
            elif n > 0xFFFF:
                n -= 0x10000
                out.append(f"\\u{0xD800 + (n >> 10):04x}\\u{0xDC00 + (n & 0x3FF):04x}")
            else:
                out.append(f"\\u{n:04x}")
        return '"' + "".join(out) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_json(str(k))}: {_json(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"not reported: {type(value).__name__}")


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return kind + len(payload).to_bytes(4, "big") + payload


class Seal:
    """Authenticates the frames sent after the hand-over: each is followed by
    HMAC-SHA256(key, sequence number, kind, length, payload)[:16]. The key comes in the
    case frame, read before any role process exists, and lives only in this process's
    memory (non-dumpable: no ptrace, no ``/proc/1/mem``). Needed because gVisor's
    ``/proc`` lets a process of the same uid open ``/proc/1/fd/1`` even so: a role
    that writes or splices bytes into the holder's stdout there cannot make a frame the
    host accepts (a wrong tag, a replayed or reordered one: the channel is refused)."""

    def __init__(self, key: bytes) -> None:
        # HMAC (RFC 2104) over the builtin SHA-256: ``hashlib``/``hmac`` load OpenSSL,
        # ~5 ms of every container's start before READY (tested against ``hmac``)
        sha = _sha256()
        if len(key) > SHA_BLOCK:
            key = sha(key).digest()
        key = key.ljust(SHA_BLOCK, b"\0")
        self._inner = sha(bytes(b ^ 0x36 for b in key))
        self._outer = sha(bytes(b ^ 0x5C for b in key))
        self.seq = 0

    def tag(self, head: bytes, payload: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(self.seq.to_bytes(8, "big") + head)
        inner.update(payload)
        outer = self._outer.copy()
        outer.update(inner.digest())
        self.seq += 1
        return bytes(outer.digest()[:TAG_BYTES])


SHA_BLOCK = 64


def _sha256() -> Any:
    """SHA-256 without OpenSSL when the interpreter has its builtin one."""
    for name in ("_sha256", "_sha2"):  # CPython <= 3.11, >= 3.12
        try:
            return __import__(name).sha256
        except (ImportError, AttributeError):
            continue
    import hashlib

    return hashlib.sha256


def _same(a: bytes, b: bytes) -> bool:
    """``a == b`` in time independent of where they differ (``hmac`` loads OpenSSL)."""
    if len(a) != len(b) or not b:
        return False
    diff = 0
    for x, y in zip(a, b, strict=True):
        diff |= x ^ y
    return diff == 0


_SEAL: list[Seal] = []
"""The holder's seal once it was handed its case (sealed frames from then on)."""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _send(kind: bytes, payload: bytes = b"") -> None:
    data = frame(kind, payload)
    if _SEAL:
        data += _SEAL[0].tag(data[:FRAME_HEADER], payload)
    _write_all(1, data)


class _TarFrames:
    """The tar writer's output as :data:`F_TAR` frames of at most :data:`CHUNK` bytes."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def write(self, data: bytes, /) -> int:
        self.buf += data
        while len(self.buf) >= CHUNK:
            _send(F_TAR, bytes(self.buf[:CHUNK]))
            del self.buf[:CHUNK]
        return len(data)

    def flush(self) -> None:
        if self.buf:
            _send(F_TAR, bytes(self.buf))
            self.buf.clear()


class _StdinPayload:
    """The next ``left`` bytes of stdin (a frame's payload), for ``tarfile`` to stream."""

    def __init__(self, head: bytearray, left: int) -> None:
        self.head, self.left = head, left

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        if n <= 0:
            return b""
        if self.head:
            data = bytes(self.head[:n])
            del self.head[:n]
        else:
            data = os.read(0, n)
            if not data:
                raise EOFError("stdin ended inside a frame")
        self.left -= len(data)
        return data

    def drain(self) -> None:
        while self.left:
            self.read(CHUNK)


def _exec_child(argv: list[str], report_fd: int, out_w: int, err_w: int,
                keep: tuple[int, ...] = ()) -> None:
    """In the forked child: the role's stdio, nothing else of the holder's (but ``keep``,
    a warm start's go and ready pipes), default signal handling, then exec (an error is
    reported on ``report_fd``, close-on-exec)."""
    try:
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        # every fd of the holder's (its stdio are the host's channel, the relay's sockets)
        # is already close-on-exec; closed here anyway so none can leak by mistake (the
        # ones open, as listed: a close per possible fd costs ms under gVisor)
        try:
            fds = [int(n) for n in os.listdir("/proc/self/fd")]
        except OSError:
            fds = list(range(3, max(os.sysconf("SC_OPEN_MAX"), 1024)))
        for fd in fds:
            if fd > 2 and fd != report_fd and fd not in keep:
                with _suppress(OSError):
                    os.close(fd)
        for fd in keep:
            os.set_inheritable(fd, True)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # ignored by Python: not by the role
            signal.signal(sig, signal.SIG_DFL)
        _limit_queued_signals()
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        os.execvp(argv[0], argv)  # noqa: S606 - the role's argv, no shell implied
    except (OSError, ValueError) as exc:  # ValueError: setrlimit's EPERM
        with _suppress(OSError):
            os.write(report_fd, str(getattr(exc, "errno", 0) or 1).encode())
    finally:
        os._exit(127)


SIGPENDING_ROLE = 1024
"""``RLIMIT_SIGPENDING`` of every role process, soft and hard (without a capability it
cannot raise it), and at most half the holder's own. The kernel counts queued signals
per uid, and a signal queued to a process is refused once the count passes *that
process's* limit: a role that filled the count (blocked real-time signals queued to
itself) made the kernel deliver its ``sigqueue(1, SIGUSR1)`` to PID 1 with no details,
which reads as the host's ``docker kill`` (pid 0, ``SI_USER``: :func:`from_outside`), and
ended its own case. With every role process at this limit the count stays below the
holder's, so a signal to PID 1 always names its sender."""


def _limit_queued_signals() -> None:
    """In the forked child, before exec: :data:`SIGPENDING_ROLE`."""
    import resource  # imported by _Case before READY: a dict lookup here

    soft, hard = resource.getrlimit(resource.RLIMIT_SIGPENDING)
    n = SIGPENDING_ROLE if soft == resource.RLIM_INFINITY else min(SIGPENDING_ROLE, soft // 2)
    if any(v > n or v == resource.RLIM_INFINITY for v in (soft, hard)):
        # (gVisor shows 0, 0 and refuses a change: it queues a signal with its details
        # or not at all, never without them)
        resource.setrlimit(resource.RLIMIT_SIGPENDING, (n, n))


class _Case:
    """The role command of this container: handed over on stdin (:data:`F_CASE`), started
    as the holder's child, its stdout/stderr framed onto the holder's stdout, its exit
    status reported once (:data:`F_EXIT`). The child inherits the container's user,
    seccomp filter, no-new-privileges, limits, environment and working directory."""

    def __init__(self, root: str) -> None:
        import select

        _sha256()  # imported now, before READY: not on the hand-over's path
        import resource  # noqa: F401 - for _limit_queued_signals, in the child

        self.root = root
        self.poller = select.poll()
        self.others: list[Any] = []
        """Pollers of other loops (the relay's) that must wake for these fds too."""
        self.inbox = bytearray()
        self.stdin_open = True
        self.pipes: dict[int, bytes] = {}
        self.pid: int | None = None
        self.code: int | None = None
        self.reported = False
        self.ended = False
        """The command ended (or could not start) after the hand-over: finish is next."""
        self.exited = False
        """The child was reaped (before the hand-over too, in a warm start)."""
        self.handed = False
        self.warm_key: bytes | None = None
        self.go: int | None = None
        """A warm start's go pipe (written at the hand-over)."""
        self.go_token = b""
        self.ready: int | None = None
        """A warm start's ready pipe (the interpreter's imports are done)."""
        self.warm_at = 0.0
        self.frozen = False
        """Every role process stopped (``SIGSTOP``) until the hand-over."""
        self.frozen_at = 0.0
        self.next_check = 0.0
        self.escaped = ""
        """A role process found running while frozen (its pid and state): all killed."""
        self.at_rest: dict[str, int] | None = None
        """Each role thread's :func:`_activity` counter once all were stopped."""
        self.early = 0
        """Bytes of the role's output read before the hand-over."""
        self.failed = b""
        """What the exec of the child reported (empty once it succeeded)."""
        self.host_gone = False
        """Stdin ended: the host's attach is gone, the case ends (:meth:`_read_stdin`)."""
        self.stop_frame = False
        """The host's :data:`F_STOP` was read (after the hand-over)."""
        self.signalled = False
        """A ``SIGUSR1`` from outside the PID namespace came (:func:`from_outside`)."""
        self.argv0 = ""
        self._watch(0)

    def stopped(self) -> bool:
        """The host ended the case: its stop frame and its signal both came."""
        return self.stop_frame and self.signalled

    def also_poll(self, poller: Any) -> None:
        self.others.append(poller)
        for fd in [*self.pipes, *([0] if self.stdin_open else [])]:
            poller.register(fd, 1)  # POLLIN

    def _watch(self, fd: int) -> None:
        for p in (self.poller, *self.others):
            p.register(fd, 1)

    def _unwatch(self, fd: int) -> None:
        for p in (self.poller, *self.others):
            with _suppress(KeyError, ValueError):
                p.unregister(fd)

    def idle(self) -> bool:
        """Nothing to move: the command's pipes are closed and stdin, if still open, is
        only watched for the host's end (after the hand-over)."""
        return not self.pipes and (self.handed or not self.stdin_open)

    def step(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` (0 when another loop already waited), then move what
        is ready; True when the command's last pipe just closed."""
        if not self.pipes and not self.stdin_open:
            return False
        if self.idle():
            timeout_ms = 0  # a glance at stdin for the host's end; the caller waits
        try:
            events = self.poller.poll(timeout_ms)
        except InterruptedError:
            return False
        had = bool(self.pipes)
        for fd, _ in events:
            if fd == 0:
                self._read_stdin()
            elif fd in self.pipes:
                self._pump(fd)
            elif fd == self.ready:
                self._freeze()  # the imports are done (or the interpreter is gone)
        return had and not self.pipes

    def _pump(self, fd: int) -> bool:
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data:
            _send(self.pipes[fd], data)
            if not self.handed:
                self.early += len(data)
                if self.early >= EARLY_BYTES:  # the rest waits in the pipe for the case
                    for held in self.pipes:
                        self._unwatch(held)
            return True
        self._unwatch(fd)
        del self.pipes[fd]
        os.close(fd)
        return False

    def _read_stdin(self) -> None:
        try:
            data = os.read(0, CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            # The host went away (its process killed, a second signal's fast exit; with
            # ``StdinOnce`` the engine closes stdin when the attach ends): before the
            # hand-over nothing will ever come, after it nobody reads the command's
            # output, status or tar. Either way the container ends now (finish kills
            # every role process) rather than wait, or run, until its timeout.
            self._stop_stdin()
            self.ended = True
            self.host_gone = True
            return
        if self.handed:
            # after the case the host sends only its stop (F_STOP, empty); anything else
            # is dropped, and so are the bytes of the case frame's reading
            self.stop_frame = self.stop_frame or _STOP_FRAME in bytes(self.inbox[-4:]) + data
            self.inbox[:] = data[-4:]
            return
        self.inbox += data
        while len(self.inbox) >= FRAME_HEADER and self.stdin_open and not self.handed:
            kind = bytes(self.inbox[:1])
            n = int.from_bytes(self.inbox[1:FRAME_HEADER], "big")
            if kind == F_SEED and self.warm_key is None:
                del self.inbox[:FRAME_HEADER]
                self._seed(_StdinPayload(self.inbox, n))
                continue
            if kind not in (F_CASE, F_WARM) or n > FRAME_MAX or (
                    kind == F_WARM and self.warm_key is not None):
                self._refuse(f"unexpected frame {kind!r} of {n} bytes on stdin")
                return
            if len(self.inbox) < FRAME_HEADER + n:
                return
            payload = bytes(self.inbox[FRAME_HEADER:FRAME_HEADER + n])
            del self.inbox[:FRAME_HEADER + n]
            if kind == F_WARM:
                self._warm(payload)
            else:
                self._start(payload)

    def _stop_stdin(self) -> None:
        if self.stdin_open:
            self.stdin_open = False
            self._unwatch(0)

    def _refuse(self, why: str) -> None:
        self._stop_stdin()
        _send(F_STARTED, _json({"error": why[:500]}).encode())
        self.ended = True

    def _seed(self, payload: _StdinPayload) -> None:
        reply: dict[str, object] = {"ok": False}
        try:
            code = seed(self.root, payload)  # type: ignore[arg-type]
            payload.drain()
            reply = {"ok": code == 0}
        except Exception as exc:  # a broken seed is the host's error: reported, not raised
            reply["error"] = f"{type(exc).__name__}: {exc}"[:500]
        _send(F_SEEDED, _json(reply).encode())

    def _start(self, payload: bytes) -> None:
        self.handed = True  # one case per container: nothing more is parsed (stdin is
        # still watched, for the host's end; never a blocking read in PID 1 from now on)
        with _suppress(OSError):
            os.set_blocking(0, False)
        if self.warm_key is not None:
            self._go(payload)
            return
        key = payload[:SEAL_KEY_BYTES]
        argv = [a.decode("utf-8", "surrogateescape")
                for a in payload[SEAL_KEY_BYTES:].split(b"\0")]
        if len(payload) <= SEAL_KEY_BYTES or not argv[0]:
            self._refuse("bad case frame: a key and a non-empty argv[0] are needed")
            return
        _SEAL.append(Seal(key))  # before the fork: every frame about the role is sealed
        self._fork(argv)
        self._started()

    def _warm(self, payload: bytes) -> None:
        """Start the command's interpreter now, importing the modules named, held at
        :data:`WARM_BOOT`'s wait until :meth:`_go` (the hand-over)."""
        head = 2 * SEAL_KEY_BYTES
        parts = [a.decode("utf-8", "surrogateescape") for a in payload[head:].split(b"\0")]
        if len(payload) <= head or len(parts) < 3 or not parts[1] or not parts[2]:
            self._refuse("bad warm frame: a key, a go token, the modules and an argv of at "
                         "least two are needed")
            return
        self.warm_key, self.go_token = payload[:SEAL_KEY_BYTES], payload[SEAL_KEY_BYTES:head]
        _SEAL.append(Seal(self.warm_key))  # before the fork, as for the case
        mods, argv = parts[0], parts[1:]
        go_r, self.go = os.pipe()
        ready_r, ready_w = os.pipe()
        self.warm_at = time.monotonic()
        try:
            self._fork([argv[0], "-c", WARM_BOOT, str(go_r), str(ready_w), mods, *argv[1:]],
                       keep=(go_r, ready_w))
        finally:
            os.close(go_r)
            os.close(ready_w)
        os.set_blocking(ready_r, False)
        self.ready = ready_r
        self._watch(ready_r)

    def tick(self) -> None:
        """A warm start's imports get :data:`WARM_LIMIT_S`, then every role process is
        stopped until the hand-over; one that runs all the same (a ``SIGCONT`` timer of
        its own continues it) has every role process killed, and the case fails at the
        hand-over, named. Seen by state (a thread running at a check) and by activity
        since the first check (:func:`_activity`: a burst between two checks, a thread
        ``/proc`` does not list)."""
        if self.warm_key is None or self.handed or self.escaped:
            return
        now = time.monotonic()
        if not self.frozen:
            if now - self.warm_at > WARM_LIMIT_S:
                self._freeze()
            return
        if now - self.frozen_at < FREEZE_SETTLE_S or now < self.next_check:
            return
        self.next_check = now + FREEZE_CHECK_S
        running = _running_others()
        now_seen = _activity()
        if self.at_rest is None:
            self.at_rest = now_seen  # a stopped thread's counter stays as it is
        else:  # it ran between two checks (a burst that stopped itself again), or is new
            rest = self.at_rest
            running += [f"{key} (ran since the check before{'' if key in rest else ', new'})"
                        for key, n in now_seen.items() if n > rest.get(key, -1)]
        if running:
            self.escaped = running[0]
            _kill_others()


    def _freeze(self) -> None:
        """Stop every process but this one (the role's, before its case) until :meth:`_go`."""
        if self.ready is not None:
            self._unwatch(self.ready)
            os.close(self.ready)
            self.ready = None
        if not self.handed and not self.frozen and os.getpid() == 1:
            self.frozen = True  # kill(-1) spares PID 1 (this holder) in its namespace only
            self.frozen_at = time.monotonic()
            with _suppress(OSError):
                os.kill(-1, signal.SIGSTOP)

    def _go(self, payload: bytes) -> None:
        """The hand-over of a warm start: its go token alone, then the go byte."""
        if not _same(payload, self.go_token):
            self._refuse("bad case frame: a warm start's hand-over is its go token alone")
            return
        if self.escaped:
            why = (f"a role process ({self.escaped}) ran while its warm start was stopped "
                   "before the hand-over (something continued it): every role process "
                   "was killed")
            _send(F_STDERR, f"cyclebox: {why}\n".encode())
            self._refuse(why)
            return
        if self.ready is not None:
            self._unwatch(self.ready)
            os.close(self.ready)
            self.ready = None
        if self.frozen:
            self.frozen = False
            with _suppress(OSError):
                os.kill(-1, signal.SIGCONT)
        for fd in self.pipes:  # read again what was held back before the hand-over
            self._watch(fd)
        if self.go is not None:
            with _suppress(OSError):  # the interpreter already ended: its status stands
                _write_all(self.go, b"g")
            os.close(self.go)
            self.go = None
        self._started()
        if self.exited:
            self.ended = True

    def _fork(self, argv: list[str], keep: tuple[int, ...] = ()) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        rep_r, rep_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _exec_child(argv, rep_w, out_w, err_w, keep)
        for fd in (out_w, err_w, rep_w):
            os.close(fd)
        self.pid = pid
        self.argv0 = argv[0]
        self.failed = os.read(rep_r, 32)  # empty once the exec succeeded (close-on-exec)
        os.close(rep_r)
        for fd, kind in ((out_r, F_STDOUT), (err_r, F_STDERR)):
            os.set_blocking(fd, False)
            self.pipes[fd] = kind
            self._watch(fd)

    def _started(self) -> None:
        """Report the start (at the hand-over): the pid, or why the exec failed."""
        if self.failed:
            err = int(self.failed) if self.failed.isdigit() else 0
            _send(F_STARTED, _json({"error": os.strerror(err)}).encode())
            _send(F_STDERR, f"cyclebox: cannot run {self.argv0!r}: {os.strerror(err)}\n"
                  .encode())
            self.code = 127 if err == 2 else 126  # what a shell (and docker exec) says
        else:
            _send(F_STARTED, _json({"pid": self.pid}).encode())

    def reap(self) -> None:
        """Reap every exited child (orphans are re-parented to PID 1); note ours."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.pid:
                code = os.waitstatus_to_exitcode(status)
                if self.code is None:
                    self.code = code if code >= 0 else 128 - code
                self.exited = True
                self.ended = self.handed  # a warm start's interpreter waits for its case

    def close(self, *, all_gone: bool) -> None:
        """After every other process was killed (``all_gone``; else some could not be
        and nothing may block on them): the rest of the command's output, then its exit
        status (``None`` when it could not be reaped)."""
        if self.pid is None:
            return
        for fd in list(self.pipes):
            os.set_blocking(fd, not all_gone)  # blocking: no writer is left, EOF comes
            while self._pump(fd) and fd in self.pipes and all_gone:
                pass
        if all_gone and not self.ended:
            with _suppress(ChildProcessError):
                _, status = os.waitpid(self.pid, 0)
                self.ended = True
                if self.code is None:
                    code = os.waitstatus_to_exitcode(status)
                    self.code = code if code >= 0 else 128 - code
        self.reap()
        if not self.reported and self.handed:  # no case, no exit status to report
            self.reported = True
            _send(F_EXIT, _json({"code": self.code}).encode())


# -- the loopback relay ---------------------------------------------------------------


def relay_open(target: str, *, host: str = RELAY_HOST, port: int = RELAY_PORT,
               max_connections: int = RELAY_MAX_CONNECTIONS,
               buffer: int = RELAY_BUFFER) -> _Relay:
    """Listen on ``host:port`` now (raises OSError when it cannot); each
    :meth:`_Relay.step` then relays connections to the unix socket ``target``. No thread:
    the holder's own loop steps it (a thread would also be refused under gVisor with the
    OCI seccomp profile, which answers ``clone3`` with EPERM instead of ENOSYS)."""
    return _Relay(_listen(host, port), target, max_connections, buffer)


def _listen(host: str, port: int) -> Any:
    """A non-blocking TCP socket listening on ``host:port`` (raises OSError when it
    cannot), the relay's and the egress proxy's."""
    import socket

    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # no SO_REUSEADDR / SO_REUSEPORT: no other socket may share this port
        lsock.bind((host, port))
        lsock.listen(RELAY_BACKLOG)
        lsock.setblocking(False)
    except BaseException:
        lsock.close()
        raise
    return lsock


class _Pipe:
    """One direction of a relayed connection: bytes read from ``src`` not yet written
    to ``dst`` (at most the relay's buffer), whether ``src`` ended, and whether
    ``dst`` was told so (``shutdown``)."""

    __slots__ = ("buf", "drop", "dropped", "dst", "eof", "shut", "src", "until")

    def __init__(self, src: Any, dst: Any) -> None:
        self.src, self.dst = src, dst
        self.buf = bytearray()
        self.eof = False
        self.shut = False
        self.drop = False
        """Nobody reads ``dst`` any more: what ``src`` sends is read and discarded."""
        self.dropped = 0
        self.until = 0.0
        """Lingering: when ``src`` is closed at the latest (monotonic; 0: not yet)."""

    def discard(self) -> None:
        """Nobody reads ``dst`` any more: drop what is held, discard what ``src`` sends."""
        self.buf.clear()
        self.drop = self.shut = True


class _Conn:
    """A relayed connection: ``up`` client -> gateway, ``down`` gateway -> client."""

    __slots__ = ("down", "up")

    def __init__(self, client: Any, gateway: Any) -> None:
        self.up = _Pipe(client, gateway)
        self.down = _Pipe(gateway, client)

    def over(self) -> bool:
        # The gateway decides: once it ended and its bytes were delivered, nothing the
        # client still sends could reach anyone.
        return self.down.eof and not self.down.buf


class _Relay:
    def __init__(self, lsock: Any, target: str, max_connections: int, buffer: int) -> None:
        import select
        import socket

        self.socket, self.select = socket, select
        self.lsock = lsock
        self.target = target
        self.max = max_connections
        self.cap = buffer
        self.conns: list[_Conn] = []
        self.poller = select.poll()
        self.masks: dict[int, int] = {}
        self.broken = False

    @property
    def port(self) -> int:
        return int(self.lsock.getsockname()[1])

    def step(self, timeout_ms: int) -> None:
        """One round: wait up to ``timeout_ms`` for socket events, move what they allow.
        Never raises and never writes (stderr is the host's status channel): a relay
        that fails closes everything and is ``broken``; the role has lost its
        endpoint (it starved itself), nothing else is touched."""
        try:
            self._round(timeout_ms)
        except Exception:
            self.broken = True
            for sock in [self.lsock, *(p.src for c in self.conns for p in (c.up, c.down))]:
                with _suppress(Exception):
                    sock.close()
            self.conns = []

    def _set(self, sock: Any, mask: int) -> None:
        fd = sock.fileno()
        old = self.masks.get(fd)
        if mask == old or (mask == 0 and old is None):
            return
        # An fd with nothing to do is not polled at all: poll reports a hang-up even
        # for an empty mask, which would spin while the other side drains.
        if mask == 0:
            self.poller.unregister(fd)
            del self.masks[fd]
        elif old is None:
            self.poller.register(fd, mask)
            self.masks[fd] = mask
        else:
            self.poller.modify(fd, mask)
            self.masks[fd] = mask

    def _round(self, timeout_ms: int) -> None:
        pollin, pollout = self.select.POLLIN, self.select.POLLOUT
        now = time.monotonic()
        for conn in [c for c in self.conns if c.up.until and now >= c.up.until]:
            self._close(conn)  # lingered its time: the client had its answer
        lfd = self.lsock.fileno()
        self._set(self.lsock, pollin if len(self.conns) < self.max else 0)
        by_fd: dict[int, tuple[Any, _Conn]] = {}
        for conn in self.conns:
            for inbound, outbound in ((conn.up, conn.down), (conn.down, conn.up)):
                mask = pollin if not inbound.eof and len(inbound.buf) < self.cap else 0
                if outbound.buf:
                    mask |= pollout
                self._set(inbound.src, mask)
                by_fd[inbound.src.fileno()] = (inbound.src, conn)
        try:
            events = self.poller.poll(timeout_ms)
        except InterruptedError:
            return
        for fd, ev in events:
            if fd == lfd:
                self._accept()
                continue
            got = by_fd.get(fd)
            if got is None or got[1] not in self.conns or got[0].fileno() != fd:
                continue  # closed earlier in this round (a lingering one's gateway too)
            sock, conn = got
            inbound, outbound = ((conn.up, conn.down) if sock is conn.up.src
                                 else (conn.down, conn.up))
            if not self._io(sock, ev, inbound, outbound, gateway=sock is conn.down.src):
                self._close(conn)
            elif conn.over():
                self._linger(conn)

    def _io(self, sock: Any, ev: int, inbound: _Pipe, outbound: _Pipe, *,
            gateway: bool) -> bool:
        """Move what ``ev`` allows on ``sock``; False when the connection is over.

        An error on the client's side ends it (nobody is left to answer). An error on
        the gateway's side does not: the gateway refuses a request from its head and
        closes with the body unread, so the next write to it fails (EPIPE) and the read
        after its answer is a reset; the answer it sent before still goes to the
        client, and the rest of the request goes nowhere."""
        sel = self.select
        moved = False
        if ev & (sel.POLLIN | sel.POLLHUP | sel.POLLERR) and not inbound.eof \
                and len(inbound.buf) < self.cap:
            try:
                data: bytes | None = sock.recv(self.cap - len(inbound.buf))
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                if not gateway:
                    return False  # reset: the client is gone
                data = b""
            if data is not None:
                if not data:
                    inbound.eof = True
                elif not inbound.drop:
                    inbound.buf += data
                else:
                    inbound.dropped += len(data)
                    if inbound.dropped > LINGER_BYTES:
                        return False  # discarded enough: the client is closed
                moved = True
        if ev & (sel.POLLOUT | sel.POLLHUP | sel.POLLERR) and outbound.buf:
            try:
                del outbound.buf[:sock.send(outbound.buf)]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                if not gateway:
                    return False  # broken pipe: the client is gone
                outbound.discard()  # the gateway reads no more of this request
            moved = True
        if not moved and ev & (sel.POLLHUP | sel.POLLERR | sel.POLLNVAL):
            return False
        for pipe in (inbound, outbound):
            if pipe.eof and not pipe.buf and not pipe.shut:
                pipe.shut = True
                with _suppress(OSError):
                    pipe.dst.shutdown(self.socket.SHUT_WR)
        return True

    def _accept(self) -> None:
        while len(self.conns) < self.max:  # what the accept queue holds, up to the bound
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            self._connect(client)

    def _connect(self, client: Any) -> None:
        socket = self.socket
        gateway = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.setblocking(False)
            # bytes go out as they come in: no Nagle wait on a reply written in pieces
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            gateway.setblocking(False)
            gateway.connect(self.target)
        except OSError:
            # The gateway's backlog is full (only this container's own connections can
            # fill it) or it is gone: the client sees its connection closed at once.
            client.close()
            gateway.close()
            return
        self.conns.append(_Conn(client, gateway))

    def _linger(self, conn: _Conn) -> None:
        """The gateway's side ended and its bytes went to the client: its socket is
        closed now; the client's once it ended too, or after LINGER_S (or LINGER_BYTES
        discarded), reading and discarding what it still sends."""
        if conn.up.eof:
            self._close(conn)
            return
        if conn.up.until:
            return
        conn.up.discard()
        conn.up.until = time.monotonic() + LINGER_S
        self._set(conn.down.src, 0)
        with _suppress(OSError):
            conn.down.src.close()

    def _close(self, conn: _Conn) -> None:
        self.conns.remove(conn)
        for sock in (conn.up.src, conn.down.src):
            self._set(sock, 0)
            with _suppress(OSError):
                sock.close()


# -- the deny-all egress proxy ------------------------------------------------------
# A bound container has no network; a client that honours HTTP(S)_PROXY (the launcher
# points it here) gets a 403 at once instead of a DNS failure or a retry loop, and the
# target it asked for is named in the status, so the host records every side channel an
# agent tried (telemetry, update checks, web fetches) rather than losing it. Nothing is
# ever forwarded: there is nowhere to forward to.
_DENIED_BODY = b"cyclebox: no network in this container; egress refused.\r\n"
_DENIED = (b"HTTP/1.1 403 Forbidden\r\ncontent-type: text/plain\r\nconnection: close\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(_DENIED_BODY), _DENIED_BODY))


def egress_open(*, host: str = RELAY_HOST, port: int = EGRESS_PORT) -> _Egress:
    """Listen on ``host:port`` now (raises OSError when it cannot), as the relay does."""
    return _Egress(_listen(host, port))


def egress_target(head: bytes) -> str:
    """The host a proxy request line names (``CONNECT h:p``, ``GET http://h/..``), as
    printable ASCII of at most :data:`EGRESS_HOST_CHARS`; ``?`` when there is none."""
    line = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) < 2:
        return "?"
    target = parts[1]
    if b"://" in target:
        target = target.split(b"://", 1)[1].split(b"/", 1)[0]
    target = target.rsplit(b"@", 1)[-1]
    text = target.decode("latin-1")
    shown = "".join(c if (c.isascii() and c.isalnum()) or c in ".-_:[]"
                    else f"\\x{ord(c):02x}" for c in text)
    return shown[:EGRESS_HOST_CHARS] or "?"


class _Egress:
    """Answers every connection with :data:`_DENIED` once its request line is in (or
    :data:`EGRESS_HEAD_BYTES` came without one), then closes it; keeps the distinct
    targets (at most :data:`EGRESS_MAX_HOSTS`) and the count of refused requests."""

    def __init__(self, lsock: Any) -> None:
        import select

        self.select = select
        self.lsock = lsock
        self.conns: dict[int, tuple[Any, bytearray]] = {}
        self.poller = select.poll()
        self.poller.register(lsock.fileno(), select.POLLIN)
        self.hosts: list[str] = []
        self.count = 0

    def step(self) -> None:
        """One round without waiting; never raises (a failure closes what it holds)."""
        try:
            for fd, _ev in self.poller.poll(0):
                if fd == self.lsock.fileno():
                    self._accept()
                elif fd in self.conns:
                    self._read(fd)
        except Exception:
            for fd in list(self.conns):
                self._close(fd)

    def _accept(self) -> None:
        while len(self.conns) < RELAY_MAX_CONNECTIONS:
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            client.setblocking(False)
            self.conns[client.fileno()] = (client, bytearray())
            self.poller.register(client.fileno(), self.select.POLLIN)

    def _read(self, fd: int) -> None:
        client, head = self.conns[fd]
        try:
            data = client.recv(EGRESS_HEAD_BYTES - len(head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        head += data
        if data and b"\n" not in head and len(head) < EGRESS_HEAD_BYTES:
            return
        self.count += 1
        target = egress_target(bytes(head)) if b"\n" in head else "?"
        if target not in self.hosts and len(self.hosts) < EGRESS_MAX_HOSTS:
            self.hosts.append(target)
        with _suppress(OSError):
            client.send(_DENIED)
        self._close(fd)

    def _close(self, fd: int) -> None:
        client, _ = self.conns.pop(fd)
        with _suppress(Exception):
            self.poller.unregister(fd)
        with _suppress(OSError):
            client.close()


def main(argv: list[str]) -> int:
    if argv[:1] == ["hold"] and len(argv) in (2, 3):
        hold(argv[1], argv[2] if len(argv) == 3 else None)
    if argv[:1] == ["finish"] and len(argv) == 2:
        return finish(argv[1])
    if argv[:1] == ["seed"] and len(argv) == 2:
        return seed(argv[1])
    sys.stderr.write("usage: hold DIR|- [SOCKET] | finish DIR|- | seed DIR\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
