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
from dataclasses import dataclass, field
from typing import Protocol

import httptools
import httpx


class UpstreamError(Exception):
    """A call that produced no complete response; ``kind`` is the recorded reason."""

    def __init__(self, kind: str, status: int | None = None, partial: bytes | None = None):
        super().__init__(kind)
        self.kind, self.status, self.partial = kind, status, partial


@dataclass
class _Response:
    status: int = 0
    parts: list[bytes] = field(default_factory=list)
    size: int = 0
    complete: bool = False
    headers_done: bool = False
    keep_alive: bool = True
    framed: bool = False
    """Content-Length or chunked: EOF before completion is a truncation."""


class _Parser:
    def __init__(self, resp: _Response, limit: int) -> None:
        self.r, self.limit = resp, limit
        self.p = httptools.HttpResponseParser(self)
        self.too_large = False

    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            self.r.framed = True

    def on_headers_complete(self) -> None:
        self.r.status = self.p.get_status_code()
        self.r.keep_alive = self.p.should_keep_alive()
        self.r.headers_done = True

    def on_body(self, chunk: bytes) -> None:
        self.r.size += len(chunk)
        if self.r.size > self.limit:
            self.too_large = True
            return
        self.r.parts.append(chunk)

    def on_message_complete(self) -> None:
        self.r.complete = True


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
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._ssl: ssl.SSLContext | None = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing() and not reader.exception():
                return reader, writer
            writer.close()
        if self.tls and self._ssl is None:
            self._ssl = _tls_context()
        try:
            async with asyncio.timeout(self.read_timeout):
                return await asyncio.open_connection(
                    self.host, self.port, ssl=self._ssl if self.tls else None, limit=1 << 20)
        except TimeoutError:
            raise UpstreamError("upstream_timeout") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamError(f"upstream_unreachable: {type(exc).__name__}") from None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """(status, body bytes); UpstreamError when no complete response arrived."""
        reader, writer = await self._connect()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write((f"POST {self.base}/{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                      f"Content-Length: {len(body)}\r\n{head}\r\n").encode("latin-1") + body)
        resp = _Response()
        parser = _Parser(resp, self.max_response)
        ok = False
        try:
            while not resp.complete:
                try:
                    # asyncio.timeout, not wait_for: on 3.11 a nested wait_for can swallow
                    # the cancellation of the call's deadline when a read completes at once.
                    async with asyncio.timeout(self.read_timeout):
                        data = await reader.read(65536)
                except TimeoutError:
                    raise UpstreamError("upstream_timeout") from None
                except OSError:
                    raise UpstreamError("upstream_disconnected", resp.status or None,
                                        b"".join(resp.parts)) from None
                if not data:
                    if resp.headers_done and not resp.framed:
                        break  # body delimited by close
                    raise UpstreamError("upstream_disconnected", resp.status or None,
                                        b"".join(resp.parts))
                try:
                    parser.p.feed_data(data)
                except httptools.HttpParserError:
                    raise UpstreamError("malformed_http", resp.status or None) from None
                if parser.too_large:
                    raise UpstreamError("response_too_large", resp.status,
                                        b"".join(resp.parts))
            ok = resp.complete and resp.keep_alive
            return resp.status, b"".join(resp.parts)
        finally:
            if ok and len(self._idle) < self.max_idle:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def aclose(self) -> None:
        for _, writer in self._idle:
            writer.close()
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
            async with self._client.stream("POST", path, content=body,
                                           headers=headers) as resp:
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
