"""A small HTTP/1.1 server on one unix socket per container, holding the limits of
:class:`GatewayLimits` (the gateway's only listener; no uvicorn private state).

Invariants, per binding (one listener):
- at most ``max_connections`` connections; one more is answered 503 and closed; a
  connection stays counted until its request's handler task ends, even if the client
  has gone, so at most ``max_connections`` handler tasks run at once;
- a request head larger than ``max_header_bytes`` or slower than ``header_timeout_s``
  is refused (431/408) before anything else is read; trailers (fields after a chunked
  body) are refused (400), and a message's bytes that are not body (head, chunk lines,
  trailer bytes still inside the parser) are bounded by ``max_header_bytes`` plus a
  small allowance per chunk, so no field data grows without bound;
- the handler sees the head (route, token) *before* any body byte is kept, so a
  refused request costs its head, never its body;
- a body larger than the handler's limit is refused as soon as its length is known,
  and the bodies being read or held never sum to more than ``max_inflight_bytes``;
- the body must arrive within ``body_timeout_s``; requests beyond ``rate_per_s`` /
  ``burst`` and body bytes beyond ``body_bytes_per_s`` / ``body_bytes_burst`` are
  refused (429) before they are parsed;
- while a request is handled the connection is not read, so a container cannot queue
  more data in the controller than the kernel's socket buffer;
- every refusal goes through ``Handler.refuse`` (which records it) with a named code.
A handler exception becomes a recorded 500 (``internal_error``), never a silent drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

import httptools

from runner.gateway.config import GatewayLimits

# Bytes a chunk's own framing may take beyond its data: a size line ("ffffffff\r\n"), the
# CRLF after the data, and room for a short extension.
CHUNK_LINE_ALLOWANCE = 64
TIMER_SLACK_S = 0.005
"""A connection deadline may fire this much early (loop timers are not exact anyway)."""

REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
           404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           413: "Content Too Large", 429: "Too Many Requests", 431:
           "Request Header Fields Too Large", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable"}


@dataclass
class Head:
    """A request's line and headers (names lower-cased, values latin-1)."""

    method: str
    path: str
    headers: dict[str, str]
    content_length: int | None
    keep_alive: bool


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json"
    after: Callable[[], None] | None = None
    """Run right after the reply is written (the handler's recording of the call)."""


class Handler(Protocol):
    """What a listener calls; ``refuse`` records the refusal and returns its reply."""

    max_body: int

    def head(self, head: Head) -> Reply | None:
        """Route and authorize from the head alone; a Reply refuses (already recorded)."""

    async def handle(self, head: Head, body: bytes) -> Reply: ...

    def refuse(self, head: Head | None, status: int, code: str, message: str,
               received: bytes) -> Reply: ...


def encode(reply: Reply, *, keep_alive: bool) -> bytes:
    line = (f"HTTP/1.1 {reply.status} {REASONS.get(reply.status, 'Status')}\r\n"
            f"content-type: {reply.content_type}\r\ncontent-length: {len(reply.body)}\r\n"
            f"{'' if keep_alive else 'connection: close' + chr(13) + chr(10)}\r\n")
    return line.encode("latin-1") + reply.body


class TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens = float(burst)
        self.at = time.monotonic()

    def take(self, n: float = 1) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < n:
            return False
        self.tokens -= n
        return True


@dataclass
class Listener:
    """One socket's server and the state its limits count."""

    path: str
    limits: GatewayLimits
    handler: Handler
    connections: set[Connection] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    inflight: int = 0
    server: asyncio.AbstractServer | None = None

    def __post_init__(self) -> None:
        self.bucket = TokenBucket(self.limits.rate_per_s, self.limits.burst)
        self.bytes = TokenBucket(self.limits.body_bytes_per_s, self.limits.body_bytes_burst)

    def hold(self, n: int) -> tuple[int, str, str] | None:
        """Charge ``n`` body bytes the handler adds to a request (a Responses request's
        referenced items) to the byte rate and hold them as in flight until
        :meth:`unhold`; the refusal (status, code, message) when over either."""
        if not self.bytes.take(n):
            return (429, "byte_rate_limited",
                    f"over {self.limits.body_bytes_per_s} body bytes/s on this socket "
                    f"(with {n} bytes of referenced items)")
        if self.inflight + n > self.limits.max_inflight_bytes:
            return (503, "inflight_bytes",
                    f"bodies held on this socket, with {n} bytes of referenced items, "
                    f"would pass {self.limits.max_inflight_bytes} bytes")
        self.inflight += n
        return None

    def unhold(self, n: int) -> None:
        self.inflight -= n

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: Connection(self), self.path,
                                                    backlog=128)
        os.chmod(self.path, 0o666)  # noqa: S103 - the role's uid differs from ours; the dir is private

    async def close(self, grace_s: float) -> None:
        """Stop accepting; let running calls finish for ``grace_s``, then cancel them
        (each records itself as interrupted) and drop every connection."""
        if self.server is not None:
            self.server.close()
        if self.tasks and grace_s > 0:
            await asyncio.wait(list(self.tasks), timeout=grace_s)
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=2)
        for c in list(self.connections):
            c.abort()


class Connection(asyncio.Protocol):
    """One client connection: parse, apply limits, hand complete requests over."""

    def __init__(self, listener: Listener) -> None:
        self.l = listener
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.busy = False
        self._reset()
        self.timer: asyncio.TimerHandle | None = None
        self.due = 0.0
        self.due_fn: Callable[[], None] | None = None

    # -- state ---------------------------------------------------------------------
    def _reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.field_bytes = 0
        self.wire_bytes = 0
        self.chunks = 0
        self.head: Head | None = None
        self.parts: list[bytes] = []
        self.body_len = 0
        self.reserved = 0
        self.started = False
        self.refused = False

    # One deadline per connection (idle, head, body), moved by each phase. The loop's
    # timer is re-armed only when a deadline comes earlier than the armed one; a later
    # deadline is found when the armed timer fires (no cancel and call_later per phase,
    # whose cancelled handles pile up in the loop's heap under load).
    def _timer(self, delay: float, fn: Callable[[], None]) -> None:
        due = self.loop.time() + delay
        self.due, self.due_fn = due, fn
        if self.timer is None or self.timer.when() > due:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(due, self._fire)

    def _disarm(self) -> None:
        """No deadline until the next ``_timer`` (the armed handle fires harmlessly)."""
        self.due_fn = None

    def _stop_timer(self) -> None:
        self.due_fn = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fire(self) -> None:
        self.timer = None
        fn = self.due_fn
        if fn is None or self.closed:
            return
        if self.due - self.loop.time() > TIMER_SLACK_S:  # the deadline moved later
            self.timer = self.loop.call_at(self.due, self._fire)
            return
        self.due_fn = None
        fn()

    def _release(self) -> None:
        self.l.inflight -= self.reserved
        self.reserved = 0

    def _reserve(self, n: int) -> bool:
        if self.l.inflight + n > self.l.limits.max_inflight_bytes:
            return False
        self.l.inflight += n
        self.reserved += n
        return True

    # -- asyncio protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass).
        self.transport = cast(asyncio.Transport, transport)
        if len(self.l.connections) >= self.l.limits.max_connections:
            self._refuse(503, "too_many_connections",
                         f"more than {self.l.limits.max_connections} connections at once "
                         "on this socket")
            return
        self.l.connections.add(self)
        self._timer(self.l.limits.idle_timeout_s, self._idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        if not self.busy:  # else the running task releases and un-counts it when it ends
            self.l.connections.discard(self)
            self._release()

    def data_received(self, data: bytes) -> None:
        if self.closed or self.refused:
            return
        if not self.started:
            self.started = True
            self._timer(self.l.limits.header_timeout_s, self._head_timeout)
        if self.head is None:
            self.head_bytes += len(data)
        if not self.busy:
            self.wire_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "bad_http", "protocol upgrades are not supported")
            return
        except httptools.HttpParserError as exc:
            if not self.refused:
                self._refuse(400, "bad_http", f"malformed HTTP request: {exc}")
            return
        if self.head is None and not self.refused \
                and self.head_bytes > self.l.limits.max_header_bytes:
            self._refuse(431, "header_too_large",
                         f"request head over {self.l.limits.max_header_bytes} bytes")
        elif self.head is not None and not self.busy and not self.refused \
                and self.wire_bytes - self.body_len > \
                self.l.limits.max_header_bytes + CHUNK_LINE_ALLOWANCE * self.chunks:
            # Bytes the parser took that are neither body nor a short chunk line: a
            # trailer field still being accumulated inside httptools, or chunk noise.
            self._refuse(431, "header_too_large",
                         f"request head and framing over {self.l.limits.max_header_bytes} "
                         "bytes")

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # -- httptools callbacks -------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.busy:
            self._refuse(400, "pipelining", "send one request at a time on a connection")

    def on_url(self, url: bytes) -> None:
        if self.refused:
            return
        # The request line counts into the head cap like any header field: a head that
        # arrives in one write (complete before the byte count above is checked) with a
        # 100 KB path or query is refused as a 20 KB header is.
        self.field_bytes += len(url)
        if self.field_bytes > self.l.limits.max_header_bytes:
            self._refuse(431, "header_too_large",
                         f"request head over {self.l.limits.max_header_bytes} bytes")
            return
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.refused:
            return
        if self.head is not None:  # httptools reports trailer fields here too
            self._refuse(400, "bad_http", "trailers not accepted")
            return
        self.field_bytes += len(name) + len(value)
        if self.field_bytes > self.l.limits.max_header_bytes:
            self._refuse(431, "header_too_large",
                         f"request head over {self.l.limits.max_header_bytes} bytes")
            return
        self.headers.append((name.lower(), value))

    def on_chunk_header(self) -> None:
        self.chunks += 1

    def on_headers_complete(self) -> None:
        if self.refused:
            return
        headers: dict[str, str] = {}
        for k, v in self.headers:
            key = k.decode("latin-1")
            if key in headers and key in ("authorization", "x-api-key", "content-length"):
                self._refuse(400, "bad_http", f"duplicate {key} header")
                return
            headers[key] = v.decode("latin-1")
        length: int | None = None
        if "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                self._refuse(400, "bad_http", "content-length is not a number")
                return
        self.head = Head(method=self.parser.get_method().decode("latin-1"),
                         path=self.url.decode("latin-1").split("?", 1)[0], headers=headers,
                         content_length=length, keep_alive=self.parser.should_keep_alive())
        if not self.l.bucket.take():
            self._refuse(429, "rate_limited",
                         f"over {self.l.limits.rate_per_s}/s (burst {self.l.limits.burst}) "
                         "requests on this socket")
            return
        reply = self.l.handler.head(self.head)
        if reply is not None:
            self.refused = True  # nothing of this request reaches handle()
            self._send(reply, keep_alive=False)
            return
        if length is not None:
            if length > self.l.handler.max_body:
                self._refuse(413, "request_too_large",
                             f"request body of {length} bytes is over {self.l.handler.max_body}")
                return
            if not self.l.bytes.take(length):
                self._refuse(429, "byte_rate_limited",
                             f"over {self.l.limits.body_bytes_per_s} body bytes/s on this socket")
                return
            if not self._reserve(length):
                self._refuse(503, "inflight_bytes",
                             f"bodies held on this socket would pass "
                             f"{self.l.limits.max_inflight_bytes} bytes")
                return
        self._timer(self.l.limits.body_timeout_s, self._body_timeout)

    def on_body(self, chunk: bytes) -> None:
        if self.refused:
            return
        self.body_len += len(chunk)
        if self.body_len > self.l.handler.max_body:
            self.parts.append(chunk)
            self._refuse(413, "request_too_large",
                         f"request body over {self.l.handler.max_body} bytes")
            return
        if self.head is not None and self.head.content_length is None \
                and not self.l.bytes.take(len(chunk)):
            self._refuse(429, "byte_rate_limited",
                         f"over {self.l.limits.body_bytes_per_s} body bytes/s on this socket")
            return
        if self.head is not None and self.head.content_length is None \
                and not self._reserve(len(chunk)):
            self.parts.append(chunk)
            self._refuse(503, "inflight_bytes", f"bodies held on this socket would pass "
                                                f"{self.l.limits.max_inflight_bytes} bytes")
            return
        self.parts.append(chunk)

    def on_message_complete(self) -> None:
        if self.refused or self.head is None or self.transport is None:
            return
        self._disarm()
        self.busy = True
        self.transport.pause_reading()
        body = b"".join(self.parts)
        self.parts = []
        task = self.loop.create_task(self._run(self.head, body))
        self.l.tasks.add(task)
        task.add_done_callback(self.l.tasks.discard)

    # -- replies ---------------------------------------------------------------------
    async def _run(self, head: Head, body: bytes) -> None:
        try:
            reply = await _guard(self.l.handler, head, body, self.l.handler.handle(head, body))
        except asyncio.CancelledError:
            # Recorded by the handler: as interrupted, or as it ended when the upstream
            # had already answered and only its recording was still waiting.
            self._send(Reply(503, b'{"error":{"code":"interrupted","message":"the gateway '
                                  b'is shutting down; the call was recorded"}}'),
                       keep_alive=False)
            raise
        finally:
            self.busy = False
            self._release()
            if self.closed:  # the client has gone (or is being closed): free its slot
                self.l.connections.discard(self)
        keep = head.keep_alive and not self.closed
        self._send(reply, keep_alive=keep)
        if reply.after is not None:
            reply.after()  # no await since the handler returned: nothing comes between
        if keep and self.transport is not None:
            self._reset()
            self.transport.resume_reading()
            self._timer(self.l.limits.idle_timeout_s, self._idle)

    def _send(self, reply: Reply, *, keep_alive: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(encode(reply, keep_alive=keep_alive))
        if not keep_alive:
            self.closed = True
            self._stop_timer()
            self.transport.close()

    def _refuse(self, status: int, code: str, message: str) -> None:
        self.refused = True
        received = b"".join(self.parts)
        self.parts = []
        head = self.head
        if self.busy:
            # A second message while the first is handled: the first's body is still
            # held by its task (which releases it), and this refusal is not about it.
            head, received = None, b""
        else:
            self._release()
        try:
            reply = self.l.handler.refuse(head, status, code, message, received)
        except Exception as exc:
            print(f"cyclebox gateway: could not record refusal {code}: {exc!r}",
                  file=sys.stderr)
            reply = Reply(500, b'{"error":{"code":"internal_error"}}')
        self._send(reply, keep_alive=False)

    def _idle(self) -> None:
        if not self.busy and not self.started:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def _head_timeout(self) -> None:
        if self.head is None and not self.refused:
            self._refuse(408, "header_timeout",
                         f"request head not complete within {self.l.limits.header_timeout_s} s")

    def _body_timeout(self) -> None:
        if not self.busy and not self.refused:
            self._refuse(408, "body_timeout",
                         f"request body not complete within {self.l.limits.body_timeout_s} s")


async def _guard(handler: Handler, head: Head, body: bytes, call: Awaitable[Reply]) -> Reply:
    """Await the handler; an exception becomes a recorded 500 naming its type."""
    try:
        return await call
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        with contextlib.suppress(Exception):
            return handler.refuse(head, 500, "internal_error",
                                  f"gateway error {type(exc).__name__}; recorded", body)
        return Reply(500, b'{"error":{"code":"internal_error"}}')
