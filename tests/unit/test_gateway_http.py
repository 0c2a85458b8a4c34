"""The gateway's HTTP listener against a fake handler: trailers and pipelined/closed
connections must stay inside the listener's caps (review findings, no docker needed).
Each test runs on the stdlib loop and on uvloop, the loop the gateway runs on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from runner.gateway.config import GatewayLimits
from runner.gateway.http import Head, Listener, Reply

MiB = 1024 * 1024
Run = Callable[[Coroutine[Any, Any, None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    return asyncio.run if request.param == "asyncio" else uvloop.run


class FakeHandler:
    max_body = 4 * MiB

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.sleep_s = sleep_s
        self.running = self.peak = self.calls = 0
        self.refusals: list[tuple[str, Head | None, int]] = []

    def head(self, head: Head) -> Reply | None:
        return None

    async def handle(self, head: Head, body: bytes) -> Reply:
        self.running += 1
        self.calls += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.sleep_s)
        finally:
            self.running -= 1
        return Reply(200, b"{}")

    def refuse(self, head: Head | None, status: int, code: str, message: str,
               received: bytes) -> Reply:
        self.refusals.append((code, head, status))
        return Reply(status, b"{}")


async def _listener(h: FakeHandler, **limits: Any) -> Listener:
    path = os.path.join(tempfile.mkdtemp(dir="/tmp"), "s")
    lst = Listener(path, GatewayLimits(**limits), h)
    await lst.start()
    return lst


CHUNKED = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n")


async def _send_until_closed(path: str, first: bytes, more: bytes,
                             limit: int) -> tuple[bytes, int]:
    """Send ``first`` then ``more`` repeatedly up to ``limit`` bytes; return what the
    server answered (empty if the close reset it) and how much was sent before the
    server stopped reading."""
    r, w = await asyncio.open_unix_connection(path)
    w.write(first)
    sent = 0
    try:
        while sent < limit:
            w.write(more)
            await asyncio.wait_for(w.drain(), 5)
            sent += len(more)
    except (OSError, TimeoutError):
        pass
    try:
        answer = await asyncio.wait_for(r.read(), 5)
    except OSError:
        answer = b""
    w.close()
    return answer, sent


def test_trailer_fields_are_refused_and_not_kept(run: Run) -> None:
    async def main() -> None:
        h = FakeHandler()
        lst = await _listener(h)
        answer, sent = await _send_until_closed(lst.path, CHUNKED + b"1\r\nx\r\n0\r\n",
                                                b"a:b\r\n" * 20000, 20 * MiB)
        assert answer[:13] in (b"", b"HTTP/1.1 400 "), answer[:80]
        assert [c for c, _, _ in h.refusals] == ["bad_http"]
        assert sent < 20 * MiB  # the gateway stopped reading
        assert h.calls == 0
        await lst.close(0)
    run(main())


@pytest.mark.parametrize("name", [b"Authorization", b"x-api-key", b"Content-Length"])
def test_a_credential_or_length_header_given_twice_is_refused(run: Run, name: bytes) -> None:
    """Which of two values counts would be the parser's choice, not the request's."""
    async def main() -> None:
        h = FakeHandler()
        lst = await _listener(h)
        twice = b"".join(name + b": " + v + b"\r\n" for v in (b"2", b"2"))
        r, w = await asyncio.open_unix_connection(lst.path)
        w.write(b"POST /v1/messages HTTP/1.1\r\nHost: a\r\n" + twice
                + (b"" if name == b"Content-Length" else b"Content-Length: 2\r\n")
                + b"\r\n{}")
        answer = await asyncio.wait_for(r.read(), 5)
        w.close()
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:80]
        assert [c for c, _, _ in h.refusals] == ["bad_http"] and h.calls == 0
        await lst.close(0)
    run(main())


def test_one_endless_trailer_field_is_bounded(run: Run) -> None:
    # httptools accumulates a field's bytes itself and reports it only when it ends.
    async def main() -> None:
        h = FakeHandler()
        lst = await _listener(h)
        answer, sent = await _send_until_closed(lst.path, CHUNKED + b"1\r\nx\r\n0\r\na: ",
                                                b"b" * 100_000, 20 * MiB)
        assert answer[:13] in (b"", b"HTTP/1.1 431 "), answer[:80]
        assert [c for c, _, _ in h.refusals] == ["header_too_large"]
        assert sent < 20 * MiB
        await lst.close(0)
    run(main())


def test_chunked_body_in_small_chunks_with_a_large_head_is_served(run: Run) -> None:
    async def main() -> None:
        h = FakeHandler()
        lst = await _listener(h)
        filler = b"X-Fill: " + b"f" * (15 * 1024) + b"\r\n"
        req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n" + filler
               + b"Transfer-Encoding: chunked\r\n\r\n"
               + b"1\r\nx\r\n" * 5000 + b"ffff;ext=1\r\n" + b"y" * 0xFFFF + b"\r\n0\r\n\r\n")
        r, w = await asyncio.open_unix_connection(lst.path)
        w.write(req)
        await w.drain()
        line = await asyncio.wait_for(r.readline(), 5)
        assert line.startswith(b"HTTP/1.1 200 "), (line, h.refusals)
        assert h.calls == 1 and h.refusals == []
        w.close()
        await lst.close(0)
    run(main())


def test_closed_and_pipelined_connections_stay_inside_the_caps(run: Run) -> None:
    """A full 1 MiB request plus one pipelined byte, then close, again and again: the
    handler tasks stay within max_connections, the held bodies within
    max_inflight_bytes, and the pipelining refusal is not charged to the first request."""
    async def main() -> None:
        h = FakeHandler(sleep_s=1.0)
        lst = await _listener(h, max_connections=2, max_inflight_bytes=2 * MiB)
        body = b"x" * MiB
        req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
        peak_held = 0
        for _ in range(8):
            _, w = await asyncio.open_unix_connection(lst.path)
            w.write(req + b"P")
            with contextlib.suppress(OSError):
                await w.drain()
            await asyncio.sleep(0.05)
            w.close()
            peak_held = max(peak_held, h.running * len(body))
            assert lst.inflight >= h.running * len(body), (lst.inflight, h.running)
            assert lst.inflight <= 2 * MiB
        assert h.peak <= 2, h.peak
        assert peak_held <= 2 * MiB
        pipelined = [hd for c, hd, _ in h.refusals if c == "pipelining"]
        assert pipelined and all(hd is None for hd in pipelined)
        assert "too_many_connections" in [c for c, _, _ in h.refusals]
        await asyncio.sleep(1.3)  # the running calls end and free their slots
        assert lst.inflight == 0 and not lst.connections and not lst.tasks
        _, w = await asyncio.open_unix_connection(lst.path)
        w.write(req)
        await w.drain()
        await asyncio.sleep(0.1)
        assert h.running == 1  # a new client is served again
        w.close()
        await lst.close(0)
    run(main())


def test_a_connection_is_not_read_while_its_request_is_handled(run: Run) -> None:
    """Bytes sent behind a request wait in the kernel until its answer is written (the
    listener pauses reading): the answer is 200, and only then is the rest read and
    refused. Read while busy, the junk would be refused first and the answer lost."""
    async def main() -> None:
        h = FakeHandler(sleep_s=0.5)
        lst = await _listener(h)
        r, w = await asyncio.open_unix_connection(lst.path)
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        await w.drain()
        await asyncio.sleep(0.2)  # the request is being handled
        w.write(b"\x00" * 65536)  # not HTTP
        await w.drain()
        line = await asyncio.wait_for(r.readline(), 5)
        assert line.startswith(b"HTTP/1.1 200 "), (line, h.refusals)
        await asyncio.wait_for(r.read(), 5)  # then the junk is read, refused, closed
        assert h.calls == 1 and [c for c, _, _ in h.refusals] == ["bad_http"]
        w.close()
        await lst.close(0)
    run(main())
