"""The gateway relay: credentials stay on the head.

A role container on a node reaches the model through a unix socket in a node-local
directory, as it would locally. Behind that socket is not the gateway but a relay
(:class:`NodeRelay`, in the node's task process) that forwards each connection's bytes
over TLS to the head's :class:`HeadForwarder`, which opens the real gateway socket of
that one binding and pipes the bytes back. The gateway (recording, budget, role to
upstream mapping, the model key) never leaves the head process; the node holds only
the binding's gateway token (worthless outside the run) and a per-binding ticket.

Invariants:

- The link is TLS (>= 1.2) pinned to the forwarder's ephemeral certificate, which the
  ticket carries (:mod:`runner.isolation.ray.pin`); the node trusts nothing else.
- A connection to the forwarder must complete the handshake and send its binding's
  32-byte ticket (compared in constant time) within :data:`HANDSHAKE_TIMEOUT_S`;
  anything else is closed unanswered.
- A flood of unauthenticated connections cannot keep a node out: one source address
  holds at most :data:`MAX_PENDING_PER_SOURCE` of the :data:`MAX_PENDING` slots for
  connections without a valid ticket yet, and when every slot is taken a new
  connection takes the oldest one's (which is cut): a node, whose handshake and ticket
  take milliseconds, is only kept out by :data:`MAX_PENDING` new connections inside its
  own handshake.
- Every count a peer drives is bounded: at most :data:`MAX_PENDING` connections to the
  forwarder without a valid ticket yet, at most :data:`MAX_PER_TICKET` live connections
  per ticket, at most :data:`MAX_NODE_CONNECTIONS` live connections into one node
  relay, and at most :data:`HIGH_WATER` bytes buffered per direction. A connection
  beyond a cap is closed at once (and counted in ``refusals()``); the accept loop
  starts no thread for it. One thread serves each admitted connection.
- A connection lives no longer than its binding: removing a ticket (the run ended) shuts
  down every connection it admitted, and closing a node relay shuts down every
  connection into it, so a peer that holds a connection open (or a half-open socket)
  never keeps a thread, a descriptor or a gateway connection past its run.

The forwarder listens on the head's node address: on a real cluster that is the
private network (see ``docs/ray.md``).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import select
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runner.errors import SandboxError
from runner.isolation.ray import pin

TICKET_BYTES = 32
CHUNK = 64 * 1024
HIGH_WATER = 4 * CHUNK
"""Bytes buffered for one direction before the relay stops reading the other side."""
CONNECT_TIMEOUT_S = 10.0
"""A node's connect, TLS handshake and ticket to the head, all within this; and the
head's connect to the gateway socket."""
HANDSHAKE_TIMEOUT_S = 2.0
"""On the head: the TLS handshake and ticket of a new connection, all within this. A real
node needs about 2 ms on one host (measured: bench/relay_flood.py), a few round trips on
a network; an idle unauthenticated connection holds its slot no longer than this."""
MAX_PENDING = 64
"""Connections to the forwarder that have not yet presented a valid ticket."""
MAX_PENDING_PER_SOURCE = 8
"""Of those, from one source address."""
MAX_PER_TICKET = 16
"""Live relayed connections per ticket (one container's concurrent model calls)."""
MAX_NODE_CONNECTIONS = 16
"""Live connections from the container into one node relay socket."""
SOCKET_PATH_MAX = 107
"""sun_path holds 108 bytes including the terminating NUL."""


@dataclass(frozen=True)
class Ticket:
    """What a node needs to reach one binding on the head."""

    host: str
    port: int
    secret: bytes
    cert: bytes
    """The forwarder's certificate (PEM, public): the one certificate the node trusts."""
    token: bytes
    """The binding's gateway token file content (per run and role, not a model key)."""


class _Side:
    __slots__ = ("eof", "out", "shut", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = bytearray()
        """Bytes read from the other side, not yet sent to this one."""
        self.eof = False
        self.shut = False


def _shut_wr(sock: socket.socket) -> None:
    # SSLSocket.shutdown() discards the TLS state, and with it the read side that is
    # still in use: half-close the TCP stream under it instead. The peer reads that as
    # an EOF without close_notify, which ``pin``'s OP_IGNORE_UNEXPECTED_EOF makes b""
    # rather than a fatal error. (An on-path attacker could truncate a stream this way,
    # as it could reset it; the HTTP inside is self-delimiting.)
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_WR)


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Pipe both ways until both directions are closed, then close both.

    One thread for both directions: an SSL object must not be read and written from two
    threads at once. An error on one side (a reset, a broken pipe) ends that side only:
    what it sent before still goes to the other. The gateway refuses a request from its
    head and closes with the body unread; the next write to it fails and the read after
    its answer is a reset, and the answer must still reach the container."""
    sides = (_Side(a), _Side(b))
    pairs = ((sides[0], sides[1]), (sides[1], sides[0]))
    poll = select.poll()
    try:
        for s in sides:
            s.sock.setblocking(False)
        while True:
            for me, peer in pairs:
                if peer.eof and not me.out and not me.shut:
                    _shut_wr(me.sock)
                    me.shut = True
            if sides[0].shut and sides[1].shut:
                return
            buffered = False
            for me, peer in pairs:
                mask = 0
                if not me.eof and len(peer.out) < HIGH_WATER:
                    mask |= select.POLLIN
                    if isinstance(me.sock, ssl.SSLSocket) and me.sock.pending():
                        buffered = True  # decrypted bytes poll() cannot see
                if me.out:
                    mask |= select.POLLOUT
                if mask:
                    poll.register(me.sock, mask)
                else:  # else a hang-up it must not act on would wake poll() at once, forever
                    with contextlib.suppress(KeyError):
                        poll.unregister(me.sock)
            events = dict(poll.poll(0 if buffered else None))
            for me, peer in pairs:
                ev = events.get(me.sock.fileno(), 0)
                can_read = not me.eof and len(peer.out) < HIGH_WATER
                if can_read and (ev & (select.POLLIN | select.POLLHUP | select.POLLERR) or (
                        isinstance(me.sock, ssl.SSLSocket) and me.sock.pending())):
                    try:
                        data = me.sock.recv(CHUNK)
                    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                        data = None
                    except OSError:
                        _gone(me)
                        continue
                    if data == b"":
                        me.eof = True
                    elif data:
                        peer.out += data
                if me.out and ev & (select.POLLOUT | select.POLLHUP | select.POLLERR):
                    try:
                        # the same leading bytes on a retry, as TLS requires
                        sent = me.sock.send(bytes(me.out[:CHUNK]))
                    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                        sent = 0
                    except OSError:
                        # nothing more reaches ``me``, and what ``peer`` still sends goes
                        # nowhere; ``me`` is still read: its answer may be queued unread
                        me.out.clear()
                        me.shut = peer.eof = True
                        continue
                    del me.out[:sent]
    except OSError:
        pass
    finally:
        for s in sides:
            with contextlib.suppress(OSError):
                s.sock.close()


def _gone(side: _Side) -> None:
    """Reading ``side``'s socket failed (a reset): nothing more comes from it and nothing
    more reaches it (what is queued for it is dropped); the other side still gets what
    it sent."""
    side.eof = side.shut = True
    side.out.clear()


def _cut(socks: set[socket.socket]) -> None:
    """Shut both directions of every socket in ``socks`` down (from any thread): the
    thread splicing them sees the end at once and closes them. A socket already closed
    has no descriptor left, so this can never touch one reused by another connection."""
    for s in socks:
        with contextlib.suppress(OSError):
            socket.socket.shutdown(s, socket.SHUT_RDWR)


def _accept_loop(sock: socket.socket, serve: Callable[[socket.socket, _Slot], None], *,
                 closed: Callable[[], bool],
                 admit: Callable[[socket.socket, object], _Slot | None],
                 unadmit: Callable[[_Slot], None]) -> None:
    """Accept until ``sock`` closes: a connection ``admit`` takes (under its owner's caps,
    given the peer's address) gets a serving thread with its slot; one it refuses is
    closed at once, with no thread spawned; one whose thread cannot start is closed and
    its slot given back (``unadmit``)."""
    while not closed():
        try:
            conn, addr = sock.accept()
        except OSError:
            return
        slot = admit(conn, addr)
        if slot is None:
            conn.close()
            continue
        try:
            threading.Thread(target=serve, args=(conn, slot), daemon=True).start()
        except RuntimeError:  # no thread to be had: refuse, do not die
            conn.close()
            unadmit(slot)


class _Slot:
    """One admitted connection while it has no valid ticket yet: its source address and
    the socket to cut if a newer connection takes its slot."""

    __slots__ = ("sock", "source")

    def __init__(self, sock: socket.socket, source: str) -> None:
        self.sock = sock
        self.source = source


def _recv_exactly(conn: socket.socket, n: int, deadline: float) -> bytes:
    got = b""
    while len(got) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        conn.settimeout(left)
        part = conn.recv(n - len(got))
        if not part:
            break
        got += part
    return got


class HeadForwarder:
    """TLS listener on the head mapping tickets to gateway sockets."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._ctx, self.cert = pin.server_context()
        self._sock = socket.create_server((host, 0))
        self.port = int(self._sock.getsockname()[1])
        self._routes: dict[bytes, Path] = {}
        self._live: Counter[bytes] = Counter()
        self._conns: dict[bytes, set[socket.socket]] = {}
        """The sockets (node side and gateway side) of each ticket's live connections."""
        self._slots: dict[_Slot, None] = {}
        """Connections without a valid ticket yet, oldest first."""
        self._per_source: Counter[str] = Counter()
        self._refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="cbx-relay-head").start()

    @property
    def _pending(self) -> int:
        return len(self._slots)

    def add(self, socket_path: Path, token: bytes) -> Ticket:
        secret = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._routes[secret] = socket_path
        return Ticket(self.host, self.port, secret, self.cert, token)

    def remove(self, ticket: Ticket) -> None:
        """No new connection for ``ticket``, and its live ones are shut down."""
        with self._lock:
            self._routes.pop(ticket.secret, None)
            live = set(self._conns.get(ticket.secret, ()))
        _cut(live)

    def live(self) -> int:
        """Connections relayed right now (all tickets)."""
        with self._lock:
            return sum(self._live.values())

    def refusals(self) -> dict[str, int]:
        """Connections closed unserved, by reason: ``source`` (its address already holds
        :data:`MAX_PENDING_PER_SOURCE` connections without a ticket), ``evicted`` (without
        a ticket yet, its slot taken by a newer connection while all were taken),
        ``pending`` (no thread could be started for it), ``tls`` (no TLS handshake in
        time, or a failed one), ``ticket`` (none valid in time), ``per_ticket`` (its
        ticket already has the most live connections)."""
        with self._lock:
            return dict(self._refused)

    def _accept(self) -> None:
        _accept_loop(self._sock, self._serve, closed=lambda: self._closed,
                     admit=self._take_slot, unadmit=self._give_slot)

    def _take_slot(self, conn: socket.socket, addr: object) -> _Slot | None:
        source = str(addr[0]) if isinstance(addr, tuple) and addr else "?"
        with self._lock:
            if self._per_source[source] >= MAX_PENDING_PER_SOURCE:
                self._refused["source"] += 1
                return None
            if len(self._slots) >= MAX_PENDING:
                # the oldest connection without a ticket gives its slot up: a flood cannot
                # hold every slot against a node that completes its handshake in time
                oldest = next(iter(self._slots))
                self._free(oldest)
                self._refused["evicted"] += 1
                _cut({oldest.sock})
            slot = _Slot(conn, source)
            self._slots[slot] = None
            self._per_source[source] += 1
            return slot

    def _free(self, slot: _Slot) -> None:
        """Give ``slot`` back (under the lock); a slot given back twice counts once."""
        if self._slots.pop(slot, False) is None:
            self._per_source[slot.source] -= 1
            if self._per_source[slot.source] <= 0:
                del self._per_source[slot.source]

    def _give_slot(self, slot: _Slot) -> None:
        with self._lock:
            self._free(slot)
            self._refused["pending"] += 1

    def _admit(self, given: bytes, sock: socket.socket, slot: _Slot
               ) -> tuple[bytes, Path] | str:
        """The route and a live slot for ``given`` (``sock`` is then shut down with the
        ticket, and its pending slot given back: it can no longer be evicted), or the
        refusal reason."""
        with self._lock:
            if slot not in self._slots:
                return "evicted"
            for secret, path in self._routes.items():
                if hmac.compare_digest(secret, given):
                    if self._live[secret] >= MAX_PER_TICKET:
                        return "per_ticket"
                    self._live[secret] += 1
                    self._conns.setdefault(secret, set()).add(sock)
                    self._free(slot)
                    return secret, path
        return "ticket"

    def _attach(self, secret: bytes, sock: socket.socket) -> bool:
        """Shut ``sock`` down with its ticket; False when the ticket is already gone."""
        with self._lock:
            if secret not in self._routes:
                return False
            self._conns.setdefault(secret, set()).add(sock)
            return True

    def _release(self, secret: bytes, socks: tuple[socket.socket, ...]) -> None:
        with self._lock:
            self._live[secret] -= 1
            if self._live[secret] <= 0:
                del self._live[secret]
            conns = self._conns.get(secret)
            if conns is not None:
                conns.difference_update(socks)
                if not conns:
                    del self._conns[secret]

    def _open(self, conn: socket.socket, slot: _Slot
              ) -> tuple[ssl.SSLSocket, bytes, Path] | None:
        """Handshake and ticket within the deadline, then a live slot, or None (closed)."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        reason = "tls"
        sock = conn
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)  # the handshake's whole deadline
            # wrap_socket detaches ``conn``: from here on ``tls`` owns the descriptor
            with self._lock:
                if slot not in self._slots:  # evicted before it was wrapped
                    raise OSError("evicted")
                sock = tls = self._ctx.wrap_socket(conn, server_side=True,
                                                   do_handshake_on_connect=False)
                slot.sock = tls  # an eviction now cuts the TLS socket
            tls.do_handshake()
            reason = "ticket"
            got = self._admit(_recv_exactly(tls, TICKET_BYTES, deadline), tls, slot)
        except (OSError, ValueError):
            got = reason
        if isinstance(got, str):
            with self._lock:
                if slot in self._slots:  # else already counted as evicted
                    self._refused[got] += 1
            with contextlib.suppress(OSError):
                sock.close()
            return None
        return tls, got[0], got[1]

    def _serve(self, conn: socket.socket, slot: _Slot) -> None:
        try:
            opened = self._open(conn, slot)
        finally:
            with self._lock:
                self._free(slot)
        if opened is None:
            return
        tls, secret, path = opened
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                up.settimeout(CONNECT_TIMEOUT_S)
                up.connect(str(path))
                if not self._attach(secret, up):  # removed meanwhile
                    raise OSError("ticket removed")
            except OSError:
                up.close()
                with contextlib.suppress(OSError):
                    tls.close()
                return
            _splice(tls, up)
        finally:
            self._release(secret, (tls, up))

    def close(self) -> None:
        """Stop listening and shut down every live connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            self._routes.clear()
            live = {s for socks in self._conns.values() for s in socks}
        _cut(live)


class NodeRelay:
    """A unix socket in ``directory`` (with the token file beside it, as the gateway
    lays them out) whose connections are forwarded to the head."""

    def __init__(self, directory: Path, ticket: Ticket, *, uid: int, socket_name: str,
                 token_name: str) -> None:
        self.ticket = ticket
        self._ctx = pin.client_context(ticket.cert)
        path = directory / socket_name
        if len(os.fsencode(path)) > SOCKET_PATH_MAX:
            raise SandboxError(f"relay socket path {path} is longer than {SOCKET_PATH_MAX} "
                               "bytes (the unix socket limit). Fix: set CYCLEBOX_RAY_NODE_DIR "
                               "on the node to a short directory")
        directory.mkdir(mode=0o700)
        token = directory / token_name
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(ticket.token)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o600)
        if os.getuid() == 0 and uid != 0:
            for p in (directory, token, path):
                os.chown(p, uid, uid)
        self._sock.listen(64)
        self._live = 0
        self._conns: set[socket.socket] = set()
        """Both sockets of every live connection (shut down by :meth:`close`)."""
        self._refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="cbx-relay-node").start()

    def refusals(self) -> dict[str, int]:
        """Container connections closed unserved: ``busy`` (at the live cap), ``head``
        (the head could not be reached or did not present the pinned certificate)."""
        with self._lock:
            return dict(self._refused)

    def _accept(self) -> None:
        _accept_loop(self._sock, self._serve, closed=lambda: self._closed,
                     admit=self._take_slot, unadmit=self._give_slot)

    def _take_slot(self, conn: socket.socket, addr: object) -> _Slot | None:
        with self._lock:
            if self._live < MAX_NODE_CONNECTIONS:
                self._live += 1
                return _Slot(conn, "container")
            self._refused["busy"] += 1
            return None

    def _give_slot(self, slot: _Slot) -> None:
        with self._lock:
            self._live -= 1
            self._refused["busy"] += 1

    def _connect(self) -> ssl.SSLSocket:
        up: socket.socket = socket.create_connection((self.ticket.host, self.ticket.port),
                                                     timeout=CONNECT_TIMEOUT_S)
        try:
            # the handshake's whole deadline is the connect timeout
            up = self._ctx.wrap_socket(up, server_hostname=pin.SERVER_NAME)
            pin.check_peer(up, self.ticket.cert)
            up.sendall(self.ticket.secret)
        except (OSError, ValueError):
            up.close()  # wrap_socket detached the plain socket into the TLS one
            raise
        return up

    def live(self) -> int:
        """Container connections relayed right now."""
        with self._lock:
            return self._live

    def _attach(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._conns.add(sock)
            return True

    def _serve(self, conn: socket.socket, slot: _Slot) -> None:
        up: socket.socket | None = None
        try:
            if not self._attach(conn):
                with contextlib.suppress(OSError):
                    conn.close()
                return
            try:
                up = self._connect()
                if not self._attach(up):  # closed meanwhile
                    raise OSError("relay closed")
            except (OSError, ValueError):
                with self._lock:
                    if not self._closed:
                        self._refused["head"] += 1
                for s in (conn, up):
                    if s is not None:
                        with contextlib.suppress(OSError):
                            s.close()
                return
            _splice(conn, up)
        finally:
            with self._lock:
                self._live -= 1
                self._conns.discard(conn)
                if up is not None:
                    self._conns.discard(up)

    def close(self) -> None:
        """Stop listening and shut down every live connection (the run is over)."""
        with self._lock:
            self._closed = True
            live = set(self._conns)
        with contextlib.suppress(OSError):
            self._sock.close()
        _cut(live)
