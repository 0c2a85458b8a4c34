"""Response inspection and the scripted provider (pure parts of the gateway)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from runner.errors import ConfigError
from runner.gateway.calllog import CallLog, CallRecord, Usage
from runner.gateway.config import (
    Price,
    ReplayUpstream,
    ScriptedUpstream,
    UpstreamPolicy,
    parse_upstream,
)
from runner.gateway.providers import (
    CallSite,
    ReplayProvider,
    ScriptedProvider,
    inspect,
    inspected,
)
from runner.gateway.server import cost_usd, make_provider
from runner.isolation.sandbox import Frozen
from runner.loading import validate


def inspect_completion(data: bytes) -> tuple[object, str | None]:
    return inspect(data, stream=False)


def inspect_stream(data: bytes) -> tuple[object, str | None]:
    return inspect(data, stream=True)


def test_inspect_completion() -> None:
    ok = json.dumps({"choices": [{"message": {"content": "x"}}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    usage, err = inspect_completion(ok)
    assert err is None and usage == Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    assert inspect_completion(b"<html>") == (None, "malformed_response")
    assert inspect_completion(b'{"choices": []}') == (None, "malformed_response")
    assert inspect_completion(b'{"choices": [{}], "x": NaN}') == (None, "malformed_response")
    usage, err = inspect_completion(b'{"choices": [{}]}')
    assert usage is None and err is None  # no usage: the caller treats cost as unknown


def test_inspect_stream() -> None:
    good = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
            b"data: [DONE]\n\n")
    usage, err = inspect_stream(good)
    assert err is None and usage == Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    assert inspect_stream(good[: good.index(b"data: [DONE]")])[1] == "truncated_stream"
    assert inspect_stream(b"data: {nope\n\ndata: [DONE]\n\n")[1] == "malformed_response"


def test_cost_unknown_never_zero() -> None:
    from runner.gateway.calllog import Usage

    u = Usage(prompt_tokens=1_000_000, completion_tokens=500_000, total_tokens=1_500_000)
    assert cost_usd(u, Price(input_per_mtok=2.0, output_per_mtok=4.0)) == 4.0
    assert cost_usd(None, Price(input_per_mtok=2.0, output_per_mtok=4.0)) is None
    assert cost_usd(u, None) is None


def _script(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


def test_scripted_rules_and_determinism(tmp_path: Path) -> None:
    p = _script(tmp_path, """
schema: 1
rules:
  - when: {role: worker, contains: ["ALWAYS"]}
    reply_json: {files: [], rationale: r}
  - when: {last_user_regex: "^q\\\\d+$"}
    reply: numbered
""")
    prov = ScriptedProvider(p)
    body = {"model": "m", "messages": [{"role": "system", "content": "ALWAYS cite"},
                                       {"role": "user", "content": "q1"}]}
    req = json.dumps(body).encode()
    r1 = asyncio.run(prov.call(req, body, role="worker", stream=False))
    r2 = asyncio.run(prov.call(req, body, role="worker", stream=False))
    assert r1.response == r2.response and r1.fixture
    assert json.loads(json.loads(r1.response or b"")["choices"][0]["message"]["content"]) == {
        "files": [], "rationale": "r"}
    r3 = asyncio.run(prov.call(req, body, role="analyst", stream=True))
    assert r3.error is None and b"numbered" in (r3.response or b"")
    miss = {"model": "m", "messages": [{"role": "user", "content": "other"}]}
    r4 = asyncio.run(prov.call(b"{}", miss, role="analyst", stream=False))
    assert r4.error == "script_no_match"


def test_script_errors_name_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rules\[0\]\.when"):
        ScriptedProvider(_script(tmp_path, "schema: 1\nrules:\n  - when: {regex: x}\n"
                                            "    reply: y\n"))
    with pytest.raises(ConfigError, match="schema"):
        ScriptedProvider(_script(tmp_path, "rules: []\n"))


@pytest.mark.parametrize(("reply", "key"), [
    pytest.param("{answer: '08:00', on: weekdays}", "True", id="yaml-on-is-a-boolean"),
    pytest.param("{unit: EUR, 2023: 700}", "2023", id="a-number-key"),
    pytest.param("{on: weekdays}", "True", id="alone-sent-as-true"),
    pytest.param("[{a: {1: x}}]", "1", id="nested"),
])
def test_a_reply_json_key_that_is_not_a_string_is_named(tmp_path: Path, reply: str,
                                                        key: str) -> None:
    """YAML reads an unquoted on: as True: mixed with string keys it was exit 10 (sorting
    bool and str), alone it was sent as {"true": ...}. Refused, naming the key."""
    with pytest.raises(ConfigError, match=rf"rules\[0\]: a mapping key {key} is not a string"):
        ScriptedProvider(_script(tmp_path, f"schema: 1\nrules:\n  - reply_json: {reply}\n"))


def _completion(text: str) -> bytes:
    return json.dumps({"id": text, "choices": [{"message": {"content": text}}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()


def test_replay_answers_duplicate_requests_as_recorded(tmp_path: Path) -> None:
    """A real server answers the same bytes differently (ids, sampling): each replayed
    call must get the recording of its own call site, not the first one made."""
    log = CallLog(tmp_path / "gateway")
    request = b'{"model":"m","messages":[{"role":"user","content":"grade this"}]}'
    sites = [CallSite("evaluator", "evaluate-baseline", None, None, 3),
             CallSite("analyst", "baseline", "c1", 0, 0),
             CallSite("analyst", "baseline", "c1", 1, 0)]
    for n, site in enumerate(sites):
        log.append(CallRecord(
            seq=log.next_seq(), ts=CallLog.now(), run_id="r", role=site.role, upstream="u",
            stage=site.stage, case=site.case, trial=site.trial, turn=site.turn,
            provider="openai", model="m", fixture=False, status="ok", http_status=200,
            latency_s=0.1, request_sha256=log.put_blob(request),
            response_sha256=log.put_blob(_completion(f"reply-{n}"))))
    log.close()

    def replay(prov: ReplayProvider, site: CallSite | None) -> str:
        res = inspected(asyncio.run(prov.call(request, {}, role="x", stream=False,
                                              site=site)), stream=False, api="chat")
        assert res.error is None and res.usage is not None
        return str(json.loads(res.response or b"")["id"])

    prov = ReplayProvider(tmp_path)
    # out of order, as concurrent containers may call: each gets its own recording
    assert [replay(prov, sites[i]) for i in (2, 0, 1)] == ["reply-2", "reply-0", "reply-1"]
    assert replay(prov, sites[1]) == "reply-0"  # all replayed: the first again
    prov = ReplayProvider(tmp_path)
    # no or an unknown site: the earliest recording not yet replayed
    other = CallSite("analyst", "elsewhere", None, None, 9)
    assert [replay(prov, s) for s in (None, other, sites[0], None)] == [
        "reply-0", "reply-1", "reply-2", "reply-0"]
    miss = asyncio.run(prov.call(b"{}", {}, role="x", stream=False, site=sites[0]))
    assert miss.error == "replay_miss" and not miss.upstream_reached


def test_redactor_catches_raw_escaped_and_encoded_keys() -> None:
    import base64
    import urllib.parse

    from runner.gateway.redact import MARK, Redactor

    key = "sk-proj-Ab/c+d=e_0123456789"
    r = Redactor([key])
    for lead in ("", "u", "us", "user:"):
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            data, n = r.redact(b"x" + enc((lead + key + "!").encode()) + b"y")
            assert n >= 1 and MARK in data, (lead, enc)
    for form in (key, json.dumps(key)[1:-1], urllib.parse.quote(key, safe=""),
                 key.encode().hex(), f"Bearer {key}"):
        data, n = r.redact(form.encode())
        assert n == 1 and key.encode() not in data
    assert r.redact(b"nothing here") == (b"nothing here", 0)


def test_vet_worst_case_bounds_every_choice_and_byte() -> None:
    from runner.gateway.config import RequestRules
    from runner.gateway.vet import Refusal, vet, worst_case_usd

    rules = RequestRules(max_n=4)
    v = vet({"model": "m", "n": 3, "messages": [{"role": "user", "content": "hi"}]},
            rules=rules, cap=100)
    assert v.body["max_tokens"] == 100 and v.choices == 3
    price = Price(input_per_mtok=1.0, output_per_mtok=2.0)
    assert worst_case_usd(1000, v, price, rules) == pytest.approx(
        ((1000 + 64) * 1.25 + 3 * 100 * 2.0) / 1e6)  # input at a cache write's price
    with pytest.raises(Refusal, match="n=5"):
        vet({"model": "m", "n": 5, "messages": [{"role": "user", "content": "x"}]},
            rules=rules, cap=100)
    s = vet({"model": "m", "stream": True, "stream_options": {"include_usage": False},
             "messages": [{"role": "user", "content": "x"}]}, rules=rules, cap=100)
    assert s.body["stream_options"] == {"include_usage": True}


def test_upstream_client_uses_httpx_only_behind_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.gateway.upstream_http import HttpClient, HttpxClient, client_for

    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    kw = {"read_timeout": 1.0, "max_response": 10}
    assert isinstance(client_for("https://api.example.com/v1", **kw), HttpClient)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert isinstance(client_for("https://api.example.com/v1", **kw), HttpxClient)
    monkeypatch.setenv("NO_PROXY", "api.example.com")
    assert isinstance(client_for("https://api.example.com/v1", **kw), HttpClient)


def test_the_proxy_client_asks_for_and_reads_an_uncompressed_body() -> None:
    """HttpxClient reads raw bytes (measured and redacted as they came): it must not ask
    for a compressed answer, or an echoed key would pass redaction gzipped."""
    import gzip
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from runner.gateway.upstream_http import HttpxClient

    reply = b'{"echo": "sk-proxy-secret"}'
    seen: list[str] = []

    class Zipping(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            accept = self.headers.get("Accept-Encoding", "")
            seen.append(accept)
            data = gzip.compress(reply) if "gzip" in accept else reply
            self.send_response(200)
            if "gzip" in accept:
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_a: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Zipping)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        c = HttpxClient(f"http://127.0.0.1:{srv.server_address[1]}/v1", read_timeout=5,
                        max_response=1 << 20)

        async def go() -> tuple[int, bytes]:
            try:
                return await c.post("chat/completions", b"{}", {})
            finally:
                await c.aclose()

        assert asyncio.run(go()) == (200, reply)
        assert seen == ["identity"]
    finally:
        srv.shutdown()
        srv.server_close()


# -- upstreams: a discriminated union on `provider` -------------------------------------------
class _Ups(Frozen):
    upstreams: dict[str, UpstreamPolicy]


@pytest.mark.parametrize(("up", "field", "message"), [
    ({"models": ["m"]}, "upstreams.target.provider", "discriminator 'provider'"),
    ({"provider": "gemini", "models": ["m"]}, "upstreams.target.provider",
     "'openai', 'anthropic', 'scripted', 'replay'"),
    ({"provider": "anthropic", "models": ["m"], "credential": {"env": "K"}},
     "upstreams.target.base_url", "Field required"),
    ({"provider": "openai", "models": ["m"], "base_url": "http://x", "credential": {"env": "K"},
      "anthropic_version": "2023-06-01"},
     "upstreams.target", "anthropic_version is for provider anthropic, not openai"),
    ({"provider": "openai", "models": ["m"], "credential": {"env": "K"}},
     "upstreams.target.base_url", "Field required"),
    ({"provider": "openai", "models": ["m"], "base_url": "http://x"},
     "upstreams.target.credential", "Field required"),
    ({"provider": "scripted", "models": ["m"]}, "upstreams.target.script", "Field required"),
    ({"provider": "replay", "models": ["m"]}, "upstreams.target.replay_from",
     "Field required"),
    ({"provider": "scripted", "models": ["m"], "script": "s.yaml", "base_url": "http://x"},
     "upstreams.target", "base_url is for provider openai or anthropic, not scripted"),
    ({"provider": "replay", "models": ["m"], "replay_from": "r", "script": "s.yaml"},
     "upstreams.target", "script is for provider scripted, not replay"),
])
def test_bad_provider_config_is_a_config_error_naming_the_field(
        up: dict[str, object], field: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(_Ups, {"upstreams": {"target": up}}, path="roles.yaml", fix="f")
    assert info.value.field == field and message in str(info.value), str(info.value)


def test_each_provider_builds_its_own_provider_and_keeps_one_shape(tmp_path: Path) -> None:
    script = tmp_path / "s.yaml"
    script.write_text("schema: 1\nrules: []\n")
    (tmp_path / "rec" / "gateway").mkdir(parents=True)
    (tmp_path / "rec" / "gateway" / "calls.jsonl").write_text("")
    ups = {"s": parse_upstream({"provider": "scripted", "models": ["m"], "script": str(script)}),
           "r": parse_upstream({"provider": "replay", "models": ["m"],
                                "replay_from": str(tmp_path / "rec")})}
    assert isinstance(ups["s"], ScriptedUpstream) and isinstance(ups["r"], ReplayUpstream)
    # every variant dumps every provider's keys (None where unused): plans keep one shape
    assert set(ups["s"].model_dump()) == set(ups["r"].model_dump())
    assert ups["s"].model_dump()["base_url"] is None
    assert isinstance(make_provider("s", ups["s"])[0], ScriptedProvider)
    assert isinstance(make_provider("r", ups["r"])[0], ReplayProvider)
