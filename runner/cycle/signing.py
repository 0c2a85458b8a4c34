"""Signed receipts: an Ed25519 or ECDSA P-256 signature in a DSSE envelope (SPEC §10).

A receipt's hashes catch accidental drift; a signature makes it tamper-evident
against anyone without the private key. ``receipt.dsse.json`` holds the exact bytes
of ``receipt.json`` as its payload, signed over DSSE's pre-authentication encoding.
Keys are PEM files (:mod:`runner.cycle.keys`); the private key is written 0600 and never
leaves the host. Envelopes written before attestations existed name their Ed25519 key by
a 16-digit keyid (:func:`runner.cycle.keys.legacy_keyid`); they still verify. The
standard in-toto attestations of a run are :mod:`runner.attest`.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from runner.cycle import keys
from runner.cycle.keys import KeyType, PublicKey
from runner.cycle.models import ENVELOPE
from runner.cycle.receipt import RECEIPT, read_receipt_bytes, require_unaltered
from runner.errors import ConfigError, IntegrityError
from runner.isolation.sandbox import Frozen
from runner.loading import load_model, read_capped, show
from runner.outdir import write_once

PAYLOAD_TYPE = "application/vnd.cyclebox.receipt+json"
MAX_RECEIPT_BYTES = 256 * 1024 * 1024
"""Largest receipt.json signed or checked against its envelope."""


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def keygen(path: Path, kind: KeyType = "ed25519") -> Path:
    """A new signing key at ``path`` (see :func:`runner.cycle.keys.keygen`)."""
    return keys.keygen(path, kind)


load_public = keys.load_public


def sign(run_dir: Path, key_path: Path) -> Path:
    """Write ``run_dir/receipt.dsse.json`` signing the exact bytes of receipt.json.

    Only a run that verifies is signed (as ``receipt attest``; the data stores outside it
    aside): a receipt that is a link to another file, or a run edited after its receipt,
    is refused by name. The receipt is read without following a link, and the envelope is
    written once, never through a link (:func:`runner.outdir.write_once`)."""
    key = keys.load_private(key_path)
    out = run_dir / ENVELOPE
    if out.exists() or out.is_symlink():
        raise ConfigError(f"{show(str(out))} exists; a receipt is signed once", field="DIR",
                          fix="keep the envelope you have, or verify it: cyclebox receipt "
                              "verify DIR --pubkey KEY.pub")
    if not (run_dir / RECEIPT).is_file() and not (run_dir / RECEIPT).is_symlink():
        raise ConfigError(f"{show(str(run_dir / RECEIPT))}: does not exist", field="DIR",
                          fix=SIGN_FIX)
    # the bytes read once: the ones verified are the ones signed
    payload = read_receipt_bytes(run_dir)  # verify's own cap: a larger one never verifies
    require_unaltered(run_dir, what="only a run that verifies is signed",
                      receipt_bytes=payload)
    sig = keys.sign_bytes(key, pae(PAYLOAD_TYPE, payload))
    env = {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode(),
           "signatures": [{"keyid": keys.keyid(key.public_key()),
                           "sig": base64.b64encode(sig).decode()}]}
    write_once(out, (json.dumps(env, indent=1, sort_keys=True) + "\n").encode(),
               what="a receipt's signature", field="DIR", fix="sign a receipt once")
    return out


SIGN_FIX = ("sign a finished run: `cyclebox cycle run` writes DIR/receipt.json when it ends "
            "(a --prepare-only or unfinished run has none)")


class Signature(Frozen):
    keyid: str
    """securesystemslib's keyid of the key (older envelopes: 16 hex digits, legacy)."""
    sig: str
    """Base64 signature over the DSSE pre-authentication encoding (Ed25519 raw, ECDSA
    DER)."""


class Envelope(BaseModel):
    """``receipt.dsse.json`` (DSSE v1). Unknown keys are carried along: an envelope may
    hold fields cyclebox does not write."""

    model_config = ConfigDict(frozen=True, extra="allow")

    payloadType: str
    payload: str
    """Base64 of the exact bytes of receipt.json."""
    signatures: tuple[Signature, ...]


def verify_signature(run_dir: Path, pub: PublicKey) -> None:
    """IntegrityError unless the envelope is signed by ``pub`` over today's receipt.json."""
    try:
        env = load_model(run_dir / ENVELOPE, Envelope, fmt="json", what="signature envelope",
                         fix="cyclebox receipt sign DIR --key KEY")
        payload = base64.b64decode(env.payload, validate=True)
    except (ConfigError, ValueError) as exc:
        raise IntegrityError(f"{run_dir / ENVELOPE}: missing or unreadable ({exc})") from None
    if env.payloadType != PAYLOAD_TYPE:
        raise IntegrityError(f"{ENVELOPE}: unexpected payloadType {env.payloadType!r}")
    try:
        current = read_capped(run_dir / "receipt.json", max_bytes=MAX_RECEIPT_BYTES,
                              what="receipt")
    except ConfigError as exc:
        raise IntegrityError(f"receipt.json: {exc}") from None
    if payload != current:
        raise IntegrityError(f"{ENVELOPE}: signed payload differs from receipt.json")
    ids = {keys.keyid(pub), keys.legacy_keyid(pub)}
    for s in env.signatures:
        if s.keyid not in ids:
            continue
        try:
            sig = base64.b64decode(s.sig, validate=True)
        except ValueError:
            raise IntegrityError(f"{ENVELOPE}: signature is not base64") from None
        if not keys.verify_bytes(pub, sig, pae(PAYLOAD_TYPE, payload)):
            raise IntegrityError(f"{ENVELOPE}: signature does not verify")
        return
    raise IntegrityError(f"{ENVELOPE}: no signature by key {keys.keyid(pub)}")
