"""The gateway relay: credentials stay on the head.

A role container on a node reaches the model through a unix socket in a node-local
directory, as it would locally. Behind that socket is not the gateway but a relay
(:class:`NodeRelay`, in the node's task process) that forwards each connection's bytes
over TCP to the head's :class:`HeadForwarder`, which opens the real gateway socket of
that one binding and pipes the bytes back. The gateway (recording, budget, role to
upstream mapping, the model key) never leaves the head process; the node holds only
the binding's gateway token (worthless outside the run) and a per-binding ticket.

A connection to the forwarder must open with its binding's 32-byte ticket (compared in
constant time); anything else is closed unanswered. The forwarder listens on the head's
node address: on a real cluster that is the private network (see ``docs/ray.md``).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from runner.errors import SandboxError

TICKET_BYTES = 32
CHUNK = 64 * 1024
CONNECT_TIMEOUT_S = 10.0
SOCKET_PATH_MAX = 107
"""sun_path holds 108 bytes including the terminating NUL."""


@dataclass(frozen=True)
class Ticket:
    """What a node needs to reach one binding on the head."""

    host: str
    port: int
    secret: bytes
    token: bytes
    """The binding's gateway token file content (per run and role, not a model key)."""


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Pipe both ways until both directions are closed, then close both."""
    t = threading.Thread(target=_pipe, args=(b, a), daemon=True)
    t.start()
    _pipe(a, b)
    t.join()
    for s in (a, b):
        with contextlib.suppress(OSError):
            s.close()


class HeadForwarder:
    """TCP listener on the head mapping tickets to gateway sockets."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._sock = socket.create_server((host, 0))
        self.port = int(self._sock.getsockname()[1])
        self._routes: dict[bytes, Path] = {}
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="cbx-relay-head").start()

    def add(self, socket_path: Path, token: bytes) -> Ticket:
        secret = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._routes[secret] = socket_path
        return Ticket(self.host, self.port, secret, token)

    def remove(self, ticket: Ticket) -> None:
        with self._lock:
            self._routes.pop(ticket.secret, None)

    def _route(self, given: bytes) -> Path | None:
        with self._lock:
            for secret, path in self._routes.items():
                if hmac.compare_digest(secret, given):
                    return path
        return None

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            given = b""
            while len(given) < TICKET_BYTES:
                part = conn.recv(TICKET_BYTES - len(given))
                if not part:
                    break
                given += part
            path = self._route(given) if len(given) == TICKET_BYTES else None
            if path is None:
                conn.close()
                return
            conn.settimeout(None)
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            up.connect(str(path))
        except OSError:
            with contextlib.suppress(OSError):
                conn.close()
            return
        _splice(conn, up)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()


class NodeRelay:
    """A unix socket in ``directory`` (with the token file beside it, as the gateway
    lays them out) whose connections are forwarded to the head."""

    def __init__(self, directory: Path, ticket: Ticket, *, uid: int, socket_name: str,
                 token_name: str) -> None:
        self.ticket = ticket
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
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="cbx-relay-node").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection((self.ticket.host, self.ticket.port),
                                          timeout=CONNECT_TIMEOUT_S)
            up.settimeout(None)
            up.sendall(self.ticket.secret)
        except OSError:
            with contextlib.suppress(OSError):
                conn.close()
            return
        _splice(conn, up)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
