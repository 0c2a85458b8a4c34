"""Attacks on the gateway's responses, embeddings and messages routes: budget tricks per
family, server-side tools and state, a stream with no end, a 100 MB tool result, a token
of another role. Each test fails when its guard is removed (the real gateway on its real
socket, real HTTP upstreams)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from runner.gateway.budget import BudgetPolicy, RunBudget
from runner.gateway.calllog import CallLog
from runner.gateway.config import UpstreamPolicy, parse_upstream
from runner.gateway.redact import MARK
from runner.gateway.server import Binding, Gateway
from tests.fixtures.gateway_upstreams import upstream

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fixtures" / "families_script.yaml"
PRICE = {"input_per_mtok": 1.0, "output_per_mtok": 1.0}


def scripted(**kw: Any) -> UpstreamPolicy:
    return parse_upstream({"provider": "scripted", "script": str(SCRIPT), "models": ["m"],
                           "prices": {"m": PRICE}, "max_tokens": 100, **kw})


def post(gw: Gateway, b: Binding, path: str, body: object, role: str = "analyst"
         ) -> httpx2.Response:
    tok = gw.token_for(role)
    with httpx2.Client(transport=httpx2.HTTPTransport(
            uds=str(b.directory / "gateway.sock")), timeout=60) as c:
        return c.post(f"http://gw{path}", content=json.dumps(body),
                      headers={"authorization": f"Bearer {tok}",
                               "content-type": "application/json"})


MSG = [{"role": "user", "content": "hi"}]
TRICKS: list[tuple[str, dict[str, Any], str, str]] = [
    # (route, body, refused code, text the message must hold)
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10, "max_completion_tokens": 101},
     "max_tokens_over_cap", "max_completion_tokens=101 exceeds the cap 100"),
    ("/v1/chat/completions", {"messages": MSG, "n": 2}, "n_not_allowed",
     "upstreams.target.rules.max_n in cycle.yaml"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10_000_000}, "max_tokens_over_cap",
     "max_output_tokens=10000000 exceeds the cap 100"),
    ("/v1/responses", {"input": "hi", "max_tokens": 5}, "field_not_allowed", "'max_tokens'"),
    ("/v1/messages", {"messages": MSG, "max_tokens": 50,
                      "thinking": {"type": "enabled", "budget_tokens": 5000}},
     "max_tokens_over_cap", "thinking.budget_tokens=5000"),
    ("/v1/messages", {"messages": MSG, "max_tokens": 101}, "max_tokens_over_cap",
     "max_tokens=101 exceeds the cap 100"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, "tool_not_allowed",
     "server-side tools"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "mcp", "server_url": "http://x"}]},
     "tool_not_allowed", "server-side tools"),
    ("/v1/messages", {"messages": MSG, "max_tokens": 5, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, "tool_not_allowed",
     "server-side tools"),
    ("/v1/messages", {"messages": MSG, "max_tokens": 5, "tools": [
        {"type": "code_execution_20250825", "name": "code_execution"}]}, "tool_not_allowed",
     "server-side tools"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"},
     "server_state_not_allowed", "previous_response_id"),
    ("/v1/responses", {"input": "hi", "conversation": "conv_1"}, "server_state_not_allowed",
     "conversation"),
    ("/v1/responses", {"input": "hi", "background": True}, "background_not_allowed",
     "background"),
    ("/v1/responses", {"input": "hi", "background": 0}, "background_not_allowed",
     "background"),  # 0 == False in Python, not in JSON
    ("/v1/responses", {"input": "hi", "stream": 1}, "bad_request", "stream must be true"),
    ("/v1/responses", {"input": "hi", "instructions": [
        {"type": "item_reference", "id": "msg_other"}]}, "bad_request",
     "instructions must be a string"),
    ("/v1/chat/completions", {"messages": [*MSG, {"role": "assistant", "content": None,
                                                  "audio": {"id": "audio_other"}}]},
     "server_state_not_allowed", "messages[1].audio"),
    ("/v1/chat/completions", {"messages": MSG, "stream": 0}, "bad_request",
     "stream must be true"),
    ("/v1/responses", {"input": "hi", "service_tier": "priority"}, "service_tier_not_allowed",
     "service_tier='priority'"),
    ("/v1/messages", {"messages": MSG, "max_tokens": 5, "service_tier": "auto"},
     "service_tier_not_allowed", "service_tier='auto'"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://evil.example/x.png"}]}]},
     "remote_content_not_allowed", "input[0].content[0]"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_file", "file_url": "https://evil.example/x.pdf"}]}]},
     "remote_content_not_allowed", "input[0].content[0]"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://evil.example/x.png"}}]}]},
     "remote_content_not_allowed", "messages[0].content[0].source"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "document", "source": {"type": "file", "file_id": "f"}}]}]}]},
     "remote_content_not_allowed", "messages[0].content[0].content[0].source"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                        "data": "JVBERi0="}}]}]},
     "documents_not_allowed", "rules.allow_documents"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_file", "filename": "a.pdf",
         "file_data": "data:application/pdf;base64,JVBERi0="}]}]},
     "documents_not_allowed", "rules.allow_documents"),
    ("/v1/embeddings", {"input": "hi", "max_tokens": 5}, "field_not_allowed", "'max_tokens'"),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": [
        {"type": "item_reference", "id": "rs_other"}]}]}, "content_part_not_allowed",
     "input[0].summary[0]"),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": [], "content": [
        {"type": "input_file", "file_id": "file_other"}]}]}, "content_part_not_allowed",
     "input[0].content[0]"),
]


@pytest.mark.parametrize(("route", "body", "code", "text"), TRICKS,
                         ids=[f"{t[0].rsplit('/', 1)[-1]}-{t[2]}-{i}"
                              for i, t in enumerate(TRICKS)])
def test_budget_and_remote_content_tricks_are_refused_naming_the_field(
        tmp_path: Path, route: str, body: dict[str, Any], code: str, text: str) -> None:
    up = scripted(rules={"allow_tools": True, "allow_images": True})
    with Gateway(tmp_path, "t", {"target": up}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        r = post(gw, b, route, {"model": "m", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert text in err["message"]
    if route.startswith("/v1/messages"):
        assert r.json()["type"] == "error" and code in err["message"]
    else:
        assert err["code"] == code
    recs = CallLog(tmp_path / "gateway").records()
    assert [(x.status, x.error, x.request_stored) for x in recs] == [("refused", code, False)]


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {}}}]}),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f",
                                                 "parameters": {}}]}),
    ("/v1/messages", {"messages": MSG, "max_tokens": 5,
                      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
])
def test_function_tools_need_the_policy_and_the_error_names_its_place(
        tmp_path: Path, route: str, body: dict[str, Any]) -> None:
    with Gateway(tmp_path, "t", {"target": scripted()}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        refused = post(gw, b, route, {"model": "m", **body})
    assert refused.status_code == 400
    assert "upstreams.target.rules.allow_tools in cycle.yaml" in refused.text
    with Gateway(tmp_path / "on", "t", {"target": scripted(rules={"allow_tools": True})},
                 {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        assert post(gw, b, route, {"model": "m", **body}).status_code == 200


@pytest.mark.parametrize(("route", "body", "cap_key"), [
    ("/v1/chat/completions", {"messages": MSG}, "max_tokens"),
    ("/v1/responses", {"input": "hi"}, "max_output_tokens"),
    ("/v1/messages", {"messages": MSG}, "max_tokens"),
])
def test_missing_cap_gets_the_policy_cap_and_worst_case_usage_fits_the_reservation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str, body: dict[str, Any],
        cap_key: str) -> None:
    """The upstream bills the worst case it can (every byte a token, the whole cap, half
    of it reasoning): the reservation covers it, so admission never halts."""
    monkeypatch.setenv("CBX_WORST_KEY", "sk-worst")
    budget = RunBudget(BudgetPolicy(limit_usd=1.0, reservation_usd=0.0))
    with upstream() as (url, srv):
        provider = "anthropic" if route.startswith("/v1/messages") else "openai"
        up = parse_upstream({
            "provider": provider, "base_url": url.removesuffix("/v1") if provider ==
            "anthropic" else url, "credential": {"env": "CBX_WORST_KEY"},
            "models": ["worst-m"], "max_tokens": 777,
            "prices": {"worst-m": {"input_per_mtok": 1, "output_per_mtok": 3,
                                   "cache_write_per_mtok": 1.25}}})
        with Gateway(tmp_path, "w", {"target": up}, {"analyst": "target"}, budget) as gw, \
                gw.bound("analyst", stage="s", uid=os.getuid()) as b:
            r = post(gw, b, route, {"model": "worst-m", **body})
            assert r.status_code == 200, r.text
    assert srv.requests[0][cap_key] == 777
    rec = CallLog(tmp_path / "gateway").records()[0]
    assert rec.usage is not None and rec.usage.completion_tokens == 777
    assert rec.cost_basis == "measured"
    assert budget.halted is None, budget.halted


def test_a_stream_with_no_end_stops_at_the_deadline_charged_its_worst_case(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBX_ENDLESS_KEY", "sk-endless")
    budget = RunBudget(BudgetPolicy(limit_usd=1.0, reservation_usd=0.0))
    with upstream() as (url, _srv):
        up = parse_upstream({
            "provider": "anthropic", "base_url": url.removesuffix("/v1"),
            "credential": {"env": "CBX_ENDLESS_KEY"}, "models": ["endless-m"],
            "max_tokens": 50, "call_deadline_s": 2, "prices": {"endless-m": PRICE}})
        with Gateway(tmp_path, "e", {"target": up}, {"analyst": "target"}, budget) as gw, \
                gw.bound("analyst", stage="s", uid=os.getuid()) as b:
            t0 = time.monotonic()
            r = post(gw, b, "/v1/messages", {"model": "endless-m", "stream": True,
                                             "messages": MSG})
            took = time.monotonic() - t0
    assert r.status_code == 502 and took < 10
    assert r.json()["type"] == "error" and "upstream_deadline" in r.json()["error"]["message"]
    rec = CallLog(tmp_path / "gateway").records()[0]
    assert (rec.status, rec.error, rec.api, rec.stream) == (
        "infra_error", "upstream_deadline", "messages", True)
    assert rec.cost_basis == "upper_bound" and rec.cost_usd is not None and rec.cost_usd > 0
    assert budget.halted is None and budget.totals()["total"]["bounded_calls"] == 1  # type: ignore[index]


def test_a_stream_without_usage_is_bounded_and_admission_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue-20 case: an OpenAI-compatible stream that ends with [DONE] but no usage."""
    from tests.fixtures.fake_upstream import serve

    srv = serve("127.0.0.1", 0)
    import threading

    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("CBX_NOUSE_KEY", "sk-x")
    budget = RunBudget(BudgetPolicy(limit_usd=1.0, reservation_usd=0.0))
    try:
        up = parse_upstream({"provider": "openai", "credential": {"env": "CBX_NOUSE_KEY"},
                             "base_url": f"http://127.0.0.1:{srv.server_address[1]}/v1",
                             "models": ["nousage-s", "ok-s"], "max_tokens": 10,
                             "prices": {"nousage-s": PRICE, "ok-s": PRICE}})
        with Gateway(tmp_path, "n", {"target": up}, {"analyst": "target"}, budget) as gw, \
                gw.bound("analyst", stage="s", uid=os.getuid()) as b:
            statuses = [post(gw, b, "/v1/chat/completions",
                             {"model": m, "stream": True, "messages": MSG}).status_code
                        for m in ("nousage-s", "ok-s")]
    finally:
        srv.shutdown()
    recs = CallLog(tmp_path / "gateway").records()
    assert statuses == [200, 200], [r.error for r in recs]
    assert recs[0].cost_basis == "upper_bound" and recs[1].cost_basis == "measured"
    assert budget.halted is None


def test_a_free_count_tokens_call_is_refused_once_admission_halted(tmp_path: Path) -> None:
    """count_tokens costs nothing and needs no reservation, but after a halt (e.g. the
    call log could not be written) nothing reaches an upstream."""
    budget = RunBudget(BudgetPolicy(limit_usd=1.0))
    with Gateway(tmp_path, "ct", {"target": scripted()}, {"analyst": "target"},
                 budget) as gw, gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        body = {"model": "m", "messages": MSG}
        assert post(gw, b, "/v1/messages/count_tokens", body).status_code == 200
        budget.halt("call log write failed: disk full")
        r = post(gw, b, "/v1/messages/count_tokens", body)
    assert r.status_code == 429 and "admission halted: call log write failed" in r.text
    recs = CallLog(tmp_path / "gateway").records()
    assert [(x.status, x.error) for x in recs] == [("ok", None), ("refused", "budget")]


def test_count_tokens_calls_count_against_the_call_caps_and_reserve_nothing(
        tmp_path: Path) -> None:
    """count_tokens is never billed, but it reaches the upstream: ``max_calls`` and
    ``per_role_calls`` count it (otherwise a container past its call cap could go on
    sending megabyte bodies upstream), while no money is held for it."""
    budget = RunBudget(BudgetPolicy(limit_usd=0.01, reservation_usd=0.05, max_calls=3,
                                    per_role_calls={"analyst": 2}))
    with Gateway(tmp_path, "ct", {"target": scripted()}, {"analyst": "target"},
                 budget) as gw, gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        body = {"model": "m", "messages": MSG}
        codes = [post(gw, b, "/v1/messages/count_tokens", body).status_code
                 for _ in range(3)]
        last = post(gw, b, "/v1/messages/count_tokens", body)
    assert codes == [200, 200, 429]
    assert "per-role max_calls 2 reached for analyst" in last.text
    totals = budget.totals()["total"]
    assert totals["calls"] == 2 and totals["spent_usd"] == 0.0  # type: ignore[index]
    recs = CallLog(tmp_path / "gateway").records()
    assert [(x.status, x.error) for x in recs] == [
        ("ok", None), ("ok", None), ("refused", "budget"), ("refused", "budget")]


def test_a_100mb_tool_result_is_refused_from_its_length_without_being_held(
        tmp_path: Path) -> None:
    with Gateway(tmp_path, "big", {"target": scripted()}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        prefix = json.dumps({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                          "content": ""}]}]})[:-6].encode()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(b.directory / "gateway.sock"))
        s.sendall((f"POST /v1/messages HTTP/1.1\r\nHost: gw\r\nx-api-key: "
                   f"{gw.token_for('analyst')}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {100 * 1024 * 1024}\r\n\r\n").encode() + prefix)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
        s.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    recs = CallLog(tmp_path / "gateway").records()
    assert [(r.error, r.api, r.request_bytes) for r in recs] == [
        ("request_too_large", "messages", 0)]


def test_a_token_of_another_role_is_refused_on_every_route(tmp_path: Path) -> None:
    ups = {"target": scripted(), "optimizer": scripted()}
    with Gateway(tmp_path, "x", ups, {"analyst": "target", "worker": "optimizer"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as a, \
            gw.bound("worker", stage="s", uid=os.getuid()):
        stolen = gw.token_for("worker")
        codes = []
        for path, body in (("/v1/chat/completions", {"messages": MSG}),
                           ("/v1/responses", {"input": "hi"}),
                           ("/v1/embeddings", {"input": "hi"}),
                           ("/v1/messages", {"messages": MSG, "max_tokens": 5})):
            for header in ({"authorization": f"Bearer {stolen}"}, {"x-api-key": stolen}):
                with httpx2.Client(transport=httpx2.HTTPTransport(
                        uds=str(a.directory / "gateway.sock"))) as c:
                    codes.append(c.post(f"http://gw{path}", headers=header,
                                        content=json.dumps({"model": "m", **body})).status_code)
    assert codes == [401] * 8
    recs = CallLog(tmp_path / "gateway").records()
    assert {r.error for r in recs} == {"bad_token"} and len(recs) == 8
    assert {r.role for r in recs} == {"analyst"}


def _items_upstream(url: str, **kw: Any) -> UpstreamPolicy:
    return parse_upstream({"provider": "openai", "base_url": url,
                           "credential": {"env": "CBX_ITEMS_KEY"},
                           "models": ["items", "items-big", "items-echo-key"],
                           "max_tokens": 10, "prices": {"items": PRICE, "items-big": PRICE,
                                                        "items-echo-key": PRICE}, **kw})


def test_an_item_id_not_answered_to_this_container_never_reaches_the_upstream(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The upstream reads a stored item by its id, so an input item that carries an id
    (not only an item reference) is a read of what the upstream keeps: only ids of the
    container's own answers are sent. Case b tries case a's reasoning item inline (sent
    without the id), as a reference (refused), and an id it made up (sent without it)."""
    monkeypatch.setenv("CBX_ITEMS_KEY", "sk-items")
    stolen = [{"role": "user", "content": "go on"},
              {"type": "reasoning", "id": "rs_1", "summary": []}]
    with upstream() as (url, srv), \
            Gateway(tmp_path, "i", {"target": _items_upstream(url)},
                    {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", case="a", uid=os.getuid()) as a, \
            gw.bound("analyst", stage="s", case="b", uid=os.getuid()) as b:
        assert post(gw, a, "/v1/responses", {"model": "items", "input": "hi"}
                    ).status_code == 200
        tries = [post(gw, b, "/v1/responses", {"model": "items", "input": i}) for i in (
            stolen, [{"type": "item_reference", "id": "rs_1"}],
            [{"type": "reasoning", "id": "rs_made_up", "summary": []},
             {"type": "message", "id": "msg_1", "role": "assistant",
              "content": [{"type": "output_text", "text": "x"}]}])]
        own = post(gw, a, "/v1/responses", {"model": "items", "input": [
            *stolen, {"type": "item_reference", "id": "msg_1"}]})
    assert [t.status_code for t in tries] == [200, 400, 200], [t.text for t in tries]
    assert tries[1].json()["error"]["code"] == "item_reference_unknown"
    assert own.status_code == 200, own.text
    sent = [r["input"] for r in srv.requests]
    assert sent[1] == [stolen[0], {"type": "reasoning", "summary": []}]  # b: id dropped
    assert [{k: v for k, v in i.items() if k != "content"} for i in sent[2]] == [
        {"type": "reasoning", "summary": []}, {"type": "message", "role": "assistant"}]
    assert sent[3][1] == {"type": "reasoning", "id": "rs_1", "summary": []}  # a: its own
    assert sent[3][2]["id"] == "msg_1" and sent[3][2]["content"][0]["text"] == "y" * 10
    recs = CallLog(tmp_path / "gateway").records()
    assert [(r.case, r.status, r.error, r.dropped_ids, r.resolved_references)
            for r in recs] == [
        ("a", "ok", None, None, None), ("b", "ok", None, 1, None),
        ("b", "refused", "item_reference_unknown", None, None), ("b", "ok", None, 2, None),
        ("a", "ok", None, None, 1)]


def test_a_referenced_item_is_the_redacted_one_the_container_was_answered_with(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upstream that echoes its key in an output item: the container gets the item
    redacted, and a reference to it sends (and records) that redacted item, never the
    upstream's own bytes with the key in them."""
    monkeypatch.setenv("CBX_ITEMS_KEY", "sk-items-secret-value")
    with upstream() as (url, srv), \
            Gateway(tmp_path, "k", {"target": _items_upstream(url)},
                    {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", case="a", uid=os.getuid()) as a:
        first = post(gw, a, "/v1/responses", {"model": "items-echo-key", "input": "hi"})
        again = post(gw, a, "/v1/responses", {"model": "items", "input": [
            {"type": "item_reference", "id": "msg_1"}]})
    assert first.status_code == 200 and again.status_code == 200, again.text
    assert "sk-items-secret-value" not in first.text
    sent = srv.requests[1]["input"][0]
    assert sent["id"] == "msg_1"
    assert sent["content"][0]["text"] == MARK.decode()
    for f in (tmp_path / "gateway").rglob("*"):
        if f.is_file():
            assert b"sk-items-secret-value" not in f.read_bytes(), f
    recs = CallLog(tmp_path / "gateway").records()
    assert [(r.status, r.resolved_references) for r in recs] == [("ok", None), ("ok", 1)]
    assert recs[0].redactions == 1


def test_referenced_items_are_charged_to_the_sockets_byte_rate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reference of a few bytes puts a large item in the request the gateway parses,
    prices and sends: the item's bytes count as the container's body bytes, so a loop of
    small requests referencing a 200 KB answer cannot take more of the controller's CPU
    than the same bytes sent outright."""
    monkeypatch.setenv("CBX_ITEMS_KEY", "sk-items")
    limits = {"body_bytes_per_s": 1000, "body_bytes_burst": 500_000}
    with upstream() as (url, srv):
        up = _items_upstream(url, limits=limits, max_request_bytes=500_000)
        with Gateway(tmp_path, "r", {"target": up}, {"analyst": "target"}) as gw, \
                gw.bound("analyst", stage="s", case="a", uid=os.getuid()) as a:
            assert post(gw, a, "/v1/responses", {"model": "items-big", "input": "hi"}
                        ).status_code == 200
            ref = {"model": "items", "input": [{"type": "item_reference", "id": "msg_1"}]}
            codes = [post(gw, a, "/v1/responses", ref) for _ in range(3)]
    assert [c.status_code for c in codes] == [200, 200, 429], [c.text for c in codes]
    assert codes[2].json()["error"]["code"] == "byte_rate_limited"
    assert "referenced items" in codes[2].json()["error"]["message"]
    assert len(srv.requests) == 3
    assert len(srv.requests[1]["input"][0]["content"][0]["text"]) == 200_000


def test_a_large_answer_is_parsed_off_the_loop_other_containers_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One container's large answer (here 200 KB; up to max_response_bytes, 16 MB, whose
    parse takes seconds) is parsed for its usage and redacted on the gateway's pool: the
    parse of it below does not return until another container's call was answered,
    which cannot happen while it holds the loop every binding is served on."""
    import threading

    from runner.gateway import usage as usage_mod

    script = tmp_path / "big.yaml"
    script.write_text("schema: 1\nrules:\n  - when: {contains: [BIG]}\n    reply: "
                      + "x" * 200_000 + "\ndefault: {reply: small}\n")
    up = parse_upstream({"provider": "scripted", "script": str(script), "models": ["m"],
                         "prices": {"m": PRICE}, "max_tokens": 100})
    parsing, answered = threading.Event(), threading.Event()
    seen: list[bool] = []
    real = usage_mod.inspect

    def slow_inspect(data: bytes, **kw: Any) -> Any:
        if len(data) > 100_000:
            parsing.set()
            seen.append(answered.wait(10))  # on the loop thread: never, until it times out
        return real(data, **kw)

    monkeypatch.setattr(usage_mod, "inspect", slow_inspect)
    with Gateway(tmp_path, "big", {"target": up}, {"analyst": "target", "evaluator": "target"}
                 ) as gw, gw.bound("analyst", stage="s", uid=os.getuid()) as big, \
            gw.bound("evaluator", stage="e", uid=os.getuid()) as other:
        results: list[int] = []
        t = threading.Thread(target=lambda: results.append(post(
            gw, big, "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "BIG"}]}).status_code))
        t.start()
        assert parsing.wait(10)
        r = post(gw, other, "/v1/chat/completions", {"model": "m", "messages": MSG},
                 role="evaluator")
        answered.set()
        t.join(30)
    assert r.status_code == 200 and results == [200]
    assert seen == [True], "the other container's call waited for the large answer's parse"


def test_own_reasoning_ids_sent_again_are_reserved_at_what_the_upstream_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attack review: a container's own reasoning items, sent again by id (as agents
    do), make the upstream read its stored hidden reasoning as input tokens, but the
    worst case priced only the ~50 bytes each item takes: 60 of them cost $2.52 on a
    $0.07 reservation and spending passed the limit. Each answer an id sent came from
    now adds its output tokens to the worst case, so the limit holds."""
    monkeypatch.setenv("CBX_ITEMS_KEY", "sk-items")
    cap, price = 4096, {"input_per_mtok": 10, "output_per_mtok": 10}
    k = 12
    with upstream() as (url, srv):
        up = parse_upstream({
            "provider": "openai", "base_url": url, "credential": {"env": "CBX_ITEMS_KEY"},
            "models": ["items-hidden"], "max_tokens": cap, "prices": {"items-hidden": price}})
        one_call = (cap + 200) * 10 / 1e6  # a first call: its cap and a small body
        budget = RunBudget(BudgetPolicy(limit_usd=k * one_call + 0.1, reservation_usd=0.0))
        with Gateway(tmp_path, "rs", {"target": up}, {"analyst": "target"}, budget) as gw, \
                gw.bound("analyst", stage="s", case="a", uid=os.getuid()) as a:
            for _ in range(k):
                r = post(gw, a, "/v1/responses", {"model": "items-hidden", "input": "think"})
                assert r.status_code == 200, r.text
            ids = [{"type": "reasoning", "id": f"rs_{n}", "summary": []} for n in range(k)]
            last = post(gw, a, "/v1/responses", {"model": "items-hidden", "input": [
                *ids, {"role": "user", "content": "go"}]})
    total = budget.totals()["total"]
    assert last.status_code == 429 and "would be exceeded" in last.text, last.text
    assert total["spent_usd"] <= budget.policy.limit_usd  # type: ignore[index,operator]
    assert budget.halted is None
    assert len(srv.requests) == k  # the last call never reached the upstream


def test_an_answer_whose_parse_fails_is_charged_and_recorded_not_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer is parsed (for usage) and redacted after the upstream call; an
    exception there (an attack review found two) escaped the call's error handling: the
    call that reached the upstream was recorded as refused at no cost, its reservation
    never settled, the container got a 500. It is an internal_error charged its worst
    case, like any call whose usage is unknown."""
    from runner.gateway import usage as usage_mod

    def broken(data: bytes, **kw: Any) -> Any:
        raise TypeError("unhashable type: 'list'")

    monkeypatch.setattr(usage_mod, "inspect", broken)
    budget = RunBudget(BudgetPolicy(limit_usd=1.0))
    with Gateway(tmp_path, "pf", {"target": scripted()}, {"analyst": "target"}, budget
                 ) as gw, gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        r = post(gw, b, "/v1/chat/completions", {"model": "m", "messages": MSG})
    assert r.status_code == 502 and "internal_error: TypeError" in r.text, r.text
    (rec,) = CallLog(tmp_path / "gateway").records()
    assert (rec.status, rec.error, rec.cost_basis) == (
        "infra_error", "internal_error: TypeError", "upper_bound")
    total = budget.totals()["total"]
    assert total["complete"] and total["bounded_calls"] == 1  # type: ignore[index]
