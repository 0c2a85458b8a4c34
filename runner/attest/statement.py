"""in-toto Statement v1 and ResourceDescriptor, as typed values, and their DSSE envelope.

The field names are the spec's JSON names (``_type``, ``predicateType``, ...): the
models serialise with ``by_alias`` to exactly what in-toto-attestation's protobuf
bindings parse, and nothing else (``extra="forbid"``).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from runner.cycle import keys
from runner.cycle.signing import pae

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
"""DSSE payloadType of an in-toto Statement (in-toto attestation spec, envelope.md)."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class ResourceDescriptor(_Model):
    """One artefact by name and digest (in-toto ResourceDescriptor v1)."""

    name: str | None = None
    """Path inside the run directory, or a cyclebox name (``image:analyst``)."""
    uri: str | None = None
    """Where the artefact can be found, when it has a stable address (``pkg:pypi/...``)."""
    digest: dict[str, str]
    """Algorithm -> lowercase hex (``sha256``, ``gitTree``, ``gitCommit``)."""
    annotations: dict[str, str] | None = None
    """Anything else a consumer may want (a role, a kind), strings only."""


class Statement(_Model):
    """An in-toto Statement v1."""

    type_: str = Field(STATEMENT_TYPE, alias="_type")
    subject: tuple[ResourceDescriptor, ...]
    """What the predicate is about; each named by digest."""
    predicateType: str
    predicate: dict[str, Any]

    def payload(self) -> bytes:
        """The Statement's bytes as signed: compact JSON with sorted keys."""
        body = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def envelope(statement: Statement, key: keys.PrivateKey) -> dict[str, Any]:
    """A DSSE envelope over ``statement`` signed by ``key`` (keyid: securesystemslib's)."""
    payload = statement.payload()
    sig = keys.sign_bytes(key, pae(PAYLOAD_TYPE, payload))
    return {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode(),
            "signatures": [{"keyid": keys.keyid(key.public_key()),
                            "sig": base64.b64encode(sig).decode()}]}
