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

``hold DIR|- [SOCKET]``
    Block every catchable signal, make itself non-dumpable, with ``SOCKET`` (the
    mounted gateway socket) start the loopback relay (below) and the deny-all egress
    proxy on :data:`EGRESS_PORT` (near the end), write :data:`READY` to
    stdout (the host waits for it before it starts the role command), reap orphans on
    ``SIGCHLD``; on ``SIGUSR1`` run ``finish DIR`` on its own stdout/stderr and exit.
``finish DIR|-``
    ``kill(-1, SIGKILL)`` until no other process is left, then write a JSON status
    line to stderr (OOM kills, tmpfs blocks/inodes used and free, dumpable flag, the
    egress the proxy refused),
    unless ``-`` a PAX tar of ``DIR`` to stdout, and a last status line with the
    walk's errors. The walk is relative to directory fds, so no path length limit
    applies; symlinks, hard links and FIFOs are written as such so the host can name
    its refusal; sockets and devices are reported as errors.
``seed DIR``
    Extract the host-made tar on stdin into ``DIR`` (used only for stages whose
    output directory starts with host content, e.g. the apply stage's repository,
    whose checkout may hold symlinks; only those exact symlinks may come back).

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

import contextlib
import json
import os
import signal
import stat
import sys
import time
from typing import Any, BinaryIO

_BLOCK = {s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)}
MAX_ERRORS = 8
RELAY_HOST = "127.0.0.1"
RELAY_PORT = 40080
"""The in-container model endpoint's port, on the container's own loopback."""
RELAY_MAX_CONNECTIONS = 16
"""Relayed connections at once: the gateway's default ``max_connections`` per binding."""
RELAY_BUFFER = 64 * 1024
"""Bytes held per direction per connection (back-pressure beyond it)."""
RELAY_BACKLOG = 64
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
"""First bytes on the holder's stdout, written once it is non-dumpable: the host starts
the role command only after reading them (a role process started earlier could open
``/proc/1/fd/1`` before the ``prctl`` and keep it). The tar follows."""


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
    waited = {signal.SIGCHLD, signal.SIGUSR1}
    while True:
        if relay is None or relay.broken:
            sig = signal.sigwait(waited)
        else:
            # One thread for everything: relay a round of IO (at most SIGNAL_POLL_MS of
            # waiting), then take any pending signal, so SIGUSR1 is acted on within one
            # round however busy the relay is, and finish never waits on the relay.
            relay.step(SIGNAL_POLL_MS)
            if egress is not None:
                egress.step()
            info = signal.sigtimedwait(waited, 0)
            if info is None:
                continue
            sig = info.si_signo
        if sig == signal.SIGUSR1:
            sys.stdout.flush()
            os._exit(finish(root, dumpable=dumpable, egress=egress))
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


def finish(root: str, *, dumpable: int | None = None, egress: _Egress | None = None) -> int:
    deadline = time.monotonic() + 5
    while True:
        _kill_others()
        left = _others()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
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


# -- the loopback relay ---------------------------------------------------------------


def relay_open(target: str, *, host: str = RELAY_HOST, port: int = RELAY_PORT,
               max_connections: int = RELAY_MAX_CONNECTIONS,
               buffer: int = RELAY_BUFFER) -> _Relay:
    """Listen on ``host:port`` now (raises OSError when it cannot); each
    :meth:`_Relay.step` then relays connections to the unix socket ``target``. No thread:
    the holder's own loop steps it (a thread would also be refused under gVisor with the
    OCI seccomp profile, which answers ``clone3`` with EPERM instead of ENOSYS)."""
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
    return _Relay(lsock, target, max_connections, buffer)


class _Pipe:
    """One direction of a relayed connection: bytes read from ``src`` not yet written
    to ``dst`` (at most the relay's buffer), whether ``src`` ended, and whether
    ``dst`` was told so (``shutdown``)."""

    __slots__ = ("buf", "dst", "eof", "shut", "src")

    def __init__(self, src: Any, dst: Any) -> None:
        self.src, self.dst = src, dst
        self.buf = bytearray()
        self.eof = False
        self.shut = False


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
                with contextlib.suppress(Exception):
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
            if got is None or got[1] not in self.conns:
                continue  # closed earlier in this round
            sock, conn = got
            inbound, outbound = ((conn.up, conn.down) if sock is conn.up.src
                                 else (conn.down, conn.up))
            if not self._io(sock, ev, inbound, outbound) or conn.over():
                self._close(conn)

    def _io(self, sock: Any, ev: int, inbound: _Pipe, outbound: _Pipe) -> bool:
        """Move what ``ev`` allows on ``sock``; False when the connection is over."""
        sel = self.select
        moved = False
        try:
            if ev & (sel.POLLIN | sel.POLLHUP | sel.POLLERR) and not inbound.eof \
                    and len(inbound.buf) < self.cap:
                data = sock.recv(self.cap - len(inbound.buf))
                if data:
                    inbound.buf += data
                else:
                    inbound.eof = True
                moved = True
            if ev & (sel.POLLOUT | sel.POLLHUP | sel.POLLERR) and outbound.buf:
                del outbound.buf[:sock.send(outbound.buf)]
                moved = True
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False  # reset, broken pipe: the peer is gone
        if not moved and ev & (sel.POLLHUP | sel.POLLERR | sel.POLLNVAL):
            return False
        for pipe in (inbound, outbound):
            if pipe.eof and not pipe.buf and not pipe.shut:
                pipe.shut = True
                with contextlib.suppress(OSError):
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

    def _close(self, conn: _Conn) -> None:
        self.conns.remove(conn)
        for sock in (conn.up.src, conn.down.src):
            self._set(sock, 0)
            with contextlib.suppress(OSError):
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
    import socket

    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        lsock.bind((host, port))
        lsock.listen(RELAY_BACKLOG)
        lsock.setblocking(False)
    except BaseException:
        lsock.close()
        raise
    return _Egress(lsock)


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
        with contextlib.suppress(OSError):
            client.send(_DENIED)
        self._close(fd)

    def _close(self, fd: int) -> None:
        client, _ = self.conns.pop(fd)
        with contextlib.suppress(Exception):
            self.poller.unregister(fd)
        with contextlib.suppress(OSError):
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
