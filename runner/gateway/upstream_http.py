"""A minimal HTTP/1.1 client for the openai provider: POST bytes, read bytes, nothing else.

Why not httpx: profiling the gateway at concurrency 8 put most of its CPU in httpx's
pool and anyio layers (per request several times the cost of parsing with httptools).
This client sends the exact request bytes, keeps idle connections for reuse, reads the
response with a per-read timeout and a size cap, never follows redirects and never
retries: a reused connection is only taken if the server has not closed it.
When the host environment names an HTTP proxy for the upstream, httpx is used instead
(it honours the proxy variables; this client does not speak to proxies).
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
import urllib.request
from typing import Protocol, cast

import httptools
import httpx


class UpstreamError(Exception):
    """A call that produced no complete response; ``kind`` is the recorded reason."""

    def __init__(self, kind: str, status: int | None = None, partial: bytes | None = None):
        super().__init__(kind)
        self.kind, self.status, self.partial = kind, status, partial


class _Conn(asyncio.Protocol):
    """One upstream connection: an asyncio Protocol parsing responses as bytes arrive.

    No StreamReader and no timeout context per read: bytes go straight into httptools,
    one future per response is woken when it is complete (or can never be), and one
    timer per response enforces the read timeout (re-armed lazily: a read resets only
    a timestamp). A connection is reused only if it is idle, open, and nothing arrived
    on it between responses."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.error: OSError | None = None
        self.busy = False
        self._reset(0)

    def _reset(self, limit: int) -> None:
        self.status = 0
        self.parts: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.complete = self.headers_done = self.too_large = self.bad_http = False
        self.framed = False
        """Content-Length or chunked: EOF before completion is a truncation."""
        self.keep_alive = True
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[None] | None = None
        self.last = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.waiter is None:
            self.closed = True  # bytes nobody asked for: never reuse this connection
            if self.transport is not None:
                self.transport.close()
            return
        self.last = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.bad_http = True
        if self.complete or self.too_large or self.bad_http:
            self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if isinstance(exc, OSError):
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    # -- httptools callbacks -------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True

    def on_body(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            self.too_large = True
            return
        self.parts.append(chunk)

    def on_message_complete(self) -> None:
        self.complete = True

    # -- one exchange ----------------------------------------------------------------
    async def exchange(self, request: bytes, limit: int, timeout: float) -> None:
        """Send ``request`` and wait until its response is complete, too large, malformed,
        or the connection ended; UpstreamError("upstream_timeout") when no byte arrives
        for ``timeout`` seconds."""
        assert self.transport is not None  # noqa: S101 - connected by create_connection
        self._reset(limit)
        self.busy = True
        waiter = self.waiter = self.loop.create_future()
        self.last = self.loop.time()
        self.timer = self.loop.call_at(self.last + timeout, self._check_timeout, timeout)
        try:
            self.transport.write(request)
            await waiter
        finally:
            if self.timer is not None:
                self.timer.cancel()
            self.waiter = None
            self.busy = False

    def _check_timeout(self, timeout: float) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        due = self.last + timeout
        if self.loop.time() >= due:
            waiter.set_exception(UpstreamError("upstream_timeout"))
        else:
            self.timer = self.loop.call_at(due, self._check_timeout, timeout)


class HttpClient:
    """POSTs to one base URL over a small keep-alive pool."""

    def __init__(self, base_url: str, *, read_timeout: float, max_response: int,
                 max_idle: int = 16) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"unsupported upstream URL {base_url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.tls = u.scheme == "https"
        self.base = u.path.rstrip("/")
        self.host_header = u.netloc.rsplit("@", 1)[-1]
        self.read_timeout, self.max_response, self.max_idle = read_timeout, max_response, max_idle
        self._idle: list[_Conn] = []
        self._ssl: ssl.SSLContext | None = None

    async def _connect(self) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.transport is not None \
                    and not conn.transport.is_closing():
                return conn
            if conn.transport is not None:
                conn.transport.close()
        if self.tls and self._ssl is None:
            self._ssl = _tls_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.read_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop), self.host, self.port,
                    ssl=self._ssl if self.tls else None)
                return conn
        except TimeoutError:
            raise UpstreamError("upstream_timeout") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamError(f"upstream_unreachable: {type(exc).__name__}") from None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """(status, body bytes); UpstreamError when no complete response arrived."""
        conn = await self._connect()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = (f"POST {self.base}/{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                   f"Content-Length: {len(body)}\r\n{head}\r\n").encode("latin-1") + body
        ok = False
        try:
            await conn.exchange(request, self.max_response, self.read_timeout)
            if conn.bad_http:
                raise UpstreamError("malformed_http", conn.status or None)
            if conn.too_large:
                raise UpstreamError("response_too_large", conn.status, b"".join(conn.parts))
            if not conn.complete:
                if conn.error is None and conn.headers_done and not conn.framed:
                    return conn.status, b"".join(conn.parts)  # body delimited by close
                raise UpstreamError("upstream_disconnected", conn.status or None,
                                    b"".join(conn.parts))
            ok = conn.keep_alive and not conn.closed
            return conn.status, b"".join(conn.parts)
        finally:
            if ok and len(self._idle) < self.max_idle:
                self._idle.append(conn)
            elif conn.transport is not None:
                conn.transport.close()

    async def aclose(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()


def _tls_context() -> ssl.SSLContext:
    try:
        import certifi  # the CA bundle httpx used, when present
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


class Poster(Protocol):
    async def post(self, path: str, body: bytes,
                   headers: dict[str, str]) -> tuple[int, bytes]: ...

    async def aclose(self) -> None: ...


class HttpxClient:
    """The same interface over httpx, for upstreams reached through a proxy."""

    def __init__(self, base_url: str, *, read_timeout: float, max_response: int) -> None:
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/") + "/", timeout=httpx.Timeout(read_timeout),
            transport=httpx.AsyncHTTPTransport(retries=0), follow_redirects=False)
        self._max = max_response

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        try:
            # identity: the body is read raw (aiter_raw), measured and redacted as bytes;
            # httpx's default Accept-Encoding would let a compressed answer pass unread
            async with self._client.stream("POST", path, content=body, headers={
                    **headers, "Accept-Encoding": "identity"}) as resp:
                chunks: list[bytes] = []
                got = 0
                async for chunk in resp.aiter_raw():
                    got += len(chunk)
                    if got > self._max:
                        raise UpstreamError("response_too_large", resp.status_code,
                                            b"".join(chunks))
                    chunks.append(chunk)
                return resp.status_code, b"".join(chunks)
        except httpx.TimeoutException:
            raise UpstreamError("upstream_timeout") from None
        except (httpx.RemoteProtocolError, httpx.ReadError):
            raise UpstreamError("upstream_disconnected") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream_unreachable: {type(exc).__name__}") from None

    async def aclose(self) -> None:
        await self._client.aclose()


def client_for(base_url: str, *, read_timeout: float, max_response: int) -> Poster:
    """HttpClient, or HttpxClient when a proxy variable applies to ``base_url``."""
    u = urllib.parse.urlsplit(base_url)
    proxies = urllib.request.getproxies()
    if (u.scheme in proxies or "all" in proxies) and not urllib.request.proxy_bypass(
            u.hostname or ""):
        return HttpxClient(base_url, read_timeout=read_timeout, max_response=max_response)
    return HttpClient(base_url, read_timeout=read_timeout, max_response=max_response)
