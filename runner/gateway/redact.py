"""Credential redaction for upstream responses (pure).

An upstream may echo the key it was sent (an error page quoting the Authorization
header, a debug field). Before response bytes are stored or handed to a container,
every form of a key the gateway holds is replaced: the raw value, JSON- and
URL-escaped forms, hex, and base64 at each of the three byte alignments (so the key
is caught inside a longer encoded string such as ``Basic``/``Bearer`` headers).
"""

from __future__ import annotations

import base64
import binascii
import json
import urllib.parse

MARK = b"[redacted-by-cyclebox]"


def _b64_cores(secret: bytes) -> set[bytes]:
    """Substrings present in any base64 encoding of data containing ``secret``."""
    out: set[bytes] = set()
    for lead in range(3):
        enc = base64.b64encode(b"\0" * lead + secret)
        # Keep only characters whose 6 bits lie wholly inside the secret.
        start = (8 * lead + 5) // 6
        end = 8 * (lead + len(secret)) // 6
        core = enc[start:end]
        if len(core) >= 8:
            out.add(core)
            out.add(core.replace(b"+", b"-").replace(b"/", b"_"))
    return out


def forms(secret: str) -> list[bytes]:
    """Every encoding of ``secret`` that is redacted, longest first."""
    raw = secret.encode()
    found = {raw, json.dumps(secret).encode()[1:-1], json.dumps(secret, ensure_ascii=True)
             .encode()[1:-1], urllib.parse.quote(secret, safe="").encode(),
             urllib.parse.quote_plus(secret).encode(), binascii.hexlify(raw),
             binascii.hexlify(raw).upper(), *_b64_cores(raw)}
    return sorted((f for f in found if len(f) >= 8), key=len, reverse=True)


class Redactor:
    """Replaces every form of the given secrets; ``redact`` returns (bytes, count)."""

    def __init__(self, secrets: list[str]) -> None:
        self._forms = sorted({f for s in secrets if s for f in forms(s)}, key=len,
                             reverse=True)

    def redact(self, data: bytes) -> tuple[bytes, int]:
        count = 0
        for f in self._forms:
            if f in data:
                count += data.count(f)
                data = data.replace(f, MARK)
        return data, count
