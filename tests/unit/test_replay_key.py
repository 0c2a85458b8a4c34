"""Replay of requests that carry per-run ids (Codex CLI, Claude Code): matched by the
request without them, answered with the recorded bytes; any change in what the model is
asked still misses."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

from runner.gateway.calllog import CallLog, CallRecord
from runner.gateway.providers import CallSite, ReplayProvider
from runner.gateway.replay_key import stable_key

UUID_A = "01a23326-1f2c-7f51-9607-5feb05d77656"
UUID_B = "01a23328-86e2-73c2-991c-540621bd31b7"


def _codex(session: str, text: str = "Read /case/input.json") -> bytes:
    body = {"model": "m", "stream": True, "store": False,
            "prompt_cache_key": session,
            "client_metadata": {"session_id": session, "turn_started_at_unix_ms": 1796154466130
                                if session == UUID_A else 1796154999999},
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": text}]},
                      {"type": "function_call_output", "id": f"fco_{session}",
                       "call_id": "call_1", "output": "{}"}]}
    return json.dumps(body).encode()


def _claude(session: str, text: str = "hi") -> bytes:
    body = {"model": "m", "max_tokens": 8, "metadata": {"user_id": json.dumps(
        {"device_id": "d", "session_id": session})},
        "messages": [{"role": "user", "content": text}]}
    return json.dumps(body).encode()


def test_the_key_ignores_ids_never_content() -> None:
    assert stable_key(_codex(UUID_A), "responses") == stable_key(_codex(UUID_B), "responses")
    assert stable_key(_codex(UUID_A), "responses") != stable_key(
        _codex(UUID_B, "Read /case/other.json"), "responses")
    assert stable_key(_claude(UUID_A), "messages") == stable_key(_claude(UUID_B), "messages")
    assert stable_key(_claude(UUID_A), "messages") != stable_key(
        _claude(UUID_B, "hi!"), "messages")
    # metadata is volatile only where the family defines it so
    assert stable_key(b'{"input": "x", "metadata": 1}', "count_tokens") != stable_key(
        b'{"input": "x"}', "count_tokens")
    assert stable_key(b"[1]", "chat") is None
    assert stable_key(b"not json", "chat") is None


def test_replay_answers_a_fresh_run_of_a_cli_with_the_recorded_bytes(tmp_path: Path) -> None:
    log = CallLog(tmp_path / "gateway")
    site = CallSite("analyst", "baseline", "c1", 0, 0)
    recorded = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
    log.append(CallRecord(
        seq=log.next_seq(), ts=CallLog.now(), run_id="r", role="analyst", upstream="u",
        stage=site.stage, case=site.case, trial=site.trial, turn=site.turn, api="responses",
        provider="scripted", model="m", fixture=True, status="ok", http_status=200,
        latency_s=0.1, request_sha256=log.put_blob(_codex(UUID_A)),
        response_sha256=log.put_blob(recorded)))
    log.close()
    prov = ReplayProvider(tmp_path)

    def call(request: bytes) -> tuple[str | None, bytes | None]:
        res = asyncio.run(prov.call(request, json.loads(request), role="analyst",
                                    stream=True, site=site, api="responses"))
        # the call is counted in the receipt as the recording that answered it
        assert res.replay_of == (None if res.error else hashlib.sha256(_codex(UUID_A)
                                                                       ).hexdigest())
        return res.error, res.response

    assert call(_codex(UUID_B))[1] == recorded
    assert call(_codex(UUID_A))[1] == recorded
    assert call(_codex(UUID_B, "Read /case/other.json"))[0] == "replay_miss"
    assert prov.pick("0" * 64, site, "messages", _codex(UUID_B)) is None  # other family


def test_codex_exec_output_head_is_masked_its_output_is_not() -> None:
    def req(chunk: str, wall: str, out: str) -> bytes:
        text = f"Chunk ID: {chunk}\nWall time: {wall} seconds\nProcess exited with code 0\n"
        return json.dumps({"model": "m", "input": [{"type": "function_call_output",
                                                     "call_id": "c", "output": text + out}]}
                          ).encode()

    a = stable_key(req("765f32", "1.3057", "payments-db"), "responses")
    assert a == stable_key(req("3b53ec", "0.2", "payments-db"), "responses")
    assert a != stable_key(req("3b53ec", "0.2", "payments-dB"), "responses")
