"""The gateway relay over real sockets, without Ray: TLS pinned to the head's ephemeral
certificate, the ticket inside TLS, and the caps on every count a peer drives.

The test plays the container (a unix client of the node relay socket), the node (a
pinned TLS client of the head) and the network (a TCP proxy that records every byte).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from runner.isolation.ray import pin, relay
from runner.isolation.ray.relay import (
    MAX_NODE_CONNECTIONS,
    MAX_PENDING,
    MAX_PENDING_PER_SOURCE,
    MAX_PER_TICKET,
    HeadForwarder,
    NodeRelay,
    Ticket,
)
from tests.fixtures.refuser import REFUSAL, Refuser

PROMPT = b"POST /v1/chat/completions {'prompt': 'the-secret-prompt-7f3a'}"


@pytest.fixture()
def gateway(tmp_path: Path) -> Iterator[Path]:
    """A unix socket echoing every connection's bytes back, many connections at once."""
    path = tmp_path / "gw.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(128)

    def echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while chunk := conn.recv(65536):
                conn.sendall(chunk)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield path
    srv.close()


@pytest.fixture()
def head() -> Iterator[HeadForwarder]:
    forwarder = HeadForwarder("127.0.0.1")
    yield forwarder
    forwarder.close()


@pytest.fixture()
def opened() -> Iterator[list[socket.socket]]:
    """Client sockets a test opens, closed after it."""
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()


def node_relay(tmp_path: Path, ticket: Ticket, name: str = "g") -> NodeRelay:
    return NodeRelay(tmp_path / name, ticket, uid=os.getuid(), socket_name="gateway.sock",
                     token_name="token")


def container(tmp_path: Path, name: str = "g") -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(5)
    c.connect(str(tmp_path / name / "gateway.sock"))
    return c


def node(ticket: Ticket, *, cert: bytes | None = None, port: int | None = None
         ) -> ssl.SSLSocket:
    """What a node relay does: a TLS connection trusting only ``cert`` (the ticket's)."""
    ctx = pin.client_context(cert or ticket.cert)
    raw = socket.create_connection((ticket.host, port or ticket.port), timeout=5)
    return ctx.wrap_socket(raw, server_hostname=pin.SERVER_NAME)


def round_trip(s: socket.socket, data: bytes) -> bytes:
    """Send ``data``, half-close, read to EOF."""
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    return reply


def ping(s: socket.socket) -> bool:
    """The connection is served: an echo comes back."""
    got = b""
    with contextlib.suppress(OSError):
        s.sendall(b"ping")
        while len(got) < 4 and (chunk := s.recv(4 - len(got))):
            got += chunk
    return got == b"ping"


def closed_unanswered(s: socket.socket, within: float = 2.0) -> bool:
    """Closed by the other end within ``within`` s without a byte of reply."""
    s.settimeout(within)
    try:
        return s.recv(100) == b""
    except (ConnectionResetError, ssl.SSLEOFError):
        return True
    except TimeoutError:
        return False


def still_open(s: socket.socket, wait: float = 0.3) -> bool:
    s.settimeout(wait)
    try:
        s.recv(1)
    except TimeoutError:
        return True
    except OSError:
        return False
    return False


def eventually(check: Callable[[], bool], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


class Tap:
    """A TCP proxy between node and head keeping every byte it forwards."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._srv.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                with self._lock:
                    self.seen += chunk
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._srv.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()
            threading.Thread(target=self._pipe, args=(b, a), daemon=True).start()

    def close(self) -> None:
        self._srv.close()


# -- the link ----------------------------------------------------------------------------

def test_a_request_crosses_node_and_head_over_tls_pinned_to_the_heads_own_certificate(
        tmp_path: Path, gateway: Path, head: HeadForwarder) -> None:
    ticket = head.add(gateway, b"per-binding-token")
    cert = x509.load_pem_x509_certificate(ticket.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [pin.SERVER_NAME]
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.not_valid_after_utc - dt.datetime.now(dt.UTC) <= dt.timedelta(days=31)
    assert b"PRIVATE" not in ticket.cert
    # each head process has its own key
    other = HeadForwarder("127.0.0.1")
    other.close()
    assert other.cert != head.cert
    relay_ = node_relay(tmp_path, ticket)
    try:
        with container(tmp_path) as c:
            assert round_trip(c, PROMPT) == PROMPT
        # larger than every buffer, both ways at once
        big = os.urandom(3 * 1024 * 1024)
        with container(tmp_path) as c:
            assert round_trip(c, big) == big
        with node(ticket) as n:
            assert n.version() in ("TLSv1.2", "TLSv1.3")
            n.sendall(ticket.secret)
            assert ping(n)
    finally:
        relay_.close()


def test_the_network_between_node_and_head_sees_neither_prompt_nor_ticket_nor_token(
        tmp_path: Path, gateway: Path, head: HeadForwarder) -> None:
    ticket = head.add(gateway, b"per-binding-token")
    tap = Tap((ticket.host, ticket.port))
    try:
        relay_ = node_relay(tmp_path, dataclasses.replace(ticket, port=tap.port))
        try:
            with container(tmp_path) as c:
                # the container presents the binding token to the gateway, as it must
                request = PROMPT + b" Authorization: Bearer per-binding-token"
                assert round_trip(c, request) == request
        finally:
            relay_.close()
        assert eventually(lambda: len(tap.seen) > len(PROMPT))
        seen = bytes(tap.seen)
        assert seen[:1] == b"\x16"  # a TLS handshake record opens the stream
        for clear in (b"the-secret-prompt-7f3a", b"per-binding-token", ticket.secret,
                      ticket.secret[:8]):
            assert clear not in seen
    finally:
        tap.close()


def test_plain_tcp_and_a_wrongly_pinned_client_get_nothing(
        tmp_path: Path, gateway: Path, head: HeadForwarder,
        opened: list[socket.socket]) -> None:
    ticket = head.add(gateway, b"token")
    # the right ticket in clear is not enough
    raw = socket.create_connection((ticket.host, ticket.port), timeout=5)
    opened.append(raw)
    raw.sendall(ticket.secret + PROMPT)
    assert closed_unanswered(raw)
    # a node trusting another certificate refuses this head (a head it did not pin)
    stranger, _ = pin.make_certificate()
    with pytest.raises(ssl.SSLCertVerificationError):
        node(ticket, cert=stranger)
    # and a node relay holding such a ticket forwards nothing to it
    relay_ = node_relay(tmp_path, dataclasses.replace(ticket, cert=stranger))
    try:
        c = container(tmp_path)
        opened.append(c)
        c.sendall(PROMPT)
        assert closed_unanswered(c)
        assert relay_.refusals() == {"head": 1}
    finally:
        relay_.close()
    assert head.refusals().get("ticket", 0) == 0


def test_a_wrong_or_removed_ticket_is_closed_unanswered(
        gateway: Path, head: HeadForwarder) -> None:
    ticket = head.add(gateway, b"token")
    with node(ticket) as n:
        n.sendall(bytes(b ^ 1 for b in ticket.secret) + b"ping")
        assert closed_unanswered(n)
    head.remove(ticket)
    with node(ticket) as n:
        n.sendall(ticket.secret + b"ping")
        assert closed_unanswered(n)
    assert head.refusals() == {"ticket": 2}


# -- the caps ----------------------------------------------------------------------------

def _from(source: str, port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), source_address=(source, 0))


def test_one_source_holds_at_most_its_share_of_pending_slots_and_a_node_gets_in(
        gateway: Path, head: HeadForwarder, opened: list[socket.socket],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay, "HANDSHAKE_TIMEOUT_S", 3.0)
    opened += [_from("127.0.0.2", head.port) for _ in range(MAX_PENDING_PER_SOURCE)]
    assert eventually(lambda: head._pending == MAX_PENDING_PER_SOURCE)
    threads = threading.active_count()
    extra = [_from("127.0.0.2", head.port) for _ in range(3)]
    opened.extend(extra)
    assert all(closed_unanswered(s, within=1.0) for s in extra)
    assert head.refusals() == {"source": 3}
    assert threading.active_count() <= threads  # no thread for a refused connection
    assert still_open(opened[0])
    ticket = head.add(gateway, b"token")
    with node(ticket) as n:  # from 127.0.0.1: not held back by 127.0.0.2's flood
        n.sendall(ticket.secret)
        assert ping(n)
    # the idle ones are cut at the handshake deadline (handshake and ticket, not per read)
    started = time.monotonic()
    assert closed_unanswered(opened[0], within=5.0)
    assert time.monotonic() - started < 4.0
    assert eventually(lambda: head.refusals().get("tls") == MAX_PENDING_PER_SOURCE)
    assert eventually(lambda: head._pending == 0)


def test_a_flood_from_many_sources_cannot_keep_a_node_out(
        gateway: Path, head: HeadForwarder, opened: list[socket.socket]) -> None:
    """Every pending slot held by idle connections from many addresses: a node still gets
    through at once (it takes the oldest idle connection's slot), and stays served."""
    n_sources = MAX_PENDING // MAX_PENDING_PER_SOURCE
    for i in range(MAX_PENDING):
        opened.append(_from(f"127.0.1.{2 + i % n_sources}", head.port))
    assert eventually(lambda: head._pending == MAX_PENDING)
    ticket = head.add(gateway, b"token")
    started = time.monotonic()
    with node(ticket) as n:
        n.sendall(ticket.secret)
        assert ping(n)
        assert time.monotonic() - started < relay.HANDSHAKE_TIMEOUT_S
        assert head.refusals() == {"evicted": 1}
        assert closed_unanswered(opened[0], within=1.0)  # the oldest idle one was cut
        # more flood cannot cut a connection that presented its ticket
        opened += [_from("127.0.2.2", head.port) for _ in range(MAX_PENDING_PER_SOURCE)]
        # (the node's slot was given back when its ticket was admitted: 1 + 7 evictions)
        assert eventually(lambda: head.refusals().get("evicted") == MAX_PENDING_PER_SOURCE)
        assert ping(n)
    assert eventually(lambda: head._pending <= MAX_PENDING)


def test_the_heads_handshake_deadline_is_short() -> None:
    """An idle unauthenticated connection holds a slot seconds, not ~10 s (a node's
    handshake and ticket take milliseconds: bench/relay_flood.py)."""
    assert relay.HANDSHAKE_TIMEOUT_S <= 2.0


def test_a_ticket_trickled_in_is_cut_at_the_deadline(
        gateway: Path, head: HeadForwarder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay, "HANDSHAKE_TIMEOUT_S", 1.0)
    ticket = head.add(gateway, b"token")
    with node(ticket) as n:
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for b in ticket.secret:
                n.sendall(bytes([b]))
                time.sleep(0.1)
        assert closed_unanswered(n, within=3.0)
        assert time.monotonic() - started < 2.5
    assert head.refusals() == {"ticket": 1}


def test_one_ticket_gets_at_most_its_share_of_live_connections(
        gateway: Path, head: HeadForwarder, opened: list[socket.socket]) -> None:
    ticket = head.add(gateway, b"token")
    live = []
    for _ in range(MAX_PER_TICKET):
        n = node(ticket)
        opened.append(n)
        n.sendall(ticket.secret)
        assert ping(n)
        live.append(n)
    extra = node(ticket)
    opened.append(extra)
    extra.sendall(ticket.secret + b"ping")
    assert closed_unanswered(extra)
    assert head.refusals() == {"per_ticket": 1}
    assert all(ping(n) for n in live)
    # another ticket is not starved by this one
    other = head.add(gateway, b"token2")
    with node(other) as n:
        n.sendall(other.secret)
        assert ping(n)
    # a closed connection frees its slot
    live[0].close()

    def admitted() -> bool:
        with node(ticket) as n:
            n.sendall(ticket.secret)
            return ping(n)

    assert eventually(admitted)


def test_a_container_gets_at_most_the_node_relays_share_of_live_connections(
        tmp_path: Path, gateway: Path, head: HeadForwarder,
        opened: list[socket.socket]) -> None:
    ticket = head.add(gateway, b"token")
    relay_ = node_relay(tmp_path, ticket)
    try:
        live = []
        for _ in range(MAX_NODE_CONNECTIONS):
            c = container(tmp_path)
            opened.append(c)
            assert ping(c)
            live.append(c)
        extra = container(tmp_path)
        opened.append(extra)
        assert closed_unanswered(extra, within=1.0)
        assert relay_.refusals() == {"busy": 1}
        assert all(ping(c) for c in live)
        live[0].close()

        def admitted() -> bool:
            c = container(tmp_path)
            opened.append(c)
            return ping(c)

        assert eventually(admitted)
    finally:
        relay_.close()


# -- a connection ends with its run --------------------------------------------------------

def test_removing_a_ticket_shuts_down_its_live_connections_and_their_threads(
        gateway: Path, head: HeadForwarder, opened: list[socket.socket]) -> None:
    """A node (or its container) holding connections open past the run keeps neither a
    head thread nor a gateway connection: the ticket's removal cuts them."""
    before = threading.active_count()
    ticket = head.add(gateway, b"token")
    other = head.add(gateway, b"token2")
    held = []
    for t in (ticket, ticket, other):
        n = node(t)
        opened.append(n)
        n.sendall(t.secret)
        assert ping(n)
        held.append(n)
    head.remove(ticket)
    assert closed_unanswered(held[0]) and closed_unanswered(held[1])
    assert ping(held[2])  # another binding's connection is untouched
    assert eventually(lambda: head.live() == 1)
    head.remove(other)
    assert closed_unanswered(held[2])
    assert eventually(lambda: head.live() == 0)
    # the head's serving threads (and the echo gateway's) are gone with them
    assert eventually(lambda: threading.active_count() <= before)


def test_closing_the_node_relay_shuts_down_the_containers_live_connections(
        tmp_path: Path, gateway: Path, head: HeadForwarder,
        opened: list[socket.socket]) -> None:
    ticket = head.add(gateway, b"token")
    relay_ = node_relay(tmp_path, ticket)
    c = container(tmp_path)
    opened.append(c)
    assert ping(c)
    relay_.close()
    assert closed_unanswered(c)
    assert eventually(lambda: relay_.live() == 0)
    assert eventually(lambda: head.live() == 0)  # the head side ended with it
    assert relay_.refusals() == {}


def test_an_answer_sent_before_the_gateway_stopped_reading_reaches_the_container(
        tmp_path: Path) -> None:
    """The gateway answers from the head and closes with the body unread: the splice's
    next write to it fails (EPIPE) and its read after the answer is a reset. The answer
    still goes to the container, every time (fails when an error on one side ends both
    before the other got what was already read)."""
    srv = Refuser(tmp_path / "refuser.sock")
    head_line = b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 1048576\r\n\r\n"
    try:
        for _ in range(20):
            client, near = socket.socketpair()
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            up.connect(str(srv.path))
            t = threading.Thread(target=relay._splice, args=(near, up), daemon=True)
            t.start()
            client.settimeout(10)
            with contextlib.suppress(OSError):  # the write may fail: an SDK reads on
                client.sendall(head_line + b"x" * (1 << 20))
            got = bytearray()
            with contextlib.suppress(ConnectionResetError):
                while chunk := client.recv(65536):
                    got.extend(chunk)
            client.close()
            t.join(10)
            assert bytes(got) == REFUSAL
            assert not t.is_alive()
    finally:
        srv.close()


def test_the_gateways_answer_queued_unread_still_reaches_the_container() -> None:
    """The container drains slowly, so the splice is not reading the gateway when its
    next write to it fails (the gateway closed with the body unread): the answer still
    queued in the gateway's socket is read and delivered in full (fails when a write
    error stops the splice reading that side)."""
    client, near = socket.socketpair()  # container <-> splice
    gw, up = socket.socketpair()  # gateway <-> splice
    t = threading.Thread(target=relay._splice, args=(near, up), daemon=True)
    t.start()
    client.sendall(b"POST / HTTP/1.1\r\ncontent-length: 99999999\r\n\r\n")
    gw.setblocking(False)
    answer, idle = 0, 0
    while idle < 50:  # answer until every buffer on the way is full
        try:
            answer += gw.send(b"a" * 65536)
            idle = 0
        except BlockingIOError:
            idle += 1
            time.sleep(0.01)
    gw.close()  # with the body unread
    client.sendall(b"x" * 1000)  # the SDK goes on writing its body: that write fails
    client.settimeout(10)
    got = 0
    with contextlib.suppress(ConnectionResetError):
        while chunk := client.recv(65536):
            got += len(chunk)
    t.join(10)
    assert got == answer
    assert not t.is_alive()
    client.close()
