"""Signed receipts: an Ed25519 signature in a DSSE envelope (SPEC §10).

A receipt's hashes catch accidental drift; a signature makes it tamper-evident
against anyone without the private key. ``receipt.dsse.json`` holds the exact bytes
of ``receipt.json`` as its payload, signed over DSSE's pre-authentication encoding.
Keys are PEM files; the private key is written 0600 and never leaves the host.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict

from runner.errors import ConfigError, IntegrityError
from runner.isolation.sandbox import Frozen
from runner.loading import load_model

PAYLOAD_TYPE = "application/vnd.cyclebox.receipt+json"
ENVELOPE = "receipt.dsse.json"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def _raw(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keyid(pub: Ed25519PublicKey) -> str:
    return hashlib.sha256(_raw(pub)).hexdigest()[:16]


def keygen(path: Path) -> Path:
    """Write a new private key (0600) at ``path`` and its public key at ``path.pub``.

    Both are created exclusively (never overwritten, never through a symlink); the
    directory must exist (ConfigError naming it otherwise: a key is not written into a
    directory the operator did not make on purpose). Nothing is left on failure."""
    pub_path = path.with_name(path.name + ".pub")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"directory {parent} does not exist", path=str(path), field="--out",
                          fix=f"create it first (mkdir -p {parent}) or give a path in an "
                          "existing directory")
    if path.exists() or path.is_symlink() or pub_path.exists() or pub_path.is_symlink():
        raise ConfigError(f"{path} or {pub_path} exists; keys are never overwritten",
                          field="--out", fix="give a new key path")
    key = Ed25519PrivateKey.generate()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    written: list[Path] = []
    try:
        for target, mode, data in (
                (path, 0o600, key.private_bytes(serialization.Encoding.PEM,
                                                serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption())),
                (pub_path, 0o644, key.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))):
            fd = os.open(target, flags, mode)
            written.append(target)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    except OSError as exc:
        for p in written:
            p.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE):
            raise  # the machine, not the input: the CLI maps it to environment_failure
        if isinstance(exc, FileExistsError):
            raise ConfigError(f"{exc.filename} exists; keys are never overwritten",
                              field="--out", fix="give a new key path") from None
        raise ConfigError(f"cannot write {exc.filename or path}: {exc.strerror}",
                          path=str(path), field="--out",
                          fix="give a path in a directory you can write") from None
    return pub_path


def _load_private(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read private key: {exc}", path=str(path),
                          fix="cyclebox receipt keygen --out KEY") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError("not an Ed25519 private key", path=str(path))
    return key


def load_public(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read public key: {exc}", path=str(path)) from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError("not an Ed25519 public key", path=str(path))
    return key


def sign(run_dir: Path, key_path: Path) -> Path:
    """Write ``run_dir/receipt.dsse.json`` signing the exact bytes of receipt.json."""
    key = _load_private(key_path)
    payload = (run_dir / "receipt.json").read_bytes()
    sig = key.sign(pae(PAYLOAD_TYPE, payload))
    env = {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode(),
           "signatures": [{"keyid": keyid(key.public_key()),
                           "sig": base64.b64encode(sig).decode()}]}
    out = run_dir / ENVELOPE
    if out.exists():
        raise ConfigError(f"{out} exists; a receipt is signed once", field="DIR")
    out.write_text(json.dumps(env, indent=1, sort_keys=True) + "\n")
    return out


class Signature(Frozen):
    keyid: str
    """First 16 hex digits of the sha256 of the raw public key."""
    sig: str
    """Base64 Ed25519 signature over the DSSE pre-authentication encoding."""


class Envelope(BaseModel):
    """``receipt.dsse.json`` (DSSE v1). Unknown keys are carried along: an envelope may
    hold fields cyclebox does not write."""

    model_config = ConfigDict(frozen=True, extra="allow")

    payloadType: str
    payload: str
    """Base64 of the exact bytes of receipt.json."""
    signatures: tuple[Signature, ...]


def verify_signature(run_dir: Path, pub: Ed25519PublicKey) -> None:
    """IntegrityError unless the envelope is signed by ``pub`` over today's receipt.json."""
    try:
        env = load_model(run_dir / ENVELOPE, Envelope, fmt="json", what="signature envelope",
                         fix="cyclebox receipt sign DIR --key KEY")
        payload = base64.b64decode(env.payload, validate=True)
    except (ConfigError, ValueError) as exc:
        raise IntegrityError(f"{run_dir / ENVELOPE}: missing or unreadable ({exc})") from None
    if env.payloadType != PAYLOAD_TYPE:
        raise IntegrityError(f"{ENVELOPE}: unexpected payloadType {env.payloadType!r}")
    if payload != (run_dir / "receipt.json").read_bytes():
        raise IntegrityError(f"{ENVELOPE}: signed payload differs from receipt.json")
    for s in env.signatures:
        if s.keyid != keyid(pub):
            continue
        try:
            pub.verify(base64.b64decode(s.sig, validate=True), pae(PAYLOAD_TYPE, payload))
        except (InvalidSignature, ValueError):
            raise IntegrityError(f"{ENVELOPE}: signature does not verify") from None
        return
    raise IntegrityError(f"{ENVELOPE}: no signature by key {keyid(pub)}")
