"""The holder's deny-all egress proxy, in-process: every request answered 403 at once,
never forwarded, each target named (bounded, escaped) in the holder's status, and the
host's reading of that status bounded again. The same code runs as PID 1 in every bound
container; tests/e2e/test_coding_clis.py shows Codex and Claude Code refused there."""

from __future__ import annotations

import json
import socket
import time

from runner.isolation.docker.channel import egress_refused
from sandbox import holder


def _ask(port: int, egress: holder._Egress, data: bytes) -> bytes:
    c = socket.create_connection(("127.0.0.1", port), timeout=2)
    c.sendall(data)
    got = b""
    deadline = time.monotonic() + 2
    c.setblocking(False)
    while time.monotonic() < deadline:
        egress.step()
        try:
            chunk = c.recv(4096)
        except BlockingIOError:
            time.sleep(0.005)
            continue
        except ConnectionResetError:  # closed with bytes it never read
            break
        if not chunk:
            break
        got += chunk
    c.close()
    return got


def test_connect_and_plain_requests_are_refused_and_named() -> None:
    egress = holder.egress_open(port=0)
    port = egress.lsock.getsockname()[1]
    answer = _ask(port, egress, b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert f"content-length: {len(body)}".encode() in head
    _ask(port, egress, b"GET http://user:pw@chatgpt.com/backend/x HTTP/1.1\r\n\r\n")
    _ask(port, egress, b"CONNECT api.anthropic.com:443 HTTP/1.1\r\n\r\n")
    assert egress.hosts == ["api.anthropic.com:443", "chatgpt.com"]
    assert egress.count == 3


def test_a_hostile_target_is_escaped_and_the_list_bounded() -> None:
    egress = holder.egress_open(port=0)
    port = egress.lsock.getsockname()[1]
    _ask(port, egress, b"CONNECT \x1b[31mred\xff;rm" + b"a" * 500 + b" HTTP/1.1\r\n\r\n")
    assert egress.hosts[0].startswith("\\x1b[31mred\\xff\\x3brm")
    assert len(egress.hosts[0]) == holder.EGRESS_HOST_CHARS
    for i in range(holder.EGRESS_MAX_HOSTS + 5):
        _ask(port, egress, f"CONNECT h{i}.example:443 HTTP/1.1\r\n\r\n".encode())
    assert len(egress.hosts) == holder.EGRESS_MAX_HOSTS
    assert egress.count == holder.EGRESS_MAX_HOSTS + 6
    # no request line within the head bound, or none at all: refused as "?"
    egress2 = holder.egress_open(port=0)
    port2 = egress2.lsock.getsockname()[1]
    _ask(port2, egress2, b"x" * (holder.EGRESS_HEAD_BYTES + 10))
    assert egress2.hosts == ["?"]


def test_the_host_bounds_and_escapes_what_the_status_says() -> None:
    status = json.loads(json.dumps({"egress_refused": ["ok.example:443", "\x1b]0;pwn\x07",
                                                      7, "z" * 999] + ["h"] * 40,
                                    "egress_refused_count": True}))
    hosts, count = egress_refused(status)
    assert hosts[:2] == ("ok.example:443", "\\x1b]0;pwn\\x07")
    assert len(hosts[2]) == 120
    assert len(hosts) == 16
    assert count == 16  # a bogus count is never below what was named
    assert egress_refused({}) == ((), 0)
    assert egress_refused({"egress_refused": "x", "egress_refused_count": 5}) == ((), 5)
