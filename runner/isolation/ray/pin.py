"""TLS for the relay link, pinned to one ephemeral certificate: no PKI to manage.

The head's forwarder makes an EC P-256 key and a self-signed certificate when it starts.
The key never leaves the head process: ``ssl`` only loads a chain from a file, so it is
written to a 0600 file in a private temporary directory, loaded, and the directory is
removed before :func:`server_context` returns. The certificate (public) travels to the
node inside each ticket; the node trusts exactly that certificate and no CA
(:func:`client_context`), and checks the peer presents those very bytes
(:func:`check_peer`). A new head process means a new key: tickets of an old one are
worthless against it.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "cyclebox-relay"
"""The one name in the certificate (its SAN); the node checks it as the server name."""
VALIDITY = dt.timedelta(days=30)
"""Longer than any one head process is expected to serve a cycle; the pin, not the
expiry, is what binds a ticket to its head."""
CLOCK_SKEW = dt.timedelta(hours=1)
"""``not_valid_before`` lies this far back, so a node whose clock is behind accepts it."""
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
"""Forward-secret AEAD suites only, should TLS 1.2 be negotiated (both ends prefer 1.3)."""


def make_certificate() -> tuple[bytes, bytes]:
    """A fresh (certificate PEM, private key PEM) for :data:`SERVER_NAME`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)])
    now = dt.datetime.now(dt.UTC)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=False,
            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _harden(ctx: ssl.SSLContext) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(TLS12_CIPHERS)
    ctx.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_COMPRESSION
    # The relay half-closes a direction by closing TCP's write side under TLS (Python
    # cannot send close_notify and keep reading): read that as the end of the stream,
    # not as a fatal error that would also end the other direction.
    ctx.options |= ssl.OP_IGNORE_UNEXPECTED_EOF


def server_context() -> tuple[ssl.SSLContext, bytes]:
    """The head's context with a fresh key loaded, and the certificate PEM to pin."""
    cert_pem, key_pem = make_certificate()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(ctx)
    # no session tickets: nothing to resume, and no post-handshake records to the node
    ctx.num_tickets = 0
    private = Path(tempfile.mkdtemp(prefix="cbx-relay-key-"))  # 0700
    try:
        chain = private / "chain.pem"
        fd = os.open(chain, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem + cert_pem)
        ctx.load_cert_chain(chain)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return ctx, cert_pem


def client_context(cert_pem: bytes) -> ssl.SSLContext:
    """A node's context trusting exactly ``cert_pem`` (no system CA), name checked."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
    _harden(ctx)
    ctx.load_verify_locations(cadata=cert_pem.decode("ascii"))
    return ctx


def check_peer(sock: ssl.SSLSocket, cert_pem: bytes) -> None:
    """Raise ``ssl.SSLError`` unless the peer presented exactly the pinned certificate
    (the chain check already requires it; this also rules out anything it could sign)."""
    der = sock.getpeercert(binary_form=True)
    if der is None or der != ssl.PEM_cert_to_DER_cert(cert_pem.decode("ascii")):
        raise ssl.SSLError("the relay's head presented another certificate than its ticket's")
