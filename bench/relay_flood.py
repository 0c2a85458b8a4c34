"""How long a legitimate node waits to reach the head's relay under a flood of idle,
unauthenticated TCP connections (no TLS, no ticket), over real sockets on loopback.

The flood keeps opening plain TCP connections from 127.0.0.2 onwards (other source
addresses than the node's 127.0.0.1) at ``--rate`` per second and leaves them idle; the node,
every ``--every`` s, does what a node relay does (TLS pinned to the head's certificate,
then its ticket, then one echoed request) and retries every 20 ms until one succeeds.
Printed: per attempt, the wait until success (or "gave up" after ``--give-up`` s), and
the median and worst. Bounded: ``--seconds`` of flood, at most ``--max-open`` sockets.

    .venv/bin/python bench/relay_flood.py --rate 50 --seconds 15
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from runner.isolation.ray import pin
from runner.isolation.ray.relay import HeadForwarder, Ticket


def echo_server(path: Path) -> socket.socket:
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
    return srv


def node_once(ticket: Ticket) -> bool:
    ctx = pin.client_context(ticket.cert)
    try:
        raw = socket.create_connection((ticket.host, ticket.port), timeout=2,
                                       source_address=("127.0.0.1", 0))
        with ctx.wrap_socket(raw, server_hostname=pin.SERVER_NAME) as s:
            s.settimeout(2)
            s.sendall(ticket.secret + b"ping")
            got = b""
            while len(got) < 4 and (chunk := s.recv(4 - len(got))):
                got += chunk
            return got == b"ping"
    except (OSError, ValueError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=50.0, help="flood connections per second")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--every", type=float, default=0.5)
    ap.add_argument("--give-up", type=float, default=12.0)
    ap.add_argument("--max-open", type=int, default=2000)
    ap.add_argument("--sources", type=int, default=1,
                    help="flood from this many addresses, 127.0.0.2 onwards, in turn")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cbx-flood-"))
    srv = echo_server(tmp / "gw.sock")
    head = HeadForwarder("127.0.0.1")
    ticket = head.add(tmp / "gw.sock", b"token")
    stop = threading.Event()
    held: list[socket.socket] = []

    def flood() -> None:
        nxt = time.monotonic()
        i = 0
        while not stop.is_set() and len(held) < a.max_open:
            source = f"127.0.{(2 + i % a.sources) // 256}.{(2 + i % a.sources) % 256}"
            i += 1
            with contextlib.suppress(OSError):
                held.append(socket.create_connection(
                    ("127.0.0.1", head.port), timeout=1, source_address=(source, 0)))
            nxt += 1 / a.rate
            time.sleep(max(0.0, nxt - time.monotonic()))

    started = time.monotonic()
    assert node_once(ticket), "no flood: the node must get through"
    took = 1000 * (time.monotonic() - started)
    print(f"no flood: one node handshake + ticket + echo {took:.1f} ms")
    t = threading.Thread(target=flood, daemon=True)
    t.start()
    time.sleep(2.0)  # let the flood fill what it can
    waits: list[float] = []
    gave_up = 0
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        started = time.monotonic()
        while not node_once(ticket):
            if time.monotonic() - started > a.give_up:
                gave_up += 1
                break
            time.sleep(0.02)
        else:
            waits.append(time.monotonic() - started)
        time.sleep(a.every)
    stop.set()
    t.join()
    print(f"flood: {a.rate:g} conn/s from {a.sources} address(es), {len(held)} opened; "
          f"refusals {head.refusals()}")
    if waits:
        print(f"node attempts ok: {len(waits)}, median wait "
              f"{statistics.median(waits) * 1000:.1f} ms, worst {max(waits) * 1000:.1f} ms; "
              f"gave up (> {a.give_up:g} s): {gave_up}")
    else:
        print(f"node attempts ok: 0; gave up (> {a.give_up:g} s): {gave_up}")
    for s in held:
        s.close()
    head.close()
    srv.close()


if __name__ == "__main__":
    main()
