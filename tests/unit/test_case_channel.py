"""The host half of the holder's case channel (runner/isolation/docker/channel.py) on a
socket pair standing in for the engine's attach stream: the engine's multiplexing, the
holder's frames split anywhere, the seal after the hand-over (a frame with a wrong,
replayed or missing tag is refused), and what is passed on to the copy-out."""

from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Any

import pytest

from runner.isolation.copyout import CopyRefused
from runner.isolation.docker.channel import CaseChannel
from sandbox.holder import (
    F_EXIT,
    F_STARTED,
    F_STATUS,
    F_STDERR,
    F_STDOUT,
    F_TAR,
    FRAME_HEADER,
    READY,
    SEAL_KEY_BYTES,
    TAG_BYTES,
    Seal,
    frame,
)


def mux(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(data)) + data


class Holder:
    """The container's side: reads the case frame, writes frames as the holder does."""

    def __init__(self) -> None:
        self.host, self.box = socket.socketpair()
        self.seal: Seal | None = None

    def case(self) -> list[bytes]:
        head = self.box.recv(FRAME_HEADER, socket.MSG_WAITALL)
        n = int.from_bytes(head[1:], "big")
        payload = self.box.recv(n, socket.MSG_WAITALL)
        self.seal = Seal(payload[:SEAL_KEY_BYTES])
        return payload[SEAL_KEY_BYTES:].split(b"\0")

    def frame(self, kind: bytes, payload: bytes, *, seal: Seal | None = None) -> bytes:
        data = frame(kind, payload)
        use = seal or self.seal
        return data + (use.tag(data[:FRAME_HEADER], payload) if use is not None else b"")

    def send(self, data: bytes, *, stream: int = 1, pieces: int = 1) -> None:
        step = max(1, len(data) // pieces)
        for i in range(0, len(data), step):
            self.box.sendall(mux(stream, data[i:i + step]))


def consume(ch: CaseChannel) -> tuple[list[tuple[bytes | None, bytes | None]],
                                      threading.Thread, list[BaseException]]:
    got: list[tuple[bytes | None, bytes | None]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            got.extend(ch.stream())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return got, t, errors


def _pair() -> tuple[Holder, CaseChannel, list[tuple[str, bytes]]]:
    h = Holder()
    ch = CaseChannel(h.host)
    seen: list[tuple[str, bytes]] = []
    ch.sink = lambda kind, data: seen.append((kind, data))
    return h, ch, seen


def _hand_over(h: Holder, ch: CaseChannel) -> None:
    ch.hand_over(["echo", "", "hi"])
    assert h.case() == [b"echo", b"", b"hi"]


def test_a_run_as_the_holder_writes_it() -> None:
    h, ch, seen = _pair()
    got, t, errors = consume(ch)
    h.send(READY[:4])
    h.send(READY[4:] + b"")
    h.send(b"relay: before any role\n", stream=2)  # the holder's own stderr, pre-case
    for _ in range(1000):  # read before the hand-over, as the host waits for READY
        if len(got) >= 2:
            break
        threading.Event().wait(0.01)
    _hand_over(h, ch)
    body = (h.frame(F_STARTED, b'{"pid": 7}') + h.frame(F_STDOUT, b"hi\n")
            + h.frame(F_STDERR, b"warn\n") + h.frame(F_EXIT, b'{"code": 3}')
            + h.frame(F_STATUS, b'{"phase": "pre"}\n') + h.frame(F_TAR, bytes(1024)))
    h.send(body, pieces=17)  # split anywhere, headers and tags included
    h.send(b"a role's bytes on raw stderr\n", stream=2)  # after the hand-over: dropped
    h.box.close()
    t.join(10)
    assert not errors, errors
    assert seen == [("stdout", b"hi\n"), ("stderr", b"warn\n")]
    assert ch.exit_code == 3 and ch.exit_reported and ch.ended.is_set()
    assert ch.handed_at is not None and ch.started_at is not None
    assert got[0] == (READY, None)
    assert (None, b"relay: before any role\n") in got
    assert (None, b'{"phase": "pre"}\n') in got
    assert b"".join(o for o, _ in got[1:] if o) == bytes(1024)
    assert not any(e and b"role" in e and b"relay" not in e for _, e in got)


def test_the_holders_post_status_with_long_unreadable_names_passes(tmp_path: Any) -> None:
    """A role leaves entries the holder cannot copy at long non-ASCII paths: their names,
    cut at ERROR_CHARS, escaped in the post status line, pass as the holder's own frame
    (a 4 KB cap on status frames refused the channel as forged, blaming the holder)."""
    import os

    from sandbox import holder

    d = str(tmp_path)
    for _ in range(6):
        d = os.path.join(d, "\u00e9" * 120)
        os.mkdir(d)
    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(d)
    try:
        sock.bind("\U0001f600" * 20)  # a socket: "not a regular file, directory, ..."
    finally:
        os.chdir(cwd)

    class Sink:
        def write(self, b: bytes) -> int:
            return len(b)

        def flush(self) -> None:
            pass

    errors: list[str] = []
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        holder._add_dir(Sink(), fd, b"", errors, holder._Budget(None))  # closes fd
    finally:
        sock.close()
    assert len(errors) == 1 and len(errors[0]) <= holder.ERROR_CHARS + 3
    for i in range(holder.MAX_ERRORS + 2):  # the most the holder reports: ~19 KB escaped
        holder._err(errors, f"{i}: " + "\U0001f600" * 400)
    line = (holder._json({"phase": "post", "errors": errors}) + "\n").encode()
    assert len(errors) == holder.MAX_ERRORS and len(line) > 4096
    h, ch, _ = _pair()
    got, t, errs = consume(ch)
    h.send(READY)
    _hand_over(h, ch)
    h.send(h.frame(F_STATUS, line))
    h.box.close()
    t.join(10)
    assert not errs, errs
    assert (None, line) in got and json.loads(line)["errors"] == errors


def _refused(frames: list[bytes], *, after_case: bool = True) -> str:
    h, ch, _ = _pair()
    _, t, errors = consume(ch)
    h.send(READY)
    if after_case:
        _hand_over(h, ch)
    for data in frames:
        h.send(data)
    h.box.close()
    t.join(10)
    assert ch.ended.is_set()
    assert errors and isinstance(errors[0], CopyRefused), errors
    assert ch.refused == str(errors[0])
    return ch.refused


def test_an_unsealed_or_forged_frame_after_the_hand_over_is_refused() -> None:
    # a frame without its tag: the next bytes are read as the tag and fail
    assert "authentication" in _refused([frame(F_EXIT, b'{"code": 0}') + bytes(16)])
    # a tag under another key (a role guessing, or replaying another container's)
    other = Seal(bytes(32))
    h, ch, _ = _pair()
    _, t, errors = consume(ch)
    h.send(READY)
    _hand_over(h, ch)
    h.send(h.frame(F_EXIT, b'{"code": 0}', seal=other))
    h.box.close()
    t.join(10)
    assert ch.exit_code is None and not ch.exit_reported
    assert errors and "authentication" in str(errors[0])


def test_a_replayed_frame_is_refused() -> None:
    h, ch, seen = _pair()
    _, t, errors = consume(ch)
    h.send(READY)
    _hand_over(h, ch)
    assert h.seal is not None
    first = h.frame(F_STDOUT, b"x")
    h.seal.seq -= 1  # the same bytes again: the sequence number in the tag differs
    h.send(first + first)
    h.box.close()
    t.join(10)
    assert seen == [("stdout", b"x")]
    assert errors and "authentication" in str(errors[0])


@pytest.mark.parametrize(("data", "why"), [
    (frame(b"Z", b"{}"), "unexpected frame"),
    (frame(F_STARTED, b"[1]"), "not a JSON object"),
    (b"q" + (1 << 30).to_bytes(4, "big"), "a frame of 1073741824 bytes"),
])
def test_frames_the_holder_never_writes_are_refused(data: bytes, why: str) -> None:
    assert why in _refused([data], after_case=False)


def _warm_pair() -> tuple[Holder, CaseChannel]:
    """A warm start's channel: sealed from the warm frame on, the case not yet handed."""
    h, ch, _ = _pair()
    ch.warm(["python", "/src/a.py"], ["openai"])
    head = h.box.recv(FRAME_HEADER, socket.MSG_WAITALL)
    payload = h.box.recv(int.from_bytes(head[1:], "big"), socket.MSG_WAITALL)
    h.seal = Seal(payload[:SEAL_KEY_BYTES])
    return h, ch


@pytest.mark.parametrize(("frames", "why"), [
    ([(F_EXIT, b'{"code": 0}')], "an exit status before the command was started"),
    ([(F_STARTED, b'{"pid": 7}'), (F_EXIT, b'{"code": 0}')],
     "a start frame before the case was handed over"),
    ([(F_TAR, bytes(1024))], "the output tar came before the case was handed over"),
])
def test_a_warm_start_cannot_end_its_case_before_the_hand_over(
        frames: list[tuple[bytes, bytes]], why: str) -> None:
    """Frames a warm start's holder would write had its case ended before the hand-over
    (a warm import signalling PID 1), sealed with the warm key: refused, the case not
    ended with an exit status; after the hand-over the same channel runs as usual."""
    h, ch = _warm_pair()
    _, t, errors = consume(ch)
    h.send(READY + b"".join(h.frame(kind, payload) for kind, payload in frames))
    h.box.close()
    t.join(10)
    assert errors and why in str(errors[0]), errors
    assert not ch.exit_reported and ch.exit_code is None


def test_a_warm_starts_frames_after_the_hand_over_pass() -> None:
    h, ch = _warm_pair()
    _, t, errors = consume(ch)
    h.send(READY)
    ch.hand_over(["python", "/src/a.py"])
    h.box.recv(FRAME_HEADER + SEAL_KEY_BYTES, socket.MSG_WAITALL)  # the go token alone
    h.send(h.frame(F_STARTED, b'{"pid": 7}') + h.frame(F_EXIT, b'{"code": 4}')
           + h.frame(F_TAR, bytes(1024)))
    h.box.close()
    t.join(10)
    assert not errors and ch.exit_code == 4


def test_no_marker_is_passed_on_for_the_copy_out_to_name() -> None:
    h, ch, _ = _pair()
    got, t, errors = consume(ch)
    h.send(b"x" * 64)
    h.box.close()
    t.join(10)
    assert not errors and got == [(b"x" * 64, None)]
    assert ch.ended.is_set() and ch.exit_code is None


@pytest.mark.parametrize("value", [
    None, True, 0, -3, "", "plain", 'q"uote\\back', "ctl\n\x00\x7f", "é€😀", "\udcff",
    ["a", 1, None], {"phase": "pre", "df": {"files": 0}, "errors": ["x: No such file"]},
])
def test_the_holders_own_json_is_json(value: object) -> None:
    from sandbox.holder import _json

    text = _json(value)
    assert text.isascii()
    assert json.loads(text) == value


def test_only_the_first_exit_frame_counts() -> None:
    h, ch, _ = _pair()
    _, t, errors = consume(ch)
    h.send(READY)
    _hand_over(h, ch)
    h.send(h.frame(F_STARTED, b'{"pid": 7}') + h.frame(F_EXIT, b'{"code": 3}')
           + h.frame(F_EXIT, b'{"code": 0}') + h.frame(F_EXIT, b'{"code": true}'))
    h.box.close()
    t.join(10)
    assert not errors and ch.exit_code == 3


def test_the_seal_is_hmac_sha256_of_sequence_head_and_payload() -> None:
    """The holder's own HMAC (over the builtin SHA-256, no OpenSSL at its start) equals
    the standard library's for every key length, in sequence."""
    import hashlib
    import hmac
    import os

    for klen in (0, 16, 32, 64, 65, 200):
        key = os.urandom(klen)
        seal = Seal(key)
        for seq, size in enumerate((0, 1, 63, 64, 65, 5000)):
            head, payload = os.urandom(5), os.urandom(size)
            want = hmac.new(key, seq.to_bytes(8, "big") + head + payload,
                            hashlib.sha256).digest()[:TAG_BYTES]
            assert seal.tag(head, payload) == want, (klen, seq)
