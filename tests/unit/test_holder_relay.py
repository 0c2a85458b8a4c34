"""The holder's loopback relay, in-process against a plain unix-socket server: bytes
unchanged both ways, half-close kept, connections and buffers bounded, the port not
shareable, no thread of its own. The same code runs as PID 1 in every model-calling
container (tests/integration, tests/security attack it there); here a test thread
steps it as the holder's loop does."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox import holder
from tests.fixtures.refuser import REFUSAL, Refuser


class Echo:
    """A unix-socket server that echoes each connection (upper-cased, so a relay that
    answered by itself would show) and counts connections open at once."""

    def __init__(self, path: Path, *, hold: threading.Event | None = None) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(256)
        self.open = 0
        self.peak = 0
        self.total = 0
        self.hold = hold
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.open += 1
                self.total += 1
                self.peak = max(self.peak, self.open)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        counted = True
        try:
            if self.hold is not None:
                self.hold.wait(30)
            while data := c.recv(1 << 16):
                c.sendall(data.upper())
            # un-counted before the relay can see the end (and connect the next one)
            counted = self._ended()
            c.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            c.close()
            if counted:
                self._ended()

    def _ended(self) -> bool:
        with self.lock:
            self.open -= 1
        return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="cbx-relay-"))  # unix socket paths are short
    try:
        yield d
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def relay_start(target: str, **kw: object) -> int:
    relay = holder.relay_open(target, **kw)  # type: ignore[arg-type]

    def loop() -> None:
        while not relay.broken:
            relay.step(holder.SIGNAL_POLL_MS)

    threading.Thread(target=loop, daemon=True).start()
    return relay.port


def roundtrip(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        got = bytearray()

        def reader() -> None:
            while chunk := c.recv(1 << 16):
                got.extend(chunk)

        t = threading.Thread(target=reader)
        t.start()
        c.sendall(data)
        c.shutdown(socket.SHUT_WR)  # half-close: the answer must still come back
        t.join(20)
        return bytes(got)


def read_to_end(c: socket.socket) -> bytes:
    """What arrives on ``c`` until its end (a reset after the answer ends it too)."""
    got = bytearray()
    with contextlib.suppress(ConnectionResetError):
        while chunk := c.recv(1 << 16):
            got.extend(chunk)
    return bytes(got)


def test_bytes_pass_unchanged_both_ways_with_half_close(short_tmp: Path) -> None:
    echo = Echo(short_tmp / "g.sock")
    port = relay_start(str(echo.path), port=0)
    assert roundtrip(port, b"POST /v1/chat hello\r\n\r\n{}") == b"POST /V1/CHAT HELLO\r\n\r\n{}"
    big = os.urandom(3 << 20).hex().encode()  # 6 MiB: far past the per-direction buffer
    assert roundtrip(port, big) == big.upper()
    echo.close()


def test_connections_are_bounded_and_queued_not_dropped(short_tmp: Path) -> None:
    release = threading.Event()
    echo = Echo(short_tmp / "g.sock", hold=release)
    port = relay_start(str(echo.path), port=0, max_connections=4)
    clients = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(12)]
    time.sleep(0.5)
    assert echo.open == 4, "the relay must hold at most max_connections upstream"
    for i, c in enumerate(clients):
        c.sendall(b"c%d" % i)
        c.shutdown(socket.SHUT_WR)
    release.set()
    # the queued ones are served as slots free up, each its own answer
    for i, c in enumerate(clients):
        assert c.recv(100) == b"C%d" % i
        c.close()
    assert echo.peak == 4 and echo.total == 12
    echo.close()


def test_a_client_that_never_reads_holds_only_its_buffers(short_tmp: Path) -> None:
    echo = Echo(short_tmp / "g.sock")
    port = relay_start(str(echo.path), port=0, max_connections=2, buffer=4096)
    stuck = socket.create_connection(("127.0.0.1", port), timeout=10)
    stuck.setblocking(False)
    sent = 0
    with contextlib.suppress(BlockingIOError):
        for _ in range(10_000):
            sent += stuck.send(b"x" * 65536)
    assert sent < 64 << 20, "back-pressure must reach the writer"
    # the other slot still works
    assert roundtrip(port, b"ok") == b"OK"
    stuck.close()
    assert roundtrip(port, b"again") == b"AGAIN"
    echo.close()


def test_gateway_gone_closes_the_client(short_tmp: Path) -> None:
    port = relay_start(str(short_tmp / "missing.sock"), port=0)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        assert c.recv(10) == b""


@pytest.mark.parametrize("opt", [None, "SO_REUSEADDR", "SO_REUSEPORT"])
@pytest.mark.parametrize("addr", ["127.0.0.1", "0.0.0.0"])
def test_the_port_cannot_be_shared(short_tmp: Path, opt: str | None, addr: str) -> None:
    echo = Echo(short_tmp / "g.sock")
    port = relay_start(str(echo.path), port=0)
    thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if opt:
        thief.setsockopt(socket.SOL_SOCKET, getattr(socket, opt), 1)
    with pytest.raises(OSError, match="in use"):
        thief.bind((addr, port))
    thief.close()
    echo.close()


def test_a_taken_port_is_an_error_not_a_second_listener(short_tmp: Path) -> None:
    first = socket.socket()
    first.bind(("127.0.0.1", 0))
    first.listen()
    with pytest.raises(OSError):
        relay_start(str(short_tmp / "g.sock"), port=first.getsockname()[1])
    first.close()


def test_the_relay_starts_no_thread(short_tmp: Path) -> None:
    """The holder stays one thread (every signal blocked in it; under gVisor with the OCI
    seccomp profile PID 1 cannot create a thread at all)."""
    code = (
        "import os, socket, sys\n"
        f"sys.path.insert(0, {str(Path(holder.__file__).parent.parent)!r})\n"
        "from sandbox import holder\n"
        f"r = holder.relay_open({str(short_tmp / 'g.sock')!r}, port=0)\n"
        "c = socket.create_connection(('127.0.0.1', r.port))\n"
        "for _ in range(5): r.step(10)\n"
        "print(len(os.listdir('/proc/self/task')), len(r.conns))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                         text=True, check=True, timeout=30).stdout.split()
    assert out == ["1", "0"]  # one thread; the connection closed (no gateway there)


def test_a_failing_relay_is_broken_not_raising(short_tmp: Path) -> None:
    relay = holder.relay_open(str(short_tmp / "g.sock"), port=0)
    relay.lsock.close()  # poll on a closed listener: the round fails
    relay.poller = None  # type: ignore[assignment]
    relay.step(10)
    assert relay.broken


def test_an_answer_sent_before_the_gateway_stopped_reading_reaches_the_client(
        short_tmp: Path) -> None:
    """The gateway refuses from the head and closes with the body unread. The relay's
    next write to it fails and its next read is a reset; the answer it already holds
    (or still has to read) goes to the client all the same, every time (fails when a
    gateway-side error drops the connection with the answer in it)."""
    gw = Refuser(short_tmp / "g.sock")
    port = relay_start(str(gw.path), port=0, buffer=1024)  # the body crosses in pieces
    head = b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 262144\r\n\r\n"
    for _ in range(40):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            with contextlib.suppress(OSError):  # the write may fail: httpx reads on
                c.sendall(head + b"x" * 262144)
            got = read_to_end(c)
            assert bytes(got) == REFUSAL
    gw.close()


def test_a_client_still_writing_gets_a_large_answer_whole(short_tmp: Path) -> None:
    """A client that writes its whole body before it reads (httpx does) while the gateway
    has answered from the head and stopped reading: the relay keeps reading and
    discarding the rest of the body for a bounded time (a lingering close), so its
    close does not reset the connection with the answer's tail still unsent (fails
    when the relay closes the client as soon as the answer is handed to the kernel)."""
    body = b"x" * (4 << 20)
    answer = (b"HTTP/1.1 413 Payload Too Large\r\nconnection: close\r\n"
              b"content-length: %d\r\n\r\n" % 100000) + b"a" * 100000
    gw = Refuser(short_tmp / "g.sock", answer)
    port = relay_start(str(gw.path), port=0)
    head = b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: %d\r\n\r\n" % len(body)
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
            with contextlib.suppress(OSError):
                c.sendall(head + body)
            got = read_to_end(c)
            assert len(got) == len(answer) and bytes(got) == answer
    gw.close()


def test_a_lingering_client_is_closed_after_its_bound(short_tmp: Path) -> None:
    """The lingering close is bounded: a client that keeps writing after the answer is
    closed once it sent more than LINGER_BYTES (or after LINGER_S), and its slot frees."""
    gw = Refuser(short_tmp / "g.sock")
    port = relay_start(str(gw.path), port=0, max_connections=1)
    c = socket.create_connection(("127.0.0.1", port), timeout=20)
    c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 99999999999\r\n\r\n")
    t0 = time.monotonic()
    sent = 0
    with contextlib.suppress(OSError):
        while time.monotonic() - t0 < 30:
            sent += c.send(b"x" * 65536)
    assert sent <= holder.LINGER_BYTES + (16 << 20)  # what kernel buffers hold besides
    c.close()
    # the one slot is free again: the next connection gets its answer
    with socket.create_connection(("127.0.0.1", port), timeout=20) as d:
        d.sendall(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}")
        got = read_to_end(d)
        assert bytes(got) == REFUSAL
    gw.close()


def test_an_idle_client_is_closed_after_linger_s(short_tmp: Path) -> None:
    """After the gateway's side ended, a client that neither sends nor closes holds its
    slot at most LINGER_S (fails when the lingering close has no time bound)."""
    gw = Refuser(short_tmp / "g.sock")
    relay = holder.relay_open(str(gw.path), port=0)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            relay.step(holder.SIGNAL_POLL_MS)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    with socket.create_connection(("127.0.0.1", relay.port), timeout=20) as c:
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}")
        got = bytearray()
        while len(got) < len(REFUSAL):
            got.extend(c.recv(1 << 16))
        assert bytes(got) == REFUSAL
        deadline = time.monotonic() + holder.LINGER_S + 10
        while relay.conns and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not relay.conns, "a lingering client must be closed after LINGER_S"
        assert c.recv(10) == b""
    stop.set()
    t.join(5)
    gw.close()


def test_a_stale_gateway_event_does_not_end_the_lingering_close(short_tmp: Path) -> None:
    """The round that starts a lingering close (the answer's tail sent on the client's
    event) can still hold an event for the gateway's socket it just closed: that event is
    stale and must not close the client with the tail in the kernel (fails when the
    events loop handles it). From an attacker's review; buffer sizes force the order."""
    answer = (b"HTTP/1.1 413 x\r\nconnection: close\r\ncontent-length: 40000\r\n\r\n"
              + b"a" * 40000)
    gw = Refuser(short_tmp / "g.sock", answer)
    relay = holder.relay_open(str(gw.path), port=0)
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client slow to read
    c.connect(("127.0.0.1", relay.port))
    relay.step(5)
    conn = relay.conns[0]
    conn.up.src.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    c.sendall(b"POST / HTTP/1.1\r\ncontent-length: 99999999\r\n\r\n")
    for _ in range(200):
        if conn.down.eof:
            break
        relay.step(5)  # the gateway answers and ends; the client reads nothing yet
    assert conn.down.eof and conn.down.buf and not conn.up.buf  # the answer's tail held
    c.send(b"x" * 1000)  # the client goes on with its body...
    relay.step(5)
    assert conn.up.buf  # ...held for the gateway: its fd polled for POLLOUT next round
    c.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        c.send(b"y" * 300000)  # more than the relay reads in one round
    c.settimeout(10)
    conn.up.src.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    got, errors = bytearray(), []

    def reader() -> None:
        try:
            while chunk := c.recv(1 << 16):
                got.extend(chunk)
        except OSError as exc:
            errors.append(exc)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    time.sleep(0.2)
    relay.step(5)  # client event: the tail goes, lingering starts; then the gateway's entry
    assert conn in relay.conns, "closed in the round its lingering began"
    for _ in range(200):
        relay.step(5)
        if not relay.conns:
            break
    t.join(5)
    assert not errors and bytes(got) == answer
    c.close()
    gw.close()
