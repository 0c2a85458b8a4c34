"""The gateway's upstream client over TLS, on the stdlib loop and on uvloop (the loop the
gateway runs on): real providers are https, and uvloop brings its own TLS transport.
A local server with a throwaway certificate stands in for the provider."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from runner.gateway import upstream_http
from runner.gateway.upstream_http import HttpClient, UpstreamError

Run = Callable[[Coroutine[Any, Any, None]], None]
BODY = b'{"choices":[{"message":{"content":"ok"}}]}'


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    return asyncio.run if request.param == "asyncio" else uvloop.run


@pytest.fixture
def cert(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    crt = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
           .public_key(key.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now - datetime.timedelta(minutes=5))
           .not_valid_after(now + datetime.timedelta(hours=1))
           .add_extension(x509.SubjectAlternativeName(
               [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
           .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
           .sign(key, hashes.SHA256()))
    crt_path, key_path = tmp_path / "crt.pem", tmp_path / "key.pem"
    crt_path.write_bytes(crt.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return crt_path, key_path


async def _serve(cert: tuple[Path, Path], seen: list[bytes]) -> asyncio.Server:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*cert)

    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            seen.append(head + await r.readexactly(length))
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n" % len(BODY) + BODY)
            await w.drain()

    return await asyncio.start_server(answer, "127.0.0.1", 0, ssl=ctx)


def test_posts_over_tls_and_reuses_the_connection(run: Run, cert: tuple[Path, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    trusted = ssl.create_default_context(cafile=str(cert[0]))
    monkeypatch.setattr(upstream_http, "_tls_context", lambda: trusted)

    async def main() -> None:
        seen: list[bytes] = []
        server = await _serve(cert, seen)
        port = server.sockets[0].getsockname()[1]
        client = HttpClient(f"https://127.0.0.1:{port}/v1", read_timeout=5,
                            max_response=1 << 20)
        for body in (b'{"a":1}', b'{"b":2}'):
            status, data = await client.post("chat/completions", body,
                                             {"Authorization": "Bearer k"})
            assert (status, data) == (200, BODY)
        assert [s.rsplit(b"\r\n\r\n", 1)[1] for s in seen] == [b'{"a":1}', b'{"b":2}']
        assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert len(client._idle) == 1  # one TLS connection, kept and reused
        await client.aclose()
        server.close()
        await server.wait_closed()
    run(main())


def test_an_untrusted_certificate_is_refused(run: Run, cert: tuple[Path, Path]) -> None:
    """The default context (system or certifi CAs) does not trust a self-signed server:
    the call fails as unreachable, nothing is sent."""
    async def main() -> None:
        seen: list[bytes] = []
        server = await _serve(cert, seen)
        port = server.sockets[0].getsockname()[1]
        client = HttpClient(f"https://127.0.0.1:{port}/v1", read_timeout=5,
                            max_response=1 << 20)
        with pytest.raises(UpstreamError, match="upstream_unreachable"):
            await client.post("chat/completions", b"{}", {})
        assert seen == []
        await client.aclose()
        server.close()
    run(main())
