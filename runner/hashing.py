"""Canonical JSON and sha256 helpers: one definition used by plans, receipts and manifests.

Canonical JSON: sorted keys, compact separators, UTF-8, NaN/Infinity refused.

Writing never raises on a hostile string: text that is not valid Unicode (a lone
surrogate, e.g. from a container's stderr or a model reply) is written with the
offending code points backslash-escaped (``\\ud800``), and a value nested deeper than
:data:`MAX_WRITE_DEPTH` is replaced by a marker. Valid data is written unchanged.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

MAX_WRITE_DEPTH = 128
TOO_DEEP = f"[nested deeper than {MAX_WRITE_DEPTH} levels: dropped]"


def safe_text(text: str) -> str:
    """``text`` with every code point UTF-8 cannot encode (lone surrogates) escaped."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def sanitize(obj: Any, depth: int = 0) -> Any:
    """A copy of a JSON value with safe strings (keys too) and bounded nesting."""
    if depth > MAX_WRITE_DEPTH:
        return TOO_DEEP
    if isinstance(obj, str):
        return safe_text(obj)
    if isinstance(obj, dict):
        return {safe_text(str(k)): sanitize(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [sanitize(v, depth + 1) for v in obj]
    return obj


def _dumps(obj: Any, *, ascii_only: bool = False, **kw: Any) -> str:
    try:
        text = json.dumps(obj, sort_keys=True, allow_nan=False, ensure_ascii=False, **kw)
        text.encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        obj = sanitize(obj)
        text = json.dumps(obj, sort_keys=True, allow_nan=False, ensure_ascii=False, **kw)
    if ascii_only:
        text = json.dumps(obj, sort_keys=True, allow_nan=False, **kw)
    return text


def canonical_bytes(obj: Any) -> bytes:
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json", by_alias=True)
    return _dumps(obj, separators=(",", ":")).encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj: Any) -> str:
    return sha256_bytes(canonical_bytes(obj))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, obj: Any) -> None:
    """Readable, key-sorted JSON for stage files (not a hashing format; see canonical_bytes)."""
    path.write_bytes((_dumps(obj, ascii_only=True, indent=1) + "\n").encode("utf-8"))
