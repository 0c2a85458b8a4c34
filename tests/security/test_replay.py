"""A recorded run handed to --replay / replay_from is hostile input: its plan.json
(read for the judge's identity) can neither crash the host nor plant an identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.cycle.config import JudgeSpec
from runner.cycle.plan import judge_identity

JUDGE = JudgeSpec(model="j", threshold=0.5)
FRESH = judge_identity(JUDGE, "up")


def _recorded(tmp_path: Path, text: str) -> str:
    (tmp_path / "plan.json").write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("text", [
    "[" * 100_000,                                        # RecursionError on the host
    '{"plan": ' * 50_000 + "{}" + "}" * 50_000,
])
def test_a_nested_recorded_plan_does_not_crash_the_host(tmp_path: Path, text: str) -> None:
    assert judge_identity(JUDGE, "up", replay_from=_recorded(tmp_path, text)) == FRESH


@pytest.mark.parametrize("judge_id", ["\x1b]0;pwned\x07", "x" * 100_000, "", "A" * 64])
def test_a_recorded_judge_id_that_is_no_digest_is_not_kept(tmp_path: Path,
                                                           judge_id: str) -> None:
    plan = {"plan": {"judge": JUDGE.model_dump(mode="json"), "judge_id": judge_id}}
    assert judge_identity(JUDGE, "up", replay_from=_recorded(tmp_path, json.dumps(plan))) \
        == FRESH


def test_a_recorded_digest_is_kept(tmp_path: Path) -> None:
    plan = {"plan": {"judge": JUDGE.model_dump(mode="json"), "judge_id": "ab" * 32}}
    assert judge_identity(JUDGE, "up", replay_from=_recorded(tmp_path, json.dumps(plan))) \
        == "ab" * 32


def test_a_recorded_digest_cannot_name_a_file_outside_the_blobs(tmp_path: Path) -> None:
    """calls.jsonl of a recorded run names its response by digest; a digest that is a
    path (``../../fifo``) made the host gateway open a file outside the run: a FIFO hung
    it, /dev/zero filled its memory."""
    import asyncio
    import hashlib
    import os
    import threading

    from runner.errors import IntegrityError
    from runner.gateway.calllog import CallLog, CallRecord
    from runner.gateway.providers import ReplayProvider

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    run = tmp_path / "run"
    log = CallLog(run / "gateway")
    request = b'{"model":"m","messages":[]}'
    traversal = "../" * 3 + "fifo"
    assert (log.blobs / traversal).resolve() == fifo.resolve()
    rec = CallRecord(seq=0, ts=CallLog.now(), run_id="r", role="analyst", upstream="u",
                     stage="baseline", turn=0, provider="openai", model="m",
                     fixture=False, status="ok", http_status=200, latency_s=0.1,
                     request_sha256=log.put_blob(request), response_sha256="0" * 64)
    line = rec.model_dump_json().replace("0" * 64, traversal)
    log.index.write_text(line + "\n")
    outcome: list[object] = []

    def replay() -> None:
        try:
            prov = ReplayProvider(run)
            outcome.append(asyncio.run(prov.call(request, {}, role="analyst",
                                                 stream=False)))
        except IntegrityError as exc:
            outcome.append(exc)

    t = threading.Thread(target=replay, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():                       # unblock the open() the old code hung in
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("the replay opened a file outside the recorded blobs (hung on a FIFO)")
    assert len(outcome) == 1 and isinstance(outcome[0], IntegrityError), outcome
    assert hashlib.sha256(request).hexdigest() != traversal


def test_a_recorded_blob_that_is_a_fifo_is_refused_unread(tmp_path: Path) -> None:
    """A well-formed digest whose blob is a symlink to a FIFO (or /dev/zero) in the
    recorded run: refused as not a regular file, never opened blocking or read whole."""
    import hashlib
    import os
    import threading

    from runner.errors import IntegrityError
    from runner.gateway.calllog import CallLog

    log = CallLog(tmp_path / "gateway")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    digest = hashlib.sha256(b"x").hexdigest()
    (log.blobs / digest).symlink_to(fifo)
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(log.blob(digest))
        except IntegrityError as exc:
            outcome.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("the recorded blob was opened blocking (hung on a FIFO)")
    assert len(outcome) == 1 and isinstance(outcome[0], IntegrityError), outcome


def test_a_recorded_call_log_that_is_a_fifo_is_refused_unread(tmp_path: Path) -> None:
    """The recorded run can change between freeze (which checks calls.jsonl is a file)
    and the run: a FIFO there hung the gateway's start (the writer counted its lines)."""
    import os
    import threading

    from runner.errors import ConfigError, IntegrityError
    from runner.gateway.providers import ReplayProvider

    (tmp_path / "gateway" / "blobs").mkdir(parents=True)
    fifo = tmp_path / "gateway" / "calls.jsonl"
    os.mkfifo(fifo)
    outcome: list[object] = []

    def start() -> None:
        try:
            outcome.append(ReplayProvider(tmp_path))
        except (ConfigError, IntegrityError) as exc:
            outcome.append(exc)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("the recorded call log was opened blocking (hung on a FIFO)")
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigError | IntegrityError), outcome


def test_a_recorded_log_is_hashed_streamed_and_only_as_a_regular_file(
        tmp_path: Path) -> None:
    """Freeze binds the replay log's bytes into the upstream id: it read the whole file
    into memory (a huge sparse log) and opened it blocking (a FIFO swapped in)."""
    import hashlib
    import os
    import threading
    import tracemalloc

    from runner.cycle.plan import upstream_id
    from runner.errors import ConfigError
    from runner.gateway.config import parse_upstream
    from runner.hashing import canonical_bytes

    up = parse_upstream({"provider": "replay", "replay_from": str(tmp_path), "models": ["m"]})
    log = tmp_path / "calls.jsonl"
    with open(log, "wb") as f:
        f.truncate(48 * 1024 * 1024)
    tracemalloc.start()
    try:
        got = upstream_id(up, log, field="upstreams.target")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    want = hashlib.sha256(canonical_bytes(up.model_dump(
        mode="json", exclude={"script", "replay_from"})) + log.read_bytes()).hexdigest()
    assert got == want and peak < 8 * 1024 * 1024
    log.unlink()
    os.mkfifo(log)
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(upstream_id(up, log, field="upstreams.target"))
        except ConfigError as exc:
            outcome.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(log, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("the replay log was opened blocking (hung on a FIFO)")
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigError), outcome


def test_a_call_log_of_gigabytes_on_one_line_is_not_read_to_open_it(tmp_path: Path) -> None:
    """Opening a copied run's call log counted its lines by iterating them: a sparse 3 GB
    calls.jsonl of one line took 2.4 GB of memory (``gateway calls``, export, verify).
    A reader counts nothing and creates nothing; ``records()`` refuses the file by its
    size; the gateway's own writer counts newlines in bounded pieces."""
    import resource

    from runner.errors import IntegrityError
    from runner.gateway.calllog import MAX_INDEX_BYTES, CallLog, _lines_in

    gw = tmp_path / "gateway"
    gw.mkdir()
    with (gw / "calls.jsonl").open("wb") as f:
        f.truncate(3 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    log = CallLog.reader(gw)
    assert not (gw / "blobs").exists()
    with pytest.raises(IntegrityError, match="limit"):
        log.records()
    with (tmp_path / "one.jsonl").open("wb") as f:  # under the cap, one line
        f.truncate(MAX_INDEX_BYTES // 8)
        f.seek(0, 2)
        f.write(b"\n")
    assert _lines_in(tmp_path / "one.jsonl") == 1
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024, f"opening the logs took {grown_kib} KiB"


@pytest.mark.parametrize(("field", "value"), [
    ("usage", {"prompt_tokens": int("9" * 4000), "completion_tokens": 1,
               "total_tokens": 1}),
    ("cost_usd", 1.7e308), ("latency_s", 1.7e308), ("seq", int("9" * 4000)),
])
def test_a_copied_logs_unbounded_numbers_are_refused_by_name(
        tmp_path: Path, field: str, value: object) -> None:
    """An attack review: 4000-digit token counts summed past what Python prints (report,
    gateway calls and verify ended exit 10) and costs of 1.7e308 summed to infinity
    (reported as "inf USD, complete"). Every count and amount of a record is bounded."""
    from runner.errors import IntegrityError
    from runner.gateway.calllog import CallLog

    gw = tmp_path / "gateway"
    gw.mkdir()
    rec = {"seq": 0, "ts": "2026-01-01T00:00:00.000+00:00", "run_id": "r", "role": "analyst",
           "upstream": "u", "stage": "s", "turn": 0, "provider": "scripted", "model": "m",
           "fixture": True, "status": "ok", "latency_s": 0.1, "request_sha256": "a" * 64}
    (gw / "calls.jsonl").write_text(json.dumps({**rec, field: value}) + "\n")
    with pytest.raises(IntegrityError, match=rf"calls\.jsonl:1: {field}"):
        CallLog.reader(gw).records()
    (gw / "calls.jsonl").write_text(json.dumps(rec) + "\n")
    assert len(CallLog.reader(gw).records()) == 1
