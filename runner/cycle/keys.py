"""Signing keys for receipts and attestations: Ed25519 and ECDSA P-256 (SPEC §10).

A key is a PEM file (PKCS#8, 0600); ``keygen`` also writes its public half as PEM
(``KEY.pub``, SubjectPublicKeyInfo, what openssl and ``cosign verify-blob-attestation
--key`` read) and as a securesystemslib key dict (``KEY.pub.json``).

Invariants other tools rely on:

- **keyid** is securesystemslib's default keyid: the sha256 (hex) of the OLPC canonical
  JSON of ``{"keytype", "scheme", "keyval": {"public"}}``, where ``public`` is the raw
  public key in hex for Ed25519 and the SubjectPublicKeyInfo PEM for ECDSA (exactly what
  ``SSlibKey.from_crypto`` computes). The receipt envelopes written before attestations
  existed used the first 16 hex digits of sha256(raw Ed25519 key); :func:`legacy_keyid`
  keeps those verifiable.
- **Signatures** are raw 64 bytes for Ed25519 and ASN.1 DER (r, s) for ECDSA P-256 over
  SHA-256, the encodings securesystemslib, cosign and sigstore verify.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from runner.errors import ConfigError
from runner.outdir import refuse_inside_run

KeyType = Literal["ed25519", "ecdsa-p256"]
KEY_TYPES: tuple[KeyType, ...] = ("ed25519", "ecdsa-p256")
PrivateKey = Ed25519PrivateKey | ec.EllipticCurvePrivateKey
PublicKey = Ed25519PublicKey | ec.EllipticCurvePublicKey
KEYGEN_FIX = "cyclebox receipt keygen --out KEY [--type ed25519|ecdsa-p256]"


def _canonical(value: object) -> str:
    """OLPC canonical JSON for the string-only dicts of a key (securesystemslib's
    ``encode_canonical``): sorted keys, no whitespace, only ``"`` and ``\\`` escaped."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if not isinstance(value, dict):
        raise TypeError(f"key dicts hold strings and dicts only, not {type(value).__name__}")
    items = (f"{_canonical(k)}:{_canonical(v)}" for k, v in sorted(value.items()))
    return "{" + ",".join(items) + "}"


@dataclass(frozen=True)
class PublicInfo:
    """A public key as securesystemslib describes it."""

    keytype: str
    scheme: str
    public: str
    """Hex of the raw key (Ed25519) or SubjectPublicKeyInfo PEM (ECDSA)."""

    def key_dict(self) -> dict[str, object]:
        return {"keytype": self.keytype, "scheme": self.scheme,
                "keyval": {"public": self.public}}

    @property
    def keyid(self) -> str:
        return hashlib.sha256(_canonical(self.key_dict()).encode()).hexdigest()


def describe(pub: PublicKey) -> PublicInfo:
    if isinstance(pub, Ed25519PublicKey):
        raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return PublicInfo("ed25519", "ed25519", raw.hex())
    if isinstance(pub.curve, ec.SECP256R1):
        pem = pub.public_bytes(serialization.Encoding.PEM,
                               serialization.PublicFormat.SubjectPublicKeyInfo).decode()
        return PublicInfo("ecdsa", "ecdsa-sha2-nistp256", pem)
    raise ConfigError(f"unsupported curve {pub.curve.name}; use ECDSA P-256", fix=KEYGEN_FIX)


def keyid(pub: PublicKey) -> str:
    """securesystemslib's default keyid of ``pub`` (module docstring)."""
    return describe(pub).keyid


def legacy_keyid(pub: PublicKey) -> str | None:
    """The keyid of receipt envelopes written before attestations (Ed25519 only)."""
    if not isinstance(pub, Ed25519PublicKey):
        return None
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign_bytes(key: PrivateKey, data: bytes) -> bytes:
    if isinstance(key, Ed25519PrivateKey):
        return key.sign(data)
    return key.sign(data, ec.ECDSA(hashes.SHA256()))  # DER, as cosign and sslib expect


def verify_bytes(pub: PublicKey, sig: bytes, data: bytes) -> bool:
    try:
        if isinstance(pub, Ed25519PublicKey):
            pub.verify(sig, data)
        else:
            pub.verify(sig, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True


def _check_supported(key: PrivateKey | PublicKey, path: Path, what: str) -> None:
    if isinstance(key, Ed25519PrivateKey | Ed25519PublicKey):
        return
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) and isinstance(
            key.curve, ec.SECP256R1):
        return
    raise ConfigError(f"not an Ed25519 or ECDSA P-256 {what} key", path=str(path),
                      fix=KEYGEN_FIX)


MAX_KEY_BYTES = 64 * 1024
"""Largest key file read (a PEM key is a few hundred bytes)."""


def _key_bytes(path: Path, what: str, fix: str) -> bytes:
    """A key file's bytes: a regular file, bounded, opened without blocking (a FIFO or
    /dev/zero given as --key hung or grew without bound)."""
    from runner.loading import read_capped

    return read_capped(path, max_bytes=MAX_KEY_BYTES, what=what, fix=fix)


def load_private(path: Path) -> PrivateKey:
    data = _key_bytes(path, "private key", KEYGEN_FIX)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read private key: {exc}", path=str(path),
                          fix=KEYGEN_FIX) from None
    _check_supported(key, path, "private")  # type: ignore[arg-type]
    return key  # type: ignore[return-value]


def load_public(path: Path) -> PublicKey:
    data = _key_bytes(path, "public key", "pass the KEY.pub (PEM) that `cyclebox receipt "
                      "keygen` wrote")
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise ConfigError(f"cannot read public key: {exc}", path=str(path),
                          fix="pass the KEY.pub (PEM) that `cyclebox receipt keygen` wrote"
                          ) from None
    _check_supported(key, path, "public")  # type: ignore[arg-type]
    return key  # type: ignore[return-value]


def _new_key(kind: KeyType) -> PrivateKey:
    if kind == "ed25519":
        return Ed25519PrivateKey.generate()
    return ec.generate_private_key(ec.SECP256R1())


def keygen(path: Path, kind: KeyType = "ed25519") -> Path:
    """Write a new private key (0600) at ``path``, its public key at ``path.pub`` (PEM)
    and ``path.pub.json`` (securesystemslib key dict with its ``keyid``); returns the PEM.

    All are created exclusively (never overwritten, never through a symlink); the
    directory must exist (ConfigError naming it otherwise: a key is not written into a
    directory the operator did not make on purpose). Nothing is left on failure."""
    pub_path = path.with_name(path.name + ".pub")
    dict_path = path.with_name(path.name + ".pub.json")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"directory {parent} does not exist", path=str(path), field="--out",
                          fix=f"create it first (mkdir -p {parent}) or give a path in an "
                          "existing directory")
    refuse_inside_run(path)  # a key in a run directory: evidence that no longer verifies
    targets = (path, pub_path, dict_path)
    if any(p.exists() or p.is_symlink() for p in targets):
        raise ConfigError(f"{path}, {pub_path} or {dict_path} exists; keys are never "
                          "overwritten", field="--out", fix="give a new key path")
    key = _new_key(kind)
    pub = key.public_key()
    info = describe(pub)
    key_dict = {"keyid": info.keyid, **info.key_dict()}
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    written: list[Path] = []
    try:
        for target, mode, data in (
                (path, 0o600, key.private_bytes(serialization.Encoding.PEM,
                                                serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption())),
                (pub_path, 0o644, pub.public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)),
                (dict_path, 0o644, (json.dumps(key_dict, indent=1, sort_keys=True) + "\n")
                 .encode())):
            fd = os.open(target, flags, mode)
            written.append(target)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    except BaseException as exc:
        for p in written:
            p.unlink(missing_ok=True)
        if not isinstance(exc, OSError):
            raise
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE):
            raise  # the machine, not the input: the CLI maps it to environment_failure
        if isinstance(exc, FileExistsError):
            raise ConfigError(f"{exc.filename} exists; keys are never overwritten",
                              field="--out", fix="give a new key path") from None
        raise ConfigError(f"cannot write {exc.filename or path}: {exc.strerror}",
                          path=str(path), field="--out",
                          fix="give a path in a directory you can write") from None
    return pub_path
