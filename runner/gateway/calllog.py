"""The run's call log: exact request and response bytes, content-addressed, plus an
append-only JSONL index (``gateway/calls.jsonl`` and ``gateway/blobs/<sha256>``).

Invariants: a blob's name is the sha256 of its bytes; an index line is written only
after its blobs are written; lines are never rewritten. Exports and replays read the
bytes from here and never re-assemble a prompt.

Durability: every write reaches the kernel before the call is answered, so a killed
controller loses nothing; ``sync()`` (run when a socket closes and when the gateway
stops) makes it survive a machine crash too. Per-call fsync cost ~1 ms on the hot path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import Field

from runner.errors import ConfigError, IntegrityError
from runner.isolation.sandbox import Frozen
from runner.loading import load_lines, read_capped

CallStatus = Literal["ok", "refused", "infra_error"]
ApiFamily = Literal["chat", "responses", "embeddings", "messages", "count_tokens"]
PREFIX_BYTES = 256
"""How much of a refused request's body the log keeps."""
MAX_INDEX_BYTES = 1 << 30
"""Largest calls.jsonl read back (about two million calls)."""
MAX_BLOB_BYTES = 1 << 30
"""Largest blob read back (requests and responses are capped far below by policy)."""
MAX_TOKENS = 10**12
"""A token count above this is no measurement (the gateway never records one)."""
MAX_COUNT = 2**53
"""Bound of every other count of a record: a copied run's log is hostile, and sums of
unbounded integers outgrew what a report can print (exit 10)."""
MAX_SECONDS = 1e9
MAX_COST_USD = 1e12
"""More than any one call can cost: sums of such values stay finite."""
KNOWN_BLOBS = 65536
"""Digests of stored blobs remembered by a writer (a few MiB at most)."""
DIGEST = r"^[0-9a-f]{64}$"
"""A blob name: a recorded run given to replay is hostile, and a digest that is a path
(``../../x``) would open a file outside ``blobs/``."""


Api = ApiFamily
OPENAI_APIS: frozenset[str] = frozenset({"chat", "responses", "embeddings"})
"""API families an OpenAI-compatible upstream serves."""
ANTHROPIC_APIS: frozenset[str] = frozenset({"messages", "count_tokens"})
"""API families an Anthropic upstream serves (and answered in Anthropic's error shape)."""
ALL_APIS: frozenset[str] = OPENAI_APIS | ANTHROPIC_APIS
CostBasis = Literal["measured", "upper_bound"]


class Usage(Frozen):
    """Tokens of one call, normalised across API families."""

    prompt_tokens: int = Field(ge=0, le=MAX_TOKENS)
    """All input tokens, cache reads and cache writes included."""
    completion_tokens: int = Field(ge=0, le=MAX_TOKENS)
    """All output tokens, reasoning (thinking) included."""
    total_tokens: int = Field(ge=0, le=2 * MAX_TOKENS)
    cached_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    """Input tokens read from the provider's prompt cache."""
    cache_write_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    """Input tokens written to the prompt cache (Anthropic cache creation)."""
    cache_write_1h_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS,
                                       exclude_if=lambda v: v == 0)
    """Of those, the ones written to Anthropic's 1-hour cache (``ttl: 1h``, billed at
    cache_write_1h_per_mtok)."""
    reasoning_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    """Output tokens spent on reasoning (priced as output)."""


class CallRecord(Frozen):
    """One model call as the gateway saw it."""

    seq: int = Field(ge=0, le=MAX_COUNT)
    """Order of the call within the run's log."""
    ts: str
    """UTC time the call arrived (ISO 8601)."""
    run_id: str
    role: str
    upstream: str | None
    """Upstream name (target, optimizer, judge); None when refused before routing."""
    stage: str
    case: str | None = None
    trial: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    turn: int = Field(ge=0, le=MAX_COUNT)
    """Zero-based call index on this container's socket."""
    provider: str | None
    model: str | None
    fixture: bool
    """True when the reply came from the scripted provider (never a real model)."""
    stream: bool = False
    api: ApiFamily | None = "chat"
    """API family of the route called; old logs have no field (all chat); None for a
    request refused before routing (e.g. an unknown path)."""
    status: CallStatus
    error: str | None = None
    """Named reason for refused and infra_error (e.g. bad_token, model_not_allowed,
    budget, upstream_status_500, upstream_timeout, malformed_response, truncated_stream)."""
    http_status: int | None = Field(default=None, ge=0, le=999)
    """Upstream HTTP status (None when no upstream was reached)."""
    latency_s: float = Field(ge=0, le=MAX_SECONDS)
    usage: Usage | None = None
    cost_usd: float | None = Field(default=None, ge=0, le=MAX_COST_USD)
    """None means unknown (no usage or no price); never silently zero."""
    cost_basis: CostBasis | None = None
    """measured: cost from reported usage; upper_bound: the call was admitted at a known
    worst case and ended without usage (e.g. a stream without usage), so that worst case
    was charged. None when no cost was charged (refused) or it is unknown."""
    request_sha256: str = Field(pattern=DIGEST)
    """sha256 of the request bytes: as sent upstream, or as received when refused."""
    response_sha256: str | None = Field(default=None, pattern=DIGEST)
    """sha256 of the response bytes as received from upstream (after redaction)."""
    request_stored: bool = True
    """False for refused calls: only hash, length and prefix are kept, never the body
    (a container must not be able to fill the disk with refused requests)."""
    request_bytes: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    """Length of the request bytes the hash covers."""
    request_prefix: str | None = None
    """Refused calls: the first bytes of the body (UTF-8, invalid bytes escaped)."""
    redactions: int = Field(default=0, ge=0, le=MAX_COUNT)
    """Occurrences of an upstream credential replaced in the response before storing."""
    not_itemized: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    """Set on the one ``refusals_not_itemized`` record: refusals of this socket that were
    counted, not recorded one by one, after ``limits.max_refusal_records``."""
    replay_of: str | None = Field(default=None, pattern=DIGEST, exclude_if=lambda v: v is None)
    """Replay only: sha256 of the recorded request whose response answered this call; it
    differs from ``request_sha256`` when the request matched by its stable key (a coding
    CLI's fresh ids, runner/gateway/replay_key.py)."""
    resolved_references: int | None = Field(default=None, ge=1, le=MAX_COUNT,
                                            exclude_if=lambda v: v is None)
    """Responses only: item references in the container's request that the gateway put
    the referenced output items of its own earlier answers in place of, so the request
    sent (and hashed, stored, replayed) differs from it there (runner/gateway/items.py)."""
    dropped_ids: int | None = Field(default=None, ge=1, le=MAX_COUNT,
                                    exclude_if=lambda v: v is None)
    """Responses only: input items whose ``id`` was not one of this container's answers,
    sent without it (runner/gateway/items.py)."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _lines_in(index: Path) -> int:
    """Lines already in a log the gateway appends to: only a regular file is counted
    (never followed, never opened blocking), in pieces (a hostile log may be one line
    of gigabytes), up to :data:`MAX_INDEX_BYTES` (``records()`` refuses a larger one)."""
    n = 0
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.lstat(index).st_mode):
            fd = os.open(index, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                left = MAX_INDEX_BYTES
                while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                    n += chunk.count(b"\n")
                    left -= len(chunk)
            finally:
                os.close(fd)
    return n


def _exists(path: str) -> bool:
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    return True


class CallLog:
    """Append-only writer/reader for one run's gateway directory."""

    def __init__(self, root: Path, *, create: bool = True) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.index = root / "calls.jsonl"
        if create:
            self.blobs.mkdir(parents=True, exist_ok=True)
        self._blob_dir = f"{self.blobs}{os.sep}"
        self._present: set[str] = set()
        self._lock = threading.Lock()
        self._dirty = False
        self._fd: int | None = None
        self._seq = 0
        if create:  # a reader never appends: nothing to count
            self._seq = _lines_in(self.index)

    @classmethod
    def reader(cls, root: Path) -> CallLog:
        """The log of a finished run, to read only: nothing is created (``receipt verify``
        made the gateway directory again on a copied or read-only run)."""
        return cls(root, create=False)

    def put_blob(self, data: bytes) -> str:
        """Store ``data`` under its sha256 (once): written whole to a private temporary
        name, then renamed, so a blob's name never shows partial bytes. Plain ``os``
        calls on a str path (stat; or open, write, close, rename): this runs once or
        twice per call on the gateway's loop."""
        digest = sha256(data)
        path = self._blob_dir + digest
        if digest in self._present or _exists(path):
            self._remember(digest)
            return digest
        tmp = f"{path}.tmp{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._dirty = True
        self._remember(digest)
        return digest

    def _remember(self, digest: str) -> None:
        """Blobs known to be stored (this log never deletes one): a repeated request or
        response skips the stat. Bounded: forgotten all at once when full."""
        if len(self._present) >= KNOWN_BLOBS:
            self._present.clear()
        self._present.add(digest)

    def next_seq(self) -> int:
        with self._lock:
            s = self._seq
            self._seq += 1
            return s

    def append(self, rec: CallRecord) -> None:
        line = (rec.model_dump_json() + "\n").encode()
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.index, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(self._fd, line)
            self._dirty = True

    def close(self) -> None:
        self.sync()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def sync(self) -> None:
        """fsync the index and the blob directory (cheap when nothing changed)."""
        with self._lock:
            if not self._dirty:
                return
            self._dirty = False
        for path in (self.index, self.blobs, self.root):
            if path.exists():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    @staticmethod
    def now() -> str:
        return datetime.now(UTC).isoformat(timespec="milliseconds")

    # -- reading ---------------------------------------------------------------
    def records(self) -> list[CallRecord]:
        """Every call record (runner.loading rules); IntegrityError naming the line and
        field of one that does not read (the log is only ever appended by the gateway)."""
        if not self.index.exists():
            return []
        try:
            return load_lines(self.index, CallRecord, what="call log", max_bytes=MAX_INDEX_BYTES,
                              fix="the call log is written by the gateway only; keep the run "
                                  "as evidence and run the cycle again")
        except ConfigError as exc:
            raise IntegrityError(f"unreadable call record: {exc}") from None

    def blob(self, digest: str) -> bytes:
        """Bytes of a blob, verified against its name; IntegrityError when missing or altered."""
        if not re.fullmatch(DIGEST, digest):
            raise IntegrityError(f"recorded blob name {digest[:80]!r} is not a sha256")
        path = self.blobs / digest
        try:  # a regular file, opened non-blocking: a FIFO or device is refused unread
            data = read_capped(path, max_bytes=MAX_BLOB_BYTES, what="recorded blob")
        except ConfigError as exc:
            raise IntegrityError(f"recorded blob {path} is missing or unreadable: {exc}"
                                 ) from None
        if sha256(data) != digest:
            raise IntegrityError(f"recorded blob {path} does not match its sha256 (corrupted)")
        return data
