"""The host half of the holder's channels (:mod:`sandbox.holder`), over one attach made
before start: the holder's stdin (the seed tar, the case hand-over), its stdout
(:data:`~sandbox.holder.READY`, then frames: the role command's output, its start and exit
status, the output tar) and its stderr (the holder's status lines).

:class:`CaseChannel` parses the engine's multiplexed attach stream and the holder's frames;
it hands the role's output to a sink, notes start and exit, and passes on only the
readiness marker, the tar and the status lines to :class:`_CopyOut`, which extracts the
tar as it streams (:func:`runner.isolation.copyout.extract`). Every byte here came from a
container: frames are bounded (:data:`~sandbox.holder.FRAME_MAX`), status lines capped,
JSON parsed strictly; a frame the holder never writes ends the channel as refused.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests.exceptions

from runner.errors import OutputRejected
from runner.failures import is_environment_error
from runner.isolation.collect import loads_strict
from runner.isolation.copyout import CopyRefused, Extracted, extract, limits_for
from runner.isolation.sandbox import RunSpec
from sandbox.holder import (
    EARLY_BYTES,
    F_CASE,
    F_EXIT,
    F_SEED,
    F_SEEDED,
    F_STARTED,
    F_STATUS,
    F_STDERR,
    F_STDOUT,
    F_STOP,
    F_TAR,
    F_WARM,
    FRAME_HEADER,
    FRAME_MAX,
    READY,
    SEAL_KEY_BYTES,
    TAG_BYTES,
    Seal,
    case_payload,
    frame,
)

TAIL_BYTES = 64 * 1024
STOP_GRACE_S = 5.0
"""How long the holder gets to announce its copy-out after a SIGUSR1 (and role
processes to die) before the controller kills the container."""
STATUS_CAP = 64 * 1024
SMALL_FRAME_CAP = 4096
"""The largest start/exit/seed reply the holder writes (JSON of a few fields)."""
MUX_HEADER = struct.Struct(">BxxxL")
"""The engine's attach multiplexing: stream (1 stdout, 2 stderr), payload size."""

Sink = Callable[[str, bytes], None]


def mux_stream(raw: socket.socket) -> Iterator[tuple[bytes | None, bytes | None]]:
    """The engine's multiplexed attach stream (no tty) as (stdout, stderr) chunks, each
    at most 64 KiB, until the stream ends or the socket fails."""
    def exactly(n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            got = raw.recv(n - len(buf))
            if not got:
                return None
            buf += got
        return bytes(buf)

    with contextlib.suppress(OSError):
        while (head := exactly(MUX_HEADER.size)) is not None:
            stream, size = MUX_HEADER.unpack(head)
            while size:
                got = raw.recv(min(size, 1 << 16))
                if not got:
                    return
                size -= len(got)
                if stream == 1:
                    yield got, None
                elif stream == 2:
                    yield None, got


class CaseChannel:
    """The attach (stdin, stdout, stderr) of one holder; see the module docstring."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock  # keeps the HTTP response (and so the connection) alive
        self.raw: socket.socket = getattr(sock, "_sock", sock)
        self.raw.settimeout(None)
        self.sink: Sink | None = None
        """Receives ("stdout" | "stderr", chunk) of the role command, in order."""
        self.started = threading.Event()
        self.start_error = ""
        self.seeded = threading.Event()
        self.seed_reply: dict[str, Any] = {}
        self.ended = threading.Event()
        """Set on the exit status, or when the stream ended without one."""
        self.exit_code: int | None = None
        self.exit_reported = False
        self.handed_at: float | None = None
        """``time.monotonic()`` just after the case frame was sent."""
        self.started_at: float | None = None
        """When the holder's start frame arrived (host clock)."""
        self.first_output_at: float | None = None
        """When the first output frame of the role command arrived (host clock)."""
        self._lock = threading.Lock()
        self._seal: Seal | None = None
        """Set with the hand-over (or the warm start): every frame after it must carry
        its tag."""
        self._go_token: bytes | None = None
        self._sink_lock = threading.Lock()
        self._early: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._early_bytes = 0
        self.early_dropped = {"stdout": 0, "stderr": 0}
        """Bytes the role wrote before the hand-over beyond :data:`EARLY_BYTES`, per stream
        (counted into the run's output totals, not kept; the holder itself reads no more
        than that before the hand-over)."""
        self.refused = ""
        """Why the channel was refused (a frame the holder cannot have written)."""
        self.case_sent = False
        """The hand-over was sent: no start, exit or output tar can come before it (a
        warm import that ended its own container early must not pass for the case)."""

    def send(self, kind: bytes, payload: bytes) -> None:
        with self._lock:
            if kind == F_CASE:
                self.case_sent = True  # before the bytes: the reply may come at once
            self.raw.sendall(frame(kind, payload))
            if kind == F_CASE:
                self.handed_at = time.monotonic()

    def seed(self, data: bytes) -> None:
        self.send(F_SEED, data)

    def ask_stop(self) -> None:
        """The host ends the case: the holder acts on this frame and a ``SIGUSR1`` from
        outside together (:data:`sandbox.holder.F_STOP`)."""
        self.send(F_STOP, b"")

    def hand_over(self, argv: list[str]) -> None:
        """Send the case: the command and a fresh key for the frames about it; after
        :meth:`warm`, its key alone (the interpreter waiting there goes on)."""
        if self._go_token is not None:
            self.send(F_CASE, self._go_token)
            return
        import secrets

        key = secrets.token_bytes(SEAL_KEY_BYTES)
        self._seal = Seal(key)  # before the send: the first sealed frame may come at once
        self.send(F_CASE, case_payload(key, argv))

    def warm(self, argv: list[str], modules: Sequence[str]) -> None:
        """Start the command's interpreter ahead of the case (:data:`F_WARM`): it imports
        ``modules`` and waits for :meth:`hand_over`. Sent once the holder is READY and
        any seed answered, so no unsealed frame can follow the key; whatever the
        interpreter writes meanwhile is held (bounded) for the run's sink."""
        import secrets

        key = secrets.token_bytes(SEAL_KEY_BYTES)
        token = secrets.token_bytes(SEAL_KEY_BYTES)
        self._seal = Seal(key)
        self._go_token = token  # the hand-over sends this, never the key again
        self.send(F_WARM, key + token + b"\0".join(
            a.encode("utf-8", "surrogateescape") for a in [",".join(modules), *argv]))

    def attach(self, sink: Sink) -> None:
        """Give the run's sink what the role wrote before it (a warm start's imports,
        at most :data:`EARLY_BYTES` kept; the rest counted as dropped), then all after."""
        with self._sink_lock:
            for kind, data in self._early.items():
                if data:
                    sink(kind, bytes(data))
            self._early.clear()
            self.sink = sink

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.raw.close()

    def stream(self) -> Iterator[tuple[bytes | None, bytes | None]]:
        """What :class:`_CopyOut` reads: the marker and the tar as stdout, the status lines
        as stderr; every other frame is dispatched here, as it arrives."""
        head = bytearray()
        buf = bytearray()
        framed = False
        try:
            for o, e in mux_stream(self.raw):
                if e and self._seal is None:
                    # the holder's own stderr, before any role process exists (e.g. its
                    # relay's refusal); afterwards its status lines come as sealed frames
                    # and raw stderr is dropped (under gVisor a role can reach it)
                    yield None, e
                if not o:
                    continue
                if not framed:
                    head += o
                    if len(head) < len(READY):
                        continue
                    if not head.startswith(READY):
                        yield bytes(head), None  # _CopyOut names the missing marker
                        return
                    framed = True
                    yield READY, None
                    buf += head[len(READY):]
                else:
                    buf += o
                while len(buf) >= FRAME_HEADER:
                    kind = bytes(buf[:1])
                    n = int.from_bytes(buf[1:FRAME_HEADER], "big")
                    if n > FRAME_MAX:
                        raise CopyRefused(f"case channel: a frame of {n} bytes "
                                          f"(at most {FRAME_MAX})")
                    seal = self._seal
                    end = FRAME_HEADER + n + (TAG_BYTES if seal is not None else 0)
                    if len(buf) < end:
                        break
                    payload = bytes(buf[FRAME_HEADER:FRAME_HEADER + n])
                    if seal is not None and not hmac.compare_digest(
                            seal.tag(bytes(buf[:FRAME_HEADER]), payload),
                            bytes(buf[FRAME_HEADER + n:end])):
                        raise CopyRefused("case channel: a frame failed authentication "
                                          "(bytes the holder did not write)")
                    del buf[:end]
                    if kind == F_TAR:
                        if not self.case_sent:
                            raise CopyRefused("case channel: the output tar came before the "
                                              "case was handed over")
                        yield payload, None
                    elif kind == F_STATUS and len(payload) <= STATUS_CAP:
                        yield None, payload
                    else:
                        self._dispatch(kind, payload)
        except CopyRefused as exc:
            self.refused = str(exc)
            raise
        finally:
            self.started.set()
            self.seeded.set()
            self.ended.set()

    def _dispatch(self, kind: bytes, payload: bytes) -> None:
        if kind in (F_STDOUT, F_STDERR):
            if self.first_output_at is None:
                self.first_output_at = time.monotonic()
            name = "stdout" if kind == F_STDOUT else "stderr"
            with self._sink_lock:
                if self.sink is not None:
                    self.sink(name, payload)
                elif self._early_bytes + len(payload) <= EARLY_BYTES:
                    self._early[name] += payload
                    self._early_bytes += len(payload)
                else:
                    self.early_dropped[name] += len(payload)
            return
        if kind not in (F_STARTED, F_EXIT, F_SEEDED) or len(payload) > SMALL_FRAME_CAP:
            raise CopyRefused(f"case channel: unexpected frame {kind!a} of "
                              f"{len(payload)} bytes")
        try:
            doc = loads_strict(payload.decode("utf-8", "replace"), source="holder frame")
        except OutputRejected as exc:
            raise CopyRefused(f"case channel: {exc}") from None
        if not isinstance(doc, dict):
            raise CopyRefused("case channel: a frame that is not a JSON object")
        if kind == F_STARTED and not self.case_sent:
            raise CopyRefused("case channel: a start frame before the case was handed over")
        if kind == F_EXIT and self.started_at is None:
            raise CopyRefused("case channel: an exit status before the command was started")
        if kind == F_STARTED:
            self.started_at = time.monotonic()
            self.start_error = str(doc.get("error") or "")[:500]
            self.started.set()
        elif kind == F_SEEDED:
            self.seed_reply = doc
            self.seeded.set()
        elif not self.exit_reported:  # F_EXIT: once; the holder writes exactly one
            code = doc.get("code")
            self.exit_code = code if isinstance(code, int) and not isinstance(code, bool) \
                and 0 <= code <= 255 else None
            self.exit_reported = True
            self.ended.set()


@dataclass
class _Finish:
    """What the copy-out found."""

    oom_kills: int = 0
    limit: bool = False
    invalid: bool = False
    detail: str = ""
    egress: tuple[str, ...] = ()
    egress_count: int = 0


EGRESS_MAX_HOSTS = 16
EGRESS_HOST_CHARS = 120


def egress_refused(pre: Mapping[str, Any]) -> tuple[tuple[str, ...], int]:
    """The hosts and the count of requests the holder's deny-all proxy refused, from its
    status line (written by the role's container, so bounded and escaped again here)."""
    hosts = pre.get("egress_refused")
    count = pre.get("egress_refused_count")
    names = [h for h in (hosts if isinstance(hosts, list) else []) if isinstance(h, str)]
    shown = tuple(ascii(h[:EGRESS_HOST_CHARS])[1:-1][:EGRESS_HOST_CHARS]
                  for h in names[:EGRESS_MAX_HOSTS])
    n = count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else 0
    return shown, max(n, len(shown))


class _CopyOut:
    """Reads the holder's own stdout/stderr (attached before start): its status lines
    and the output tar, extracted as it streams by :func:`runner.isolation.copyout.extract`."""

    def __init__(self, spec: RunSpec, seed_links: dict[str, str],
                 stream: Iterator[tuple[bytes | None, bytes | None]]) -> None:
        self.spec = spec
        self.seed_links = seed_links
        self.stream = stream
        self.announced = threading.Event()
        """Set when the holder's first status line arrived (it got our SIGUSR1)."""
        self.ready = threading.Event()
        """Set when the holder's stdout began (``ready_ok``: with :data:`READY`) or ended."""
        self.ready_ok = False
        self.done = threading.Event()
        """Set once the copy-out is decided: refused, the stream ended, or the holder's
        last status line (``post``, after the whole tar; ``finished``) arrived. The
        holder writes nothing after that line and only exits, so the case is over
        without waiting for the engine to close the stream (~25 ms)."""
        self.finished = False
        self.closed = threading.Event()
        """Set when the stream ended (the holder exited, or the attach broke)."""
        self.errs = _Tail()
        self._extracted = spec.output_dir is None
        """The tar (if any) was read to its end: a ``post`` line now ends the copy-out."""
        self.got: Extracted | BaseException | None = None
        self._thread = threading.Thread(target=self._consume, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _chunks(self) -> Iterator[bytes]:
        cleared = False
        head = b""
        for o, e in self.stream:
            if e and self.errs.total < STATUS_CAP:
                self.errs.add(e)
                if b"\n" in e:
                    self.announced.set()
                    if self._extracted and "post" in _status(self.errs.text()):
                        self.finished = True
                        self.done.set()
            data = o
            if data and not self.ready.is_set():
                # the holder's readiness marker (written before any role process exists)
                head += data
                if len(head) < len(READY):
                    continue
                self.ready_ok = head.startswith(READY)
                self.ready.set()
                if not self.ready_ok:
                    raise CopyRefused("output stream: the holder's readiness marker is missing")
                data = head[len(READY):]
            if data:
                if not cleared and self.spec.output_dir is not None:
                    _clear(self.spec.output_dir)  # host-made seed content, if any
                    cleared = True
                yield data

    def _consume(self) -> None:
        spec = self.spec
        chunks = self._chunks()
        try:
            if spec.output_dir is not None:
                lim = limits_for(spec.role, max_bytes=spec.output_cap_bytes,
                                 max_entries=spec.output_max_entries)
                self.got = extract(chunks, spec.output_dir, lim, seed_links=self.seed_links)
                self._extracted = True
        except BaseException as exc:
            self.got = exc
            self.ready.set()
            self.done.set()  # refused: decided now; the rest is drained and dropped
        try:
            # Keep reading to the end (the status line follows the tar), dropping any
            # bytes: a writer blocked on an unread pipe would also block the engine's
            # kill and removal of the container.
            for _ in chunks:
                pass
        except (requests.exceptions.RequestException, OSError, ValueError, OutputRejected):
            pass  # a broken stream or channel: nothing more to read from it
        finally:
            self.ready.set()  # the stream ended: whoever waits for the marker stops
            self.done.set()
            self.closed.set()

    def result(self, *, holder_gone: bool = False) -> _Finish:
        """What the copy-out found; ``holder_gone``: the container stopped (killed from
        outside), so no status line can still be on its way."""
        fin = _Finish()
        spec = self.spec
        if not self.done.is_set():
            fin.invalid, fin.detail = True, "copy-out did not finish in time"
            return fin
        got = self.got
        if isinstance(got, BaseException) and is_environment_error(got):
            # the host's own disk, quota or descriptors ran out while it wrote the output:
            # not the container's doing (an environment failure, as on the Ray backend)
            raise got
        if isinstance(got, CopyRefused):
            # decided before the end of the stream: the status line, written before
            # the tar but on the other pipe, may still be on its way
            self.announced.wait(0 if holder_gone else STOP_GRACE_S)
        status = _status(self.errs.text())
        pre, post = status.get("pre"), status.get("post")
        if pre is None or (post is None and not isinstance(got, CopyRefused)):
            fin.invalid = True
            fin.detail = "container stopped before its output could be copied out"
            return fin
        with contextlib.suppress(TypeError, ValueError):
            fin.oom_kills = int(pre.get("oom_kill") or 0)
        fin.egress, fin.egress_count = egress_refused(pre)
        if pre.get("dumpable") != 0:
            fin.invalid = True
            fin.detail = "the holder could not protect its output stream (dumpable)"
            return fin
        df = pre.get("df") if isinstance(pre.get("df"), dict) else None
        # gVisor's tmpfs reports no inode counts (files 0): only a real count can be full;
        # the host's extractor still caps entries there.
        full = df is not None and (df.get("bfree") == 0 or (
            df.get("ffree") == 0 and isinstance(df.get("files"), int) and df["files"] > 0))
        if full:
            fin.limit = True
            fin.detail = (f"output tmpfs full ({spec.output_cap_bytes} bytes, "
                          f"{spec.output_max_entries} entries); further writes got ENOSPC")
        # the holder left out a (sparse) file bigger than the output directory itself
        over = post.get("limit") if post is not None else None
        if over:
            fin.limit = True
            fin.detail = "; ".join(x for x in (fin.detail, f"output cap: {str(over)[:300]}")
                                   if x)
        if isinstance(got, CopyRefused):
            fin.limit = fin.limit or got.limit
            fin.invalid = not fin.limit
            fin.detail = "; ".join(x for x in (fin.detail, str(got)) if x)
        elif isinstance(got, BaseException):
            fin.invalid, fin.detail = True, f"copy-out failed: {type(got).__name__}: {got}"
        elif spec.output_dir is not None and not fin.limit:
            errors = post.get("errors") if post is not None else None
            if errors or pre.get("others_left"):
                fin.invalid = True
                fin.detail = ("copy-out reported: "
                              + ("; ".join(map(str, errors or [])) or "processes left"))[:500]
        return fin


def _holder_said(text: str) -> str:
    """The holder's own refusal before READY (e.g. its loopback relay could not listen),
    bounded and escaped, for the error message; empty when it said nothing of the kind."""
    for line in text.splitlines()[:4]:
        if line.startswith("relay: "):
            return f" ({ascii(line[:200])[1:-1]})"
    return ""


def _status(text: str) -> dict[str, dict[str, Any]]:
    """The holder's status lines by phase ("pre" before the tar, "post" after it)."""
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines()[:8]:
        try:
            got = loads_strict(line[:STATUS_CAP], source="copy-out status")
        except OutputRejected:
            continue
        if isinstance(got, dict) and got.get("phase") in ("pre", "post"):
            out.setdefault(str(got["phase"]), got)
    return out


def _clear(root: Path) -> None:
    """Empty a host output directory that held host-made seed content."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)



class _Tail:
    """Counts a byte stream and keeps its last TAIL_BYTES."""

    def __init__(self) -> None:
        self.total = 0
        self.buf = bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.buf += chunk
        if len(self.buf) > TAIL_BYTES:
            del self.buf[: len(self.buf) - TAIL_BYTES]

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


